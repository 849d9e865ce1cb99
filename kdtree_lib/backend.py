"""Which implementation runs: the NumPy/torch references or the CuPy kernels.

Every entry point takes the four names of BACKENDS:
- "numpy": the reference; "torch": torch's implementation where the entry point has one, else its
  reference (the references take torch tensors too), so "torch" always means "no kernel";
- "cupy": the kernels. Asking for them where they cannot run is an error, never a silent fallback,
  so a benchmark always measures what it says;
- "auto": what runs for the inputs at hand: the kernels when the inputs live on a GPU CuPy can
  launch on and are of a dtype the kernels take, the first supported path otherwise.
"""
from __future__ import annotations

import functools
import platform

from .checks import dtype_name, is_on_gpu

BACKENDS = ("auto", "numpy", "torch", "cupy")


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when CuPy is installed and sees a CUDA device (the clean no-GPU test)."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # a broken driver install counts as no GPU
        return False


def resolve(backend: str, supported: tuple[str, ...], *arrays, kernel_dtypes: tuple[str, ...] | None = None) -> str:
    """Turn the user's `backend` into one of `supported`, given where the inputs live and, when the
    kernels take only some dtypes (`kernel_dtypes`), the dtype of the first input."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    on_gpu = any(is_on_gpu(x) for x in arrays)
    if backend == "auto":
        kernel_takes = kernel_dtypes is None or (arrays and dtype_name(arrays[0]) in kernel_dtypes)
        if on_gpu and kernel_takes and "cupy" in supported and cuda_available():
            return "cupy"
        return supported[0]
    if backend == "torch" and "torch" not in supported and "numpy" in supported:
        return "numpy"
    if backend not in supported:
        raise ValueError(f"backend: {backend!r} is not available here; choose from {supported}")
    if backend == "cupy":
        if not cuda_available():
            raise ValueError("backend: 'cupy' needs CuPy and a CUDA device, and none was found")
        if not on_gpu:
            raise ValueError("backend: 'cupy' needs its inputs on the GPU (cupy arrays or torch CUDA tensors)")
    return backend


def environment_report() -> dict:
    """What is present, for notebook 00 and for the `device` column of results rows."""
    report = {"python": platform.python_version(), "machine": platform.machine()}
    for name in ("numpy", "torch", "cupy", "transformers", "papermill", "matplotlib"):
        try:
            module = __import__(name)
            report[name] = getattr(module, "__version__", "?")
        except ImportError:
            report[name] = None
    report["cuda"] = cuda_available()
    report["device"] = device_name()
    report["backends"] = ["numpy", "torch"] + (["cupy"] if report["cuda"] else [])
    return report


def device_name() -> str:
    """The GPU's name when CuPy sees one, else the CPU's."""
    if cuda_available():
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return platform.processor() or platform.machine()
