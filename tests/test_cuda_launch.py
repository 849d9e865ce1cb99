"""cuda.KernelParams and cuda.PreparedLaunch: the parameter packing read back through the kernelParams
pointer as the driver reads it (CPU), a launch's driver call with stand-in driver bindings (CPU), the
per-call pointers of the SGLang-layout launches (CPU), and on the GPU the packed bits as a kernel sees
them, torch's current stream, CUDA graph capture and the converted kernels against the old CuPy call.
"""
from __future__ import annotations

import contextlib
import ctypes
import struct
import sys
import types

import numpy as np
import pytest
import torch

from kdtree_lib import cuda

ALL_TYPES = (np.int32(-3), np.uint32(4_000_000_000), np.int64(-2**40 - 7), np.uint64(2**63 + 5), np.float32(1.5),
             np.float64(-2.25))
CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
          np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
          np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def read_params(address: int, kinds) -> list:
    """What cuLaunchKernel reads: kernelParams[i] is a pointer to parameter i's value of its type."""
    table = ctypes.cast(address, ctypes.POINTER(ctypes.c_void_p))
    return [ctypes.cast(table[i], ctypes.POINTER(CTYPES[np.dtype(kind)]))[0] for i, kind in enumerate(kinds)]


# ----------------------------------------------------------------------------------------------
# CPU: packing

def test_each_parameter_sits_in_its_own_slot_as_its_type():
    params = cuda.KernelParams(ALL_TYPES, name="k")
    assert len(params) == 6 and params.types == [np.dtype(type(v)) for v in ALL_TYPES]
    raw = params.slots.tobytes()
    for index, value in enumerate(ALL_TYPES):  # low end of the slot, little-endian, zeros above
        packed = value.tobytes()
        assert raw[8 * index:8 * index + len(packed)] == packed
        assert raw[8 * index + len(packed):8 * index + 8] == bytes(8 - len(packed))
    assert params.slots[0] == 0xFFFFFFFD and params.slots[4] == struct.unpack("<I", struct.pack("<f", 1.5))[0]
    assert params.slots[5] == struct.unpack("<Q", struct.pack("<d", -2.25))[0]
    assert [int(a) for a in params.addresses] == [params.slots.ctypes.data + 8 * i for i in range(6)]
    assert params.address == params.addresses.ctypes.data
    got = read_params(params.address, params.types)
    assert got == [-3, 4_000_000_000, -2**40 - 7, 2**63 + 5, 1.5, -2.25]


def test_set_rewrites_one_slot_in_place():
    params = cuda.KernelParams((np.uint64(10), np.int32(7), np.float32(0.5)), name="k")
    address, slots = params.address, params.slots.ctypes.data
    params.set(0, np.uint64(0xDEAD_BEEF_0000))
    params.set(1, -9)
    params.set(2, 3.25)
    assert (params.address, params.slots.ctypes.data) == (address, slots)
    assert read_params(params.address, params.types) == [0xDEAD_BEEF_0000, -9, 3.25]
    assert params.value(1) == -9 and params.value(1).dtype == np.int32
    with pytest.raises(OverflowError):
        params.set(1, 2**40)  # an int32 slot keeps its width
    with pytest.raises(OverflowError):
        params.set(0, -1)     # a pointer is never negative


def test_set_addresses_rewrites_consecutive_pointer_slots_in_place():
    params = cuda.KernelParams((np.int32(4), np.uint64(1), np.uint64(2), np.uint64(3)), name="k")
    address = params.address
    params.set_addresses(1, [0xAB00, 0, 2**63 + 8])
    assert params.address == address and read_params(params.address, params.types) == [4, 0xAB00, 0, 2**63 + 8]


@pytest.mark.parametrize("bad", [3, 2.0, True, np.int16(1), np.bool_(True), np.zeros(2, np.int32), None, "x"])
def test_a_value_without_a_packed_type_is_refused_naming_kernel_and_argument(bad):
    with pytest.raises(TypeError, match=r"my_kernel: argument 1: expected a NumPy scalar of int32/.*got"):
        cuda.KernelParams((np.int32(1), bad), name="my_kernel")


def test_no_parameters_pass_a_null_table():
    params = cuda.KernelParams((), name="k")
    assert len(params) == 0 and params.address == 0


# ----------------------------------------------------------------------------------------------
# CPU: the launch, with stand-in driver bindings

