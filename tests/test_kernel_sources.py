"""The kernel sources as the compilers see them (CPU only; one test builds with nvcc where it is installed).

CuPy's compile cache keys on the source text alone, so kdtree_lib.cuda.kernel_source folds a hash of
the headers into it: every header a kernel file includes, directly or through another header, must
be one that hash covers, or an edit to it would leave a stale cubin in the cache. NVRTC (run time)
and nvcc (CI's compile checks) both find the headers by `-I kernels/` alone, so every include names a
file in that folder. The PTX wrappers several kernel files use live in common.cuh once, and no helper,
type or macro is defined in two kernel files. kdtree_lib.kernel_diff (every kernel's SASS and ptxas
resources against a git commit's) reads cuobjdump's listing per kernel and tells a changed kernel from
an unchanged one.
"""
from __future__ import annotations

import re
import shutil

import pytest

from kdtree_lib import cuda
from kdtree_lib.paths import KERNEL_DIR

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
KERNEL_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


def _includes(path) -> list[tuple[str, str]]:
    return INCLUDE.findall(path.read_text())


def _included_headers(kernel_dir, file_name: str) -> set[str]:
    """The quoted includes of kernel_dir/file_name, followed through the headers."""
    seen: set[str] = set()
    todo = [file_name]
    while todo:
        for _, header in _includes(kernel_dir / todo.pop()):
            if header not in seen:
                seen.add(header)
                todo.append(header)
    return seen


def test_the_kernel_folder_has_kernels():
    assert {"moe_int4.cu", "verify_attn.cu", "probes.cu"} <= set(KERNEL_FILES)


@pytest.mark.parametrize("path", sorted(KERNEL_DIR.glob("*.cu*")), ids=lambda p: p.name)
def test_every_include_is_a_header_of_the_kernel_folder(path):
    """No system header (NVRTC compiles without them) and nothing outside kernels/ (only -I kernels/)."""
    for kind, header in _includes(path):
        assert kind == '"', f"{path.name} includes <{header}>: NVRTC builds have no system headers"
        assert (KERNEL_DIR / header).is_file(), f"{path.name} includes {header}, which is not in {KERNEL_DIR}"


@pytest.mark.parametrize("file_name", KERNEL_FILES)
def test_an_edit_to_any_included_header_changes_the_source_cupy_caches(file_name, tmp_path, monkeypatch):
    kernel_dir = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, kernel_dir)
    monkeypatch.setattr(cuda, "KERNEL_DIR", kernel_dir)
    headers = _included_headers(kernel_dir, file_name)
    assert headers, f"{file_name} includes no header"
    for header in sorted(headers):
        before = cuda.kernel_source(file_name)
        with open(kernel_dir / header, "a") as f:
            f.write("// edited\n")
        assert cuda.kernel_source(file_name) != before, f"an edit to {header} leaves {file_name}'s cache key as it was"


def test_the_verify_attention_header_reaches_common_through_its_include():
    assert "common.cuh" in _included_headers(KERNEL_DIR, "verify_attn.cu")
    assert "common.cuh" in _included_headers(KERNEL_DIR, "verify_attn_sm90a.cu")


# Each of these PTX instructions is wrapped once, in common.cuh; a kernel file writing its own
# wrapper again would be a second owner of the same helper.
SHARED_PTX = ("%%dynamic_smem_size", "cvta.to.shared", "cp.async.cg.shared.global", "cp.async.commit_group",
              "cp.async.wait_group", "cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32", "mma.sync.aligned.m16n8k16")


@pytest.mark.parametrize("instruction", SHARED_PTX)
def test_shared_ptx_wrappers_are_written_once_in_common(instruction):
    holders = sorted(p.name for p in KERNEL_DIR.glob("*.cu*") if instruction in p.read_text())
    assert holders == ["common.cuh"], f"{instruction!r} is written in {holders}"


