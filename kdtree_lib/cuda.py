"""CuPy plumbing shared by the kernels: compile, view torch tensors, share torch's stream.

- Kernels live in `kernels/*.cu` (device code only) with a shared header `kernels/common.cuh`.
  CuPy's compile cache keys on the source text alone and ignores `#include`d headers, so a hash of
  every header is folded into the source before compiling.
- torch tensors are viewed zero-copy (bf16 as int16, which CuPy can hold; the kernel reads it as
  `__nv_bfloat16`), and kernels run on torch's current stream so no extra synchronisation is
  needed between torch ops and ours.
- `nvcc_compile` builds a kernel file for a given architecture without a GPU (CI checks sm_90 and
  sm_120 this way, sm_90a for the wgmma kernel); `ptxas_report` reads each kernel's registers,
  spills and static shared memory from that build.
- An architecture-specific build (sm_90a) goes through NVRTC directly: CuPy always targets the
  device's plain architecture.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checks import dtype_name, framework
from .paths import KERNEL_DIR

ARCHITECTURES = ("sm_90", "sm_120")
NVRTC_OPTIONS = ("-std=c++17",)


def kernel_source(file_name: str) -> str:
    """The .cu source with a hash of all headers prepended (invalidates CuPy's cache on header edits)."""
    headers = sorted(KERNEL_DIR.glob("*.cuh"))
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:16]
    return f"// headers {digest}\n" + (KERNEL_DIR / file_name).read_text()


@functools.lru_cache(maxsize=None)
def load_module(file_name: str, options: tuple[str, ...] = (), arch: str | None = None):
    """Compile (or fetch from a cache) one kernel file as a RawModule with NVRTC: for the current
    device's architecture (CuPy's own build and cache), or for `arch` (e.g. "sm_90a")."""
    import cupy
    options = NVRTC_OPTIONS + (f"-I{KERNEL_DIR}",) + tuple(options)
    if arch is None:
        return cupy.RawModule(code=kernel_source(file_name), options=options)
    return cupy.RawModule(path=str(_nvrtc_cubin(file_name, options, arch)))


def get_function(file_name: str, name: str, options: tuple[str, ...] = (), arch: str | None = None):
    return load_module(file_name, tuple(options), arch).get_function(name)


def _nvrtc_cubin(file_name: str, options: tuple[str, ...], arch: str) -> Path:
    """A cubin of kernels/<file_name> for `arch`, cached on disk by source, options and NVRTC version.

    CuPy's RawModule always adds the device's own `-arch=sm_XY`, which cannot name an
    architecture-specific target such as sm_90a (wgmma), so these builds call NVRTC directly.
    """
    from cupy.cuda import nvrtc
    source = kernel_source(file_name)
    options = options + (f"--gpu-architecture={arch}", "-ftz=true", "--device-as-default-execution-space")  # as CuPy
    key = hashlib.sha256(repr((source, options, nvrtc.getVersion())).encode()).hexdigest()[:32]
    cache_dir = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    cubin = cache_dir / f"kdtree-{Path(file_name).stem}-{arch}-{key}.cubin"
    if cubin.exists():
        return cubin
    program = nvrtc.createProgram(source, file_name, (), ())
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed for {file_name} on {arch}:\n{nvrtc.getProgramLog(program)}") from error
        binary = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cubin.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(binary)
    partial.replace(cubin)  # atomic: concurrent processes never load half a file
    return cubin


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
        return cupy.cuda.Stream.from_external(torch.cuda.current_stream())  # the CUDA stream protocol
    return cupy.cuda.get_current_stream()


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


@dataclass(frozen=True)
class KernelResources:
    """One kernel's resources as ptxas reports them."""
    registers: int     # 32-bit registers a thread
    spill_stores: int  # bytes
    spill_loads: int   # bytes
    shared_bytes: int  # static shared memory (dynamic shared memory is the launcher's to ask for)

    @property
    def spilled_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class PtxasReport:
    """Every kernel of one nvcc build, by name, and ptxas' whole -v log (its warnings included)."""
    kernels: dict[str, KernelResources]
    log: str