@pytest.fixture
def driver(monkeypatch):
    """Stand-ins for CuPy: _bind, the current context (mutable), cuLaunchKernel (records what it
    reads), the current stream, and cupy.cuda.Device (switches the context)."""
    state = types.SimpleNamespace(context=7, launches=[], fail=None, binds=[])

    def bind(function, device, shared_mem, name):
        state.binds.append((function, device, shared_mem))
        return function, 0xF00 + device, 7 + device

    def launch_kernel(ptr, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra):
        if state.fail:
            raise RuntimeError(state.fail)
        kinds = state.kinds
        state.launches.append(((ptr, gx, gy, gz, bx, by, bz, shared_mem, stream, extra), state.context,
                               read_params(params, kinds) if kinds else params))

    @contextlib.contextmanager
    def device(index):
        saved, state.context = state.context, 7 + index if state.switchable else -1
        try:
            yield
        finally:
            state.context = saved

    state.kinds, state.switchable = None, True
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(Device=device)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cuda, "_bind", bind)
    monkeypatch.setattr(cuda, "_current_context", lambda: state.context)
    monkeypatch.setattr(cuda, "_launch_kernel", launch_kernel)
    monkeypatch.setattr(cuda, "stream_pointer", lambda device: 0x5000 + device)
    return state


def test_a_call_is_one_driver_launch_with_the_packed_parameters(driver):
    driver.kinds = (np.uint64, np.int32)
    launch = cuda.PreparedLaunch("fn", (3, 2), (128,), (np.uint64(0xAB00), np.int32(5)), device=0, shared_mem=96,
                                 name="kern")
    assert (launch.grid, launch.block) == ((3, 2, 1), (128, 1, 1)) and driver.binds == [("fn", 0, 96)]
    launch()
    launch.set(0, np.uint64(0xCD00))
    launch()
    assert driver.launches == [((0xF00, 3, 2, 1, 128, 1, 1, 96, 0x5000, 0), 7, [0xAB00, 5]),
                               ((0xF00, 3, 2, 1, 128, 1, 1, 96, 0x5000, 0), 7, [0xCD00, 5])]


def test_an_empty_grid_enqueues_nothing(driver):
    cuda.PreparedLaunch("fn", (0,), (32,), (), device=0)()
    cuda.PreparedLaunch("fn", (4, 0, 1), (32,), (), device=0)()
    assert driver.launches == []


def test_a_call_from_another_device_launches_on_its_own(driver):
    launch = cuda.PreparedLaunch("fn", (1,), (32,), (), device=1, name="fn")  # its context: 8
    launch()  # the current context is device 0's (7)
    assert [(call[0], context) for call, context, _ in driver.launches] == [(0xF01, 8)]
    assert driver.context == 7  # the caller's device again
    driver.switchable = False   # the device's context is not the one it was prepared in
    with pytest.raises(cuda.LaunchError, match="fn: prepared in another CUDA context than cuda:1"):
        launch()


def test_a_refused_launch_names_the_kernel_and_its_configuration(driver):
    launch = cuda.PreparedLaunch("fn", (70_000, 70_000), (2048,), (), device=0, name="big")
    driver.fail = "CUDA_ERROR_INVALID_VALUE: invalid argument"
    with pytest.raises(cuda.LaunchError, match=r"big: launch failed on cuda:0 \(grid \(70000, 70000, 1\), "
                                               r"block \(2048, 1, 1\).*CUDA_ERROR_INVALID_VALUE"):
        launch()


@pytest.mark.parametrize("grid, block, shared_mem, match", [
    ((1, 1, 1, 1), (32,), 0, "grid: expected 1 to 3 integers"), ((), (32,), 0, "grid: expected 1 to 3"),
    ((-1,), (32,), 0, "grid: expected non-negative"), ((1,), (0,), 0, "block: expected positive"),
    ((1.0,), (32,), 0, "grid: expected 1 to 3 integers"), ((1,), (32,), -4, "shared_mem: expected a non-negative")])
def test_a_bad_configuration_is_refused_when_prepared(driver, grid, block, shared_mem, match):
    with pytest.raises(ValueError, match="k: " + match):
        cuda.PreparedLaunch("fn", grid, block, (), device=0, shared_mem=shared_mem, name="k")


def test_the_stream_is_torchs_raw_current_stream_once_torch_uses_cuda(monkeypatch):
    monkeypatch.setattr(cuda, "_raw_stream", None)
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0x77))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cuda.stream_pointer(0) == 0x77  # torch has not touched CUDA: CuPy's current stream
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x1000 + device, raising=False)
    assert cuda.stream_pointer(3) == 0x1003
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cuda.stream_pointer(2) == 0x1002  # found once, kept: torch stays initialised


