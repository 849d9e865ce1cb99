"""The kernel sources as the compilers see them (CPU only, no nvcc needed).

CuPy's compile cache keys on the source text alone, so kdtree_lib.cuda.kernel_source folds a hash of
the headers into it: every header a kernel file includes, directly or through another header, must
be one that hash covers, or an edit to it would leave a stale cubin in the cache. NVRTC (run time)
and nvcc (CI's compile checks) both find the headers by `-I kernels/` alone, so every include names a
file in that folder. And the PTX wrappers several kernel files use live in common.cuh once.
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
