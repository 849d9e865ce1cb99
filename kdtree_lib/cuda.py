"""CuPy plumbing shared by the three kernels: compile, view torch tensors, share torch's stream.

- Kernels live in `kernels/*.cu` (device code only) with a shared header `kernels/common.cuh`.
  CuPy's compile cache keys on the source text alone and ignores `#include`d headers, so a hash of
  every header is folded into the source before compiling.
- torch tensors are viewed zero-copy (bf16 as int16, which CuPy can hold; the kernel reads it as
  `__nv_bfloat16`), and kernels run on torch's current stream so no extra synchronisation is
  needed between torch ops and ours.
- `nvcc_compile` builds a kernel file for a given architecture without a GPU (CI checks sm_90 and
  sm_120 this way, and reads registers and spills from ptxas).
"""
from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
from pathlib import Path

from .checks import dtype_name, framework

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
ARCHITECTURES = ("sm_90", "sm_120")
NVRTC_OPTIONS = ("-std=c++17",)


def kernel_source(file_name: str) -> str:
    """The .cu source with a hash of all headers prepended (invalidates CuPy's cache on header edits)."""
    headers = sorted(KERNEL_DIR.glob("*.cuh"))
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:16]
    return f"// headers {digest}\n" + (KERNEL_DIR / file_name).read_text()


@functools.lru_cache(maxsize=None)
def load_module(file_name: str, options: tuple[str, ...] = ()):
    """Compile (or fetch from CuPy's cache) one kernel file as a RawModule with NVRTC."""
    import cupy
    return cupy.RawModule(code=kernel_source(file_name),
                          options=NVRTC_OPTIONS + (f"-I{KERNEL_DIR}",) + tuple(options))


def get_function(file_name: str, name: str, options: tuple[str, ...] = ()):
    return load_module(file_name, tuple(options)).get_function(name)


def as_cupy(x):
    """A zero-copy CuPy view of a CuPy array or torch CUDA tensor (bf16 viewed as int16)."""
    import cupy
    if framework(x) == "cupy":
        return x
    if dtype_name(x) == "bfloat16":
        import torch
        x = x.view(torch.int16)
    return cupy.asarray(x)


def current_stream():
    """torch's current CUDA stream as a CuPy stream (CuPy's own when torch is not in use)."""
    import sys
    import cupy
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return cupy.cuda.get_current_stream()


def empty_like_framework(reference, shape, dtype: str):
    """A new device array in the framework of `reference` (torch in -> torch out, cupy -> cupy)."""
    if framework(reference) == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=reference.device)
    import cupy
    return cupy.empty(shape, dtype=dtype)


def nvcc_compile(file_name: str, arch: str, out_dir: Path) -> str:
    """Compile kernels/<file_name> to a cubin for `arch` with nvcc; returns ptxas' -v report."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc: not found on PATH")
    cubin = Path(out_dir) / f"{Path(file_name).stem}.{arch}.cubin"
    done = subprocess.run(
        [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-O3", "-Xptxas", "-v", f"-I{KERNEL_DIR}",
         "-o", str(cubin), str(KERNEL_DIR / file_name)],
        capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed for {file_name} on {arch}:\n{done.stderr}")
    return done.stderr