@pytest.mark.parametrize("typedef", ["u16", "u32", "u64", "i64"])
def test_the_word_typedefs_are_written_once_in_common(typedef):
    pattern = re.compile(rf"\btypedef\b[^;]*\b{typedef}\s*;")
    holders = sorted(p.name for p in KERNEL_DIR.glob("*.cu*") if pattern.search(p.read_text()))
    assert holders == ["common.cuh"], f"typedef {typedef} is written in {holders}"


# One owner per helper: a device function, a type alias, a struct or a macro is defined in one kernels/
# file. Namespace scope only (column 0): a function's local `using S = ...` is its own.
DEFINITIONS = {
    "function": re.compile(r"^(?:template\s*<[^\n]*>\s*)?(?:__host__\s+)?__device__\b[^(;{]*?\b(\w+)\s*\(",
                           re.MULTILINE),
    "macro": re.compile(r"^\s*#\s*define\s+(\w+)", re.MULTILINE),
    "type": re.compile(r"^(?:template\s*<[^\n]*>\s*)?(?:struct|class|union)\s+(?:alignas\(\d+\)\s+)?(\w+)\s*[{:]"
                       r"|^typedef\b[^;]*?\b(\w+)\s*;|^using\s+(\w+)\s*=", re.MULTILINE),
}
# Names two files define on purpose, and why.
SAME_NAME_ON_PURPOSE = {
    "kd_shfl_xor": "common.cuh's overload point for kd_block_all_reduce: a kernel file adds one for its own struct",
    "verify_attn_cta": "each verify-attention file's CTA body (mma.sync, wgmma): two kernels, never one module",
}


def _definitions(text: str) -> set[tuple[str, str]]:
    return {(kind, next(g for g in match.groups() if g)) for kind, pattern in DEFINITIONS.items()
            for match in pattern.finditer(text)}


def test_the_definition_scan_finds_functions_types_and_macros():
    text = ("#define KD_X 1\ntypedef unsigned short u16;\nusing Word = unsigned;\nstruct alignas(16) Entry {\n"
            "template <bool kHalf>\n__device__ __forceinline__ u32 kd_pack2(float lo, float hi) {\n"
            "__host__ __device__ constexpr int kd_ceil_div(int a, int b) { return 0; }\n"
            "  using Local = int;\n  __device__ int member() const;\n")
    assert _definitions(text) == {("macro", "KD_X"), ("type", "u16"), ("type", "Word"), ("type", "Entry"),
                                  ("function", "kd_pack2"), ("function", "kd_ceil_div")}


def test_no_helper_is_defined_in_two_kernel_files():
    owners: dict[tuple[str, str], list[str]] = {}
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        for definition in _definitions(path.read_text()):
            owners.setdefault(definition, []).append(path.name)
    twice = {f"{kind} {name}": files for (kind, name), files in owners.items()
             if len(files) > 1 and name not in SAME_NAME_ON_PURPOSE}
    assert not twice, f"defined in more than one kernel file (move it to common.cuh): {twice}"
    assert owners[("function", "kd_block_all_reduce")] == ["common.cuh"]


# ----------------------------------------------------------------------------------------------
# kdtree_lib.kernel_diff: the SASS and ptxas comparison of two trees' kernels

SASS_TEXT = """
Fatbin elf code:
================
arch = sm_90
\tcode for sm_90
\t.target\tsm_90

\t\tFunction : probe
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;          /* 0x00000a00ff017b82 */
                                                                  /* 0x000fe20000000800 */
        /*0010*/               @P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;  /* 0x0000000000000b1d */
                                                                  /* 0x000fec0000010000 */
        /*0020*/                   EXIT ;                          /* 0x000000000000794d */
                                                                  /* 0x000fea0003800000 */
\t\t..........

\t\tFunction : other
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   EXIT ;                          /* 0x000000000000794d */
                                                                  /* 0x000fea0003800000 */
"""


def test_sass_is_read_per_kernel_without_addresses_or_encodings():
    from kdtree_lib import kernel_diff
    kernels = kernel_diff.parse_sass(SASS_TEXT)
    assert set(kernels) == {"probe", "other"}
    assert kernels["probe"].instructions == ("LDC R1, c[0x0][0x28] ;", "@P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;", "EXIT ;")
    assert kernels["probe"].words[:2] == ("0x00000a00ff017b82", "0x000fe20000000800")
    assert len(kernels["probe"].words) == 6 and kernels["other"].instructions == ("EXIT ;",)
    assert kernel_diff.opcode("@P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;") == "BAR.SYNC.DEFER_BLOCKING"