def ptxas_report(kernel_file: str, arch: str, out_dir: Path | None = None) -> PtxasReport:
    """Registers, spills and static shared memory of every kernel in kernels/<kernel_file> built for
    `arch` by nvcc (no GPU needed); the cubin goes to out_dir, or to a temporary folder."""
    if out_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return ptxas_report(kernel_file, arch, Path(tmp))
    log = nvcc_compile(kernel_file, arch, out_dir)
    entries = re.split(r"Compiling entry function '(\w+)'", log)[1:]
    kernels = {}
    for name, text in zip(entries[::2], entries[1::2]):
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        shared = re.search(r"(\d+) bytes smem", text)
        kernels[name] = KernelResources(registers=int(re.search(r"Used (\d+) registers", text)[1]),
                                        spill_stores=int(spills[1]), spill_loads=int(spills[2]),
                                        shared_bytes=int(shared[1]) if shared else 0)
    return PtxasReport(kernels, log)


# ----------------------------------------------------------------------------------------------
# launch plumbing shared by the kernels (raw device pointers: no CuPy array per argument)

def launch(file_name: str, kernel_name: str, grid: tuple, block: tuple, args: tuple, *, like,
           shared_mem: int = 0) -> None:
    """Launch kernels/<file_name>:<kernel_name> on the device of `like`, on torch's current stream."""
    import cupy
    device = device_index(like)
    with cupy.cuda.Device(device), current_stream():
        device_function(file_name, kernel_name, device)(grid, block, args, shared_mem=shared_mem)


@functools.lru_cache(maxsize=None)
def device_function(file_name: str, kernel_name: str, device: int):
    """The kernel function, keyed by device so per-device attributes (the shared-memory opt-in) are set once each."""
    return get_function(file_name, kernel_name)


def pointer(x) -> np.uint64:
    """The address of x's first element (a kernel pointer argument)."""
    kind = framework(x)
    if kind == "torch":
        return np.uint64(x.data_ptr())
    if kind == "cupy":
        return np.uint64(x.data.ptr)
    return np.uint64(x.ctypes.data)


def buffer_signature(*arrays) -> tuple:
    """(address, shape, dtype) of each array: what a prepared launch compares to refuse a buffer it was
    not prepared with (its kernel arguments hold the addresses)."""
    return tuple((int(pointer(x)), tuple(x.shape), str(x.dtype)) for x in arrays)


def device_index(x) -> int:
    return int(x.device.index) if framework(x) == "torch" else int(x.device.id)


def is_contiguous(x) -> bool:
    return x.is_contiguous() if framework(x) == "torch" else bool(x.flags.c_contiguous)


def contiguous(x, dtype: str | None = None):
    """x itself when already C-contiguous (and of `dtype`), else a device copy on the launch stream."""
    if is_contiguous(x) and (dtype is None or dtype_name(x) == dtype):
        return x
    if framework(x) == "torch":
        import torch
        return (x.to(getattr(torch, dtype)) if dtype else x).contiguous()
    import cupy
    with cupy.cuda.Device(device_index(x)), current_stream():
        return cupy.ascontiguousarray(x, dtype=dtype)


def device_empty(like, shape: tuple, dtype: str):
    """An uninitialised array on the device of `like`, in its framework (torch in -> torch out)."""
    if framework(like) == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    import cupy
    with cupy.cuda.Device(device_index(like)), current_stream():
        return cupy.empty(shape, dtype=dtype)


def to_device_like(like, values: np.ndarray):
    """Host int32 values on the device of `like`, in its framework."""
    values = np.ascontiguousarray(values, dtype=np.int32)
    if framework(like) == "torch":
        import torch
        return torch.as_tensor(values, device=like.device)
    import cupy
    with cupy.cuda.Device(device_index(like)), current_stream():
        return cupy.asarray(values)
