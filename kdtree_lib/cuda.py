"""CuPy plumbing shared by the kernels: compile, view torch tensors, share torch's stream.

- Kernels live in `kernels/*.cu` (device code only) with a shared header `kernels/common.cuh`.
  CuPy's compile cache keys on the source text alone and ignores `#include`d headers, so a hash of
  every header is folded into the source before compiling.
- torch tensors are viewed zero-copy (bf16 as int16, which CuPy can hold; the kernel reads it as
  `__nv_bfloat16`), and kernels run on torch's current stream so no extra synchronisation is
  needed between torch ops and ours.
- Every launch is a `PreparedLaunch`: parameters packed once (`KernelParams`), then per call only
  torch's current raw stream is read and cuLaunchKernel called (CuPy's per-call argument conversion
  and Stream wrapping cost several times the launch itself on a slow host).
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
import sys
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
    """torch's current CUDA stream as a CuPy stream (CuPy's own when torch is not in use), for CuPy's
    own array operations (`with current_stream():`); launches read `stream_pointer` instead."""
    import sys
    import cupy
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return cupy.cuda.Stream.from_external(torch.cuda.current_stream())  # the CUDA stream protocol
    return cupy.cuda.get_current_stream()


def nvcc_compile(file_name: str, arch: str, out_dir: Path, *, kernel_dir: Path | None = None) -> str:
    """Compile kernels/<file_name> (or kernel_dir/<file_name>: another tree's kernels) to the cubin
    out_dir/<stem>.<arch>.cubin for `arch` with nvcc; returns ptxas' -v report."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc: not found on PATH")
    kernel_dir = Path(kernel_dir) if kernel_dir is not None else KERNEL_DIR
    cubin = Path(out_dir) / f"{Path(file_name).stem}.{arch}.cubin"
    done = subprocess.run(
        [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-O3", "-Xptxas", "-v", f"-I{kernel_dir}",
         "-o", str(cubin), str(kernel_dir / file_name)],
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


def ptxas_report(kernel_file: str, arch: str, out_dir: Path | None = None, *,
                 kernel_dir: Path | None = None) -> PtxasReport:
    """Registers, spills and static shared memory of every kernel in kernels/<kernel_file> (or
    kernel_dir/<kernel_file>) built for `arch` by nvcc (no GPU needed); the cubin goes to out_dir, or
    to a temporary folder."""
    if out_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return ptxas_report(kernel_file, arch, Path(tmp), kernel_dir=kernel_dir)
    log = nvcc_compile(kernel_file, arch, out_dir, kernel_dir=kernel_dir)
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
    """Launch kernels/<file_name>:<kernel_name> once on the device of `like`, on torch's current stream
    (args: NumPy scalars, device pointers as np.uint64; see KernelParams)."""
    device = device_index(like)
    PreparedLaunch(device_function(file_name, kernel_name, device), grid, block, args, device=device,
                   shared_mem=shared_mem)()


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


# ----------------------------------------------------------------------------------------------
# Prepared launches: the kernel's parameters packed once, then one driver call per launch.
#
# CuPy's Function.__call__ converts every argument to a C value and, with a torch stream, wraps it
# in a new CuPy Stream on each call: microseconds per launch, paid by every launch of an eager decode
# step. A PreparedLaunch does that work once; a call reads torch's current raw stream and calls
# cuLaunchKernel (CuPy's Cython binding) with the packed parameters.

SLOT_BYTES = 8  # every parameter gets an 8-byte slot: the widest type a kernel here takes
PARAM_TYPES = (np.int32, np.uint32, np.int64, np.uint64, np.float32, np.float64)
STATIC_SHARED_BYTES = 48 * 1024  # dynamic shared memory above this needs the function's opt-in
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (CUDA's ABI value)


class LaunchError(RuntimeError):
    """A kernel launch the driver refused (the message names the kernel and its configuration)."""


class KernelParams:
    """A kernel's parameters as cuLaunchKernel reads them: each value in its own 8-byte slot of one
    host buffer (its bytes in the slot's low end, host byte order: little-endian on every CUDA host),
    and the array of the slots' addresses, whose own address (`address`) is the kernelParams pointer.

    Packed once from NumPy scalars of PARAM_TYPES (a device pointer is an np.uint64, see `pointer`); a
    Python int or float is refused, since its width would be a guess. `set(i, value)` rewrites slot i
    in place as its own type (a buffer handed per call), so the addresses never move. The driver
    copies the values when the launch is enqueued (or captured), so a slot may change right after.
    """

    __slots__ = ("name", "slots", "addresses", "address", "types", "_views")

    def __init__(self, args, *, name: str = "kernel"):
        if sys.byteorder != "little":
            raise RuntimeError("KernelParams: a little-endian host is expected (every CUDA host is)")
        self.name = name
        count = len(args)
        self.slots = np.zeros(max(count, 1), dtype=np.uint64)
        self.types, self._views = [], []
        for index, value in enumerate(args):
            kind = type(value)
            if kind not in PARAM_TYPES:
                raise TypeError(f"{name}: argument {index}: expected a NumPy scalar of "
                                f"{'/'.join(t.__name__ for t in PARAM_TYPES)} (a device pointer as np.uint64), "
                                f"got {kind.__name__}")
            view = self.slots[index:index + 1].view(kind)  # [0]: the slot's first bytes
            view[0] = value
            self.types.append(np.dtype(kind))
            self._views.append(view)
        self.addresses = np.uint64(self.slots.ctypes.data) + np.arange(count, dtype=np.uint64) * np.uint64(SLOT_BYTES)
        self.address = int(self.addresses.ctypes.data) if count else 0

    def __len__(self) -> int:
        return len(self.types)

    def set(self, index: int, value) -> None:
        """Rewrite parameter `index` (converted to its packed type; NumPy refuses a value out of range)."""
        self._views[index][0] = value

    def value(self, index: int):
        """Parameter `index` as packed (a NumPy scalar of its type)."""
        return self._views[index][0]

    def set_addresses(self, first: int, addresses) -> None:
        """Rewrite parameters first, first + 1, ... with `addresses` (device addresses as Python ints, e.g.
        data_ptr(); 0 for none) in one NumPy assignment. For pointer parameters (np.uint64) only, which
        this does not check: it is a per-call path, and the owner knows its kernel's layout."""
        self.slots[first:first + len(addresses)] = addresses


class PreparedLaunch:
    """One kernel launch prepared once: function, grid, block, dynamic shared memory and packed
    parameters (KernelParams) for one device. Calling it enqueues the kernel on torch's current stream
    of that device (CuPy's current stream when torch has not initialised CUDA), and does nothing else:
    no argument check, no allocation, no synchronisation, so it may run inside a CUDA graph capture.

    `function`: a CuPy RawKernel (from `get_function`/`device_function`; its Function for `device` is
    resolved here) or a cupy.cuda.Function. `set(i, value)` rewrites parameter i for the next calls
    (a buffer handed per call). The owner keeps the buffers the parameters point into alive; this
    keeps only the function (its module stays loaded). A grid with a zero dimension is an empty
    launch: calling it enqueues nothing. Dynamic shared memory above 48 KB is opted in here, on the
    function for this device. Called while another device is current, it launches on its own device
    (and restores the caller's). A launch the driver refuses raises LaunchError naming the kernel.
    Not for several threads at once: `set` and the call share the parameter buffer.
    """

    __slots__ = ("name", "device", "grid", "block", "shared_mem", "params", "_function", "_ptr", "_context",
                 "_empty")

    def __init__(self, function, grid: tuple, block: tuple, args, *, device: int, shared_mem: int = 0,
                 name: str | None = None):
        self.name = name or str(getattr(function, "name", None) or getattr(function, "__name__", "kernel"))
        self.grid = _launch_dims(self.name, "grid", grid, allow_zero=True)
        self.block = _launch_dims(self.name, "block", block, allow_zero=False)
        if not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
            raise ValueError(f"{self.name}: shared_mem: expected a non-negative integer, got {shared_mem!r}")
        self.device, self.shared_mem = int(device), int(shared_mem)
        self.params = KernelParams(args, name=self.name)
        self._empty = 0 in self.grid
        self._function, self._ptr, self._context = _bind(function, self.device, self.shared_mem, self.name)

    def set(self, index: int, value) -> None:
        self.params.set(index, value)

    def set_addresses(self, first: int, addresses) -> None:
        """KernelParams.set_addresses: consecutive pointer parameters from Python ints, unchecked."""
        self.params.set_addresses(first, addresses)

    def __call__(self) -> None:
        if self._empty:
            return
        if _current_context() != self._context:
            return self._launch_switching_device()
        self._launch(stream_pointer(self.device))

    def _launch(self, stream: int) -> None:
        grid, block = self.grid, self.block
        try:
            _launch_kernel(self._ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2], self.shared_mem,
                           stream, self.params.address, 0)
        except Exception as error:  # CuPy's CUDADriverError: say which launch it was
            raise LaunchError(f"{self.name}: launch failed on cuda:{self.device} (grid {grid}, block {block}, "
                              f"{self.shared_mem} bytes of dynamic shared memory): {error}") from error

    def _launch_switching_device(self) -> None:
        import cupy
        with cupy.cuda.Device(self.device):
            if _current_context() != self._context:
                raise LaunchError(f"{self.name}: prepared in another CUDA context than cuda:{self.device}'s "
                                  "current one (was the device reset?)")
            self._launch(stream_pointer(self.device))


def _launch_dims(name: str, what: str, dims, *, allow_zero: bool) -> tuple[int, int, int]:
    """A grid or block as three ints (missing trailing dimensions are 1)."""
    dims = tuple(dims)
    if not 1 <= len(dims) <= 3 or not all(isinstance(n, (int, np.integer)) for n in dims):
        raise ValueError(f"{name}: {what}: expected 1 to 3 integers, got {dims!r}")
    dims = tuple(int(n) for n in dims) + (1,) * (3 - len(dims))
    if any(n < (0 if allow_zero else 1) for n in dims):
        raise ValueError(f"{name}: {what}: expected {'non-negative' if allow_zero else 'positive'} sizes, got {dims}")
    return dims


def _bind(function, device: int, shared_mem: int, name: str):
    """(Function, its CUfunction address, the device's CUDA context) for `device`: a RawKernel loads
    its module there on first use; dynamic shared memory above 48 KB is opted in."""
    global _current_context, _launch_kernel
    import cupy
    from cupy.cuda import driver
    _current_context, _launch_kernel = driver.ctxGetCurrent, driver.launchKernel
    with cupy.cuda.Device(device):
        kernel = getattr(function, "kernel", function)  # RawKernel -> this device's cupy.cuda.Function
        ptr = int(kernel.ptr)
        if shared_mem > STATIC_SHARED_BYTES and driver.funcGetAttribute(_MAX_DYNAMIC_SHARED, ptr) < shared_mem:
            try:
                driver.funcSetAttribute(ptr, _MAX_DYNAMIC_SHARED, shared_mem)
            except Exception as error:
                raise LaunchError(f"{name}: cannot opt in to {shared_mem} bytes of dynamic shared memory on "
                                  f"cuda:{device}: {error}") from error
        return kernel, ptr, driver.ctxGetCurrent()


# CuPy's driver bindings, looked up once (by the first _bind) rather than per call
_current_context = None  # cuCtxGetCurrent
_launch_kernel = None    # cuLaunchKernel
_raw_stream = None  # torch's current-stream getter, set once torch has initialised CUDA


def stream_pointer(device: int) -> int:
    """The address of the current stream of `device`: torch's (read without building a Stream
    object) once torch has initialised CUDA, else CuPy's current stream."""
    getter = _raw_stream or _find_torch_stream_getter()
    if getter is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    return getter(device)


def _find_torch_stream_getter():
    global _raw_stream
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    _raw_stream = raw if raw is not None else (lambda device: torch.cuda.current_stream(device).cuda_stream)
    return _raw_stream