# ----------------------------------------------------------------------------------------------
# CPU: the SGLang-layout launches set their per-call pointers

def test_sglang_build_and_eagle_format_point_each_call_at_its_own_buffers(driver, monkeypatch):
    from kdtree_lib import tree_build
    monkeypatch.setattr(cuda, "device_function", lambda file_name, kernel_name, device: kernel_name)
    build = tree_build.SGLangBuildLaunch(2, 3, 4, 8, 0, policy="sglang", ids_int64=True, links=False)
    kinds = [t.type for t in build._launch.params.types]
    assert len(kinds) == 2 + 12 + len(tree_build.SGLANG_OUTPUTS)
    driver.kinds = kinds
    for _ in range(2):  # fresh buffers each call
        logp, ids = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int64)
        out = build.allocate(logp)
        build(logp, ids, out)
        values = driver.launches[-1][2]
        assert values[:2] == [logp.data_ptr(), ids.data_ptr()]
        assert values[14:] == [out[name].data_ptr() if name in out else 0 for name in tree_build.SGLANG_OUTPUTS]
        assert values[14 + tree_build.SGLANG_OUTPUTS.index("next_token")] == 0  # links=False: not written
    assert driver.launches[-1][0][1:4] == (2, 1, 1)
    out = build.allocate(logp)
    addresses = [out[name].data_ptr() if name in out else 0 for name in tree_build.SGLANG_OUTPUTS]
    build.launch_at(0xAB00, 0xCD00, addresses)  # the draft moved
    build.launch_at(0xAB00, 0xCD00, addresses[::-1])  # the same draft, other outputs
    assert [values[:2] for _, _, values in driver.launches[-2:]] == [[0xAB00, 0xCD00]] * 2
    assert driver.launches[-1][2][14:] == addresses[::-1]
    eagle = tree_build.EagleFormatLaunch(2, 9, 9, 0)
    driver.kinds = [t.type for t in eagle._launch.params.types]
    parents, sizes = torch.zeros(2, 9, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    index, next_token, next_sibling = eagle(parents, sizes)
    assert driver.launches[-1][2] == [parents.data_ptr(), 9, sizes.data_ptr(), 9, index.data_ptr(),
                                      next_token.data_ptr(), next_sibling.data_ptr()]


# ----------------------------------------------------------------------------------------------
# GPU

@pytest.mark.gpu
def test_the_kernel_reads_the_packed_bits():
    device = torch.cuda.current_device()
    out = torch.full((7,), -1, dtype=torch.int64, device="cuda")  # poisoned
    probe = torch.empty(1, device="cuda")
    args = ALL_TYPES + (cuda.pointer(probe), cuda.pointer(out))
    launch = cuda.PreparedLaunch(cuda.device_function("probes.cu", "launch_params", device), (1,), (32,), args,
                                 device=device)
    launch()
    want = [int(s) for s in launch.params.slots[:7]]
    assert [v & (2**64 - 1) for v in out.cpu().tolist()] == want
    launch.set(0, 41)
    launch()
    assert int(out[0]) == 41


@pytest.mark.gpu
def test_prepared_launches_follow_torchs_stream_and_graph_capture():
    device = torch.cuda.current_device()
    out = torch.full((7,), -1, dtype=torch.int64, device="cuda")
    args = ALL_TYPES + (np.uint64(0), cuda.pointer(out))
    launch = cuda.PreparedLaunch(cuda.device_function("probes.cu", "launch_params", device), (1,), (32,), args,
                                 device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.fill_(-1)
        launch()  # ordered after the fill on the side stream, with no synchronisation in between
        copy = out.clone()
    torch.cuda.current_stream().wait_stream(side)
    assert int(copy[0]) == 2**32 - 3
    graph = torch.cuda.CUDAGraph()
    launch.set(0, 11)
    with torch.cuda.graph(graph):
        launch()
    launch.set(0, 12)  # the captured launch keeps the value it was captured with
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert int(out[0]) == 11


@pytest.mark.gpu
def test_a_refused_launch_on_the_gpu_names_the_kernel():
    device = torch.cuda.current_device()
    launch = cuda.PreparedLaunch(cuda.device_function("probes.cu", "launch_floor", device), (1,), (4096,), (),
                                 device=device)
    with pytest.raises(cuda.LaunchError, match="launch_floor: launch failed on cuda"):
        launch()