def test_builds_compare_kernel_by_kernel():
    from kdtree_lib import kernel_diff
    sass, resources = kernel_diff.Sass, cuda.KernelResources(32, 0, 0, 0)
    base = kernel_diff.Build({"a": sass(("X ;", "BAR ;", "Y ;"), ("1",)), "b": sass(("Z ;",), ("2",))},
                             {"a": resources, "b": resources})
    assert kernel_diff.compare_builds(base, base) == {}
    moved = kernel_diff.Build({"a": sass(("BAR ;", "X ;", "Y ;"), ("1",)), "b": sass(("Z ;",), ("3",))},
                              {"a": resources, "b": cuda.KernelResources(40, 0, 0, 0)})
    found = kernel_diff.compare_builds(base, moved)
    assert "reordered only" in found["a"][0] and "BAR x1" in found["a"][0]
    assert found["b"][0].startswith("control bits") and found["b"][1].startswith("ptxas: ")
    changed = kernel_diff.Build({"a": sass(("X ;", "BAR ;", "W ;"), ("1",))}, {"a": resources})
    found = kernel_diff.compare_builds(base, changed)
    assert "instructions differ" in found["a"][0] and found["b"] == ["only in the base", f"ptxas: {resources} -> None"]


def test_the_base_tree_is_the_commits_kernel_folder(tmp_path):
    from kdtree_lib import kernel_diff
    from kdtree_lib.paths import REPO_ROOT
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    folder = kernel_diff.checkout_kernels("HEAD", tmp_path)
    import subprocess
    tracked = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-tree", "-r", "--name-only", "HEAD", "--", "kernels/"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert sorted(f"kernels/{p.name}" for p in folder.iterdir()) == sorted(tracked)
    with pytest.raises(ValueError, match="base"):
        kernel_diff.checkout_kernels("no-such-commit-anywhere", tmp_path / "x")


def test_an_edit_that_changes_a_kernel_is_found_and_one_that_does_not_is_not(tmp_path):
    from kdtree_lib import kernel_diff
    try:
        kernel_diff.cuobjdump()
    except FileNotFoundError:
        pytest.skip("cuobjdump not installed")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    base, same, edited = (tmp_path / name for name in ("base", "same", "edited"))
    for folder in (base, same, edited):
        shutil.copytree(KERNEL_DIR, folder)
    with open(same / "probes.cu", "a") as f:
        f.write("// a comment changes no instruction\n")
    source = (edited / "probes.cu").read_text()
    assert "x ^ 0x00040004u" in source
    (edited / "probes.cu").write_text(source.replace("x ^ 0x00040004u", "x ^ 0x00040005u"))
    [sm90, sm120] = kernel_diff.compare_dirs(base, same, ["probes.cu"], jobs=1, progress=False)
    assert (sm90.arch, sm120.arch) == ("sm_90", "sm_120") and sm90.identical and sm120.identical and sm90.kernels == 3
    for result in kernel_diff.compare_dirs(base, edited, ["probes.cu"], jobs=1, progress=False):
        assert list(result.differences) == ["mma_sync_ceiling"], result.differences


def test_a_failing_cuobjdump_is_one_line_refusal(tmp_path, monkeypatch):
    """cuobjdump -sass exits non-zero without nvdisasm beside it: the command says so in one line (a
    RuntimeError's traceback had come out of `kernel_diff --base`)."""
    from kdtree_lib import cli, kernel_diff
    fake = tmp_path / "cuobjdump"
    fake.write_text("#!/bin/sh\necho \"cuobjdump fatal   : Could not find executable file 'nvdisasm'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(kernel_diff, "cuobjdump", lambda: str(fake))
    with pytest.raises(cli.Refused, match="nvdisasm"):
        kernel_diff.sass(tmp_path / "x.cubin")
