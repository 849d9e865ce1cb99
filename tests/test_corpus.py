"""Corpus manifest, filter and split logic on fake site-packages and fake wheels (no network)."""
import json
import zipfile

import pytest

from kdtree_lib import corpus
from kdtree_lib.corpus import FileFilter, Manifest, Package

FILES = {
    "alpha": {"alpha/__init__.py": "import os\r\n", "alpha/core.py": "\ufeffdef f():\n    return 1\n",
              "alpha/tests/test_core.py": "def test(): pass\n", "alpha/data.json": "{}",
              "alpha/empty.py": "  \n", "alpha/sub/deep.py": "X = 2\n"},
    "beta": {"beta/__init__.py": "from .graph import Graph\n", "beta/graph.py": "class Graph:\n    pass\n"},
}


def make_site(root, versions=None):
    """A site-packages folder holding `alpha` and `beta` with dist-info RECORDs (as pip writes them)."""
    versions = versions or {"alpha": "1.0", "beta": "2.0"}
    for name, files in FILES.items():
        for path, text in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(text.encode())
        info = root / f"{name}-{versions[name]}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {versions[name]}\n")
        (info / "RECORD").write_text("".join(f"{p},,\n" for p in [*files, f"{info.name}/METADATA"]))
    return root


def make_wheels(root):
    root.mkdir()
    for name, version in (("alpha", "1.0"), ("beta", "2.0")):
        with zipfile.ZipFile(root / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
            for path, text in FILES[name].items():
                wheel.writestr(path, text.encode())
            wheel.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\n")
    return root


def write_manifest(path, select=()):
    raw = {"filter": {"suffix": ".py", "exclude_dirs": ["tests"], "max_bytes": 1000},
           "packages": [{"name": "alpha", "version": "1.0", "split": "train", "select": list(select)},
                        {"name": "beta", "version": "2.0", "split": "heldout"}]}
    path.write_text(json.dumps(raw))
    return path


def test_filter_and_select_rules():
    flt = FileFilter(exclude_dirs=("tests",), max_bytes=100)
    assert flt.accepts("pkg/a.py", 10)
    assert not flt.accepts("pkg/tests/a.py", 10)
    assert not flt.accepts("pkg/a.py", 101)
    assert not flt.accepts("pkg/a.json", 10)
    assert not flt.accepts("pkg-1.0.dist-info/x.py", 10)
    assert not flt.accepts("../../bin/script.py", 10)  # installed outside site-packages (wheel: pkg.data/)
    assert flt.accepts("pkg/tests.py", 10)  # only folders are excluded by name
    package = Package("p", "1", "train", select=("-p/models/", "+p/models/keep/", "-p/models/keep/no.py"))
    assert package.wanted("p/core.py")
    assert not package.wanted("p/models/drop/x.py")
    assert package.wanted("p/models/keep/x.py")
    assert not package.wanted("p/models/keep/no.py")


def test_normalize():
    assert corpus.normalize(b"\xef\xbb\xbfa\r\nb\rc\n") == "a\nb\nc\n"
    assert corpus.normalize(b"\xff\xfe") is None
    assert corpus.normalize(b" \n\t") is None


def test_site_and_wheels_agree_and_verify(tmp_path):
    manifest = Manifest.load(write_manifest(tmp_path / "m.json"))
    site = make_site(tmp_path / "site")
    from_site = corpus.read_packages(manifest, site_packages=[str(site)], from_site=True)
    from_wheels = corpus.read_packages(manifest, wheels_dir=make_wheels(tmp_path / "wheels"))
    assert [b.sha256 for b in from_site] == [b.sha256 for b in from_wheels]
    alpha, beta = from_site
    assert [path for path, _ in alpha.documents] == ["alpha/__init__.py", "alpha/core.py", "alpha/sub/deep.py"]
    assert alpha.skipped == 1  # alpha/empty.py
    assert alpha.documents[0][1] == "import os\n"
    # the manifest written from a build verifies that build, and only that build
    (tmp_path / "m.json").write_text(json.dumps(corpus.manifest_dict(manifest, from_site)))
    pinned = Manifest.load(tmp_path / "m.json")
    assert corpus.verify(pinned, from_site) == []
    (site / "beta/graph.py").write_text("class Graph:\n    edges = 0\n")
    changed = corpus.read_packages(pinned, site_packages=[str(site)], from_site=True)
    problems = corpus.verify(pinned, changed)
    assert len(problems) == 1 and problems[0].startswith("beta==2.0")


def test_version_mismatch_lists_every_package(tmp_path):
    manifest = Manifest.load(write_manifest(tmp_path / "m.json"))
    site = make_site(tmp_path / "site", versions={"alpha": "1.1", "beta": "2.1"})
    with pytest.raises(LookupError, match=r"alpha 1.1 is installed.*beta 2.1 is installed"):
        corpus.read_packages(manifest, site_packages=[str(site)], from_site=True)


def test_cli_build_splits_by_package(tmp_path, capsys):
    path = write_manifest(tmp_path / "m.json", select=("-alpha/sub/",))
    site = make_site(tmp_path / "site")
    args = ["build", "--out", str(tmp_path / "out"), "--manifest", str(path), "--from-site-packages",
            "--site-packages", str(site)]
    assert corpus.main(args + ["--update-manifest"]) == 0
    assert corpus.main(args) == 0  # rebuild verifies against the measured manifest
    train = list(corpus.read_documents(tmp_path / "out", "train"))
    heldout = list(corpus.read_documents(tmp_path / "out", "heldout"))
    assert train == ["import os\n", "def f():\n    return 1\n"]
    assert heldout == ["from .graph import Graph\n", "class Graph:\n    pass\n"]
    raw = json.loads(path.read_text())
    assert raw["splits"]["train"]["packages"] == ["alpha"] and raw["splits"]["heldout"]["files"] == 2
    (site / "alpha/core.py").write_text("changed\n")
    assert corpus.main(args) == 1
    assert "alpha==1.0" in capsys.readouterr().err


def test_committed_manifest_is_consistent():
    raw = json.loads(corpus.MANIFEST_PATH.read_text())
    manifest = Manifest.load()
    train = {p.name for p in manifest.split_packages("train")}
    heldout = {p.name for p in manifest.split_packages("heldout")}
    assert "networkx" in heldout and not train & heldout
    for split in corpus.SPLITS:
        members = [p for p in raw["packages"] if p["split"] == split]
        assert raw["splits"][split]["files"] == sum(p["files"] for p in members)
        assert raw["splits"][split]["bytes"] == sum(p["bytes"] for p in members)
    assert all(len(p.sha256) == 64 for p in manifest.packages) and len(manifest.sha256) == 64
    assert 20e6 <= raw["bytes"] <= 80e6


def test_heldout_prompts_cut_at_lines(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    lines = "".join(f"line {i:03d} of the file\n" for i in range(200))
    with open(build / "corpus-heldout.jsonl", "w") as f:
        for name in ("a", "b", "c", "short"):
            text = lines if name != "short" else "x = 1\n"
            f.write(json.dumps({"package": "pkg", "path": f"pkg/{name}.py", "text": text}) + "\n")
    prompts = corpus.heldout_prompts(build, 3, 200, seed=1)
    assert [p["path"] for p in prompts] == ["pkg/a.py", "pkg/b.py", "pkg/c.py"]
    for p in prompts:
        assert p["text"].startswith("line ") and p["text"].endswith("\n") and len(p["text"]) <= 200
        assert lines[p["start"]:].startswith(p["text"])
    assert prompts == corpus.heldout_prompts(build, 3, 200, seed=1)
    with pytest.raises(ValueError, match="count"):
        corpus.heldout_prompts(build, 4, 200, seed=1)


def test_committed_prompts_are_heldout():
    heldout = {p.name for p in Manifest.load().split_packages("heldout")}
    prompts = [json.loads(line) for line in corpus.PROMPTS_PATH.read_text().splitlines()]
    assert len(prompts) == 64 and {p["package"] for p in prompts} <= heldout
