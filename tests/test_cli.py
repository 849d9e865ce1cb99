"""Every command refuses a bad input in one line `prog: message` on stderr, exit status 2, no traceback;
a bug keeps its traceback."""
import numpy as np
import pytest

from kdtree_lib import checks, cli


@cli.command
def toy_main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m tests.test_cli")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--what", choices=("value", "path", "numpy", "bug", "refused"), default=None)
    args = parser.parse_args(argv)
    if args.n < 1:
        raise cli.Refused(f"--n: {args.n}; expected at least 1\n(a second line)")
    if args.what == "value":
        checks.framework([1, 2])  # kdtree_lib's own check: a refusal
    if args.what == "path":
        open("/nonexistent/folder/file.txt")
    if args.what == "numpy":
        np.zeros(3).reshape(2, 2)  # a ValueError raised by another library: a bug here
    if args.what == "bug":
        {}["missing"]
    if args.what == "refused":
        raise cli.Refused("needs something")
    return 0


PROG = cli.prog_of(toy_main)  # python -m <this module>, however pytest imported it


def refused(capsys, argv) -> str:
    assert toy_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


def test_a_refused_value_is_one_line_naming_the_command(capsys):
    assert refused(capsys, ["--n", "0"]) == f"{PROG}: --n: 0; expected at least 1; (a second line)\n"


def test_a_value_error_of_kdtree_lib_is_a_refusal(capsys):
    assert refused(capsys, ["--what", "value"]) == \
        f"{PROG}: expected a numpy array, torch tensor or cupy array, got list\n"


def test_a_usage_error_is_one_line_without_the_usage_block(capsys):
    assert "argument --n: invalid int value: 'x'" in refused(capsys, ["--n", "x"])
    assert "unrecognized arguments: --typo" in refused(capsys, ["--typo"])
    assert "argument --what: invalid choice" in refused(capsys, ["--what", "other"])


def test_a_missing_file_names_the_path(capsys):
    assert refused(capsys, ["--what", "path"]) == \
        f"{PROG}: /nonexistent/folder/file.txt: No such file or directory\n"


def test_a_dedicated_refusal(capsys):
    assert refused(capsys, ["--what", "refused"]).endswith(": needs something\n")


def test_bugs_keep_their_traceback():
    with pytest.raises(KeyError):
        toy_main(["--what", "bug"])
    with pytest.raises(ValueError, match="reshape"):
        toy_main(["--what", "numpy"])


def test_kdtree_traceback_shows_a_refusals_traceback(monkeypatch):
    monkeypatch.setenv("KDTREE_TRACEBACK", "1")
    with pytest.raises(cli.Refused, match="--n: 0"):
        toy_main(["--n", "0"])


def test_help_still_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_:
        toy_main(["--help"])
    assert exit_.value.code == 0 and "--n" in capsys.readouterr().out


def test_require_cuda_says_so_in_one_line(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cli.Refused, match="^needs a CUDA GPU"):
        cli.require_cuda()


def rank_error(trace: str):
    torch = pytest.importorskip("torch")
    message = "\n\n-- Process 1 terminated with the following error:\n" + trace
    return torch.multiprocessing.ProcessRaisedException(message, 1, 4242)


def test_a_refusal_in_a_spawned_rank_is_one_line_too():
    """model.tp.launch's ranks hand their errors back as traceback text (torch.multiprocessing)."""
    ours = cli.PACKAGE_DIR / "model" / "checkpoint.py"
    trace = (f'Traceback (most recent call last):\n  File "{ours}", line 9, in read\n    raise ValueError(...)\n'
             "ValueError: checkpoint: tensor model.norm.weight is missing in /somewhere\n")
    assert cli.rank_refusal(rank_error(trace)) == "rank 1: checkpoint: tensor model.norm.weight is missing in /somewhere"
    elsewhere = trace.replace(str(ours), "/usr/lib/python3/site-packages/numpy/core/shape_base.py")
    assert cli.rank_refusal(rank_error(elsewhere)) is None, "a ValueError raised by another library is a bug"
    assert cli.rank_refusal(rank_error(trace.replace("ValueError: checkpoint", "KeyError: checkpoint"))) is None
    assert cli.rank_refusal(ValueError("not from a rank")) is None


def test_require_cuda_for_the_kernels_needs_cupy_too(monkeypatch):
    torch = pytest.importorskip("torch")
    from kdtree_lib import backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "cuda_available", lambda: False)
    cli.require_cuda()  # torch's own GPU work needs no CuPy
    with pytest.raises(cli.Refused, match="^needs a CUDA GPU that CuPy sees"):
        cli.require_cuda(kernels=True)
