"""kernels/rms_norm.cu (kdtree_lib.rms_norm) against the torch formula, and the model's RMSNorm around it.

CPU: RMSNorm's forward and add_forward are torch's ops bit for bit (add_forward = add, then forward);
the entry points refuse bad input naming the argument before any launch; the row-layout and kernel
choices; the tolerance check below rejects known-wrong variants and accepts a correct one that sums in
another order; nvcc builds the file for sm_90 and sm_120 without spills. GPU (`-m gpu`): fresh random
rows (seed printed), outputs NaN-poisoned, hidden sizes 16 to 65 536 and 1 to thousands of rows, the
fused add, strided rows, a row's output independent of the rows beside it, a CUDA graph, the module.

Why not bit-exact, and the tolerance. Every rounding point is torch's except the fp32 sum of squares,
which the kernel adds in its own order. Any order of n non-negative fp32 terms is within a relative
(n - 1)u of the exact sum (u = 2^-24), so the two sums are within 2(n - 1)u of each other; the mean's
product and the eps add round once each (2u more apiece, both sides); the square root halves a relative
change, and rsqrtf is within 2 ulps (4u) on each side: the kernel's factor r is within
DELTA(n) = (n + 10)u of torch's (10 rounds up the first-order terms). The output is monotone in r for
each element, so it must lie between the formula's outputs at r(1 - DELTA) and r(1 + DELTA): an exact
interval, no magic tolerance. In practice r moves by one or two ulps, and an element changes only when
x·r sits on a bf16 rounding boundary (bf16 x values repeat, so a row's equal values flip together):
with unit weights the output is that rounding, so it is torch's or one bf16 step away, and we allow
at most 1% of the elements to differ (an emulation of the kernel's order against torch's CPU sums
flipped 0 to 1e-4 of them; a mean over n - 1 at n = 512 flips ~15%).
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kdtree_lib import cuda
from kdtree_lib import rms_norm as rn
from kdtree_lib.model.model import RMSNorm

FLIP_FRACTION = 0.01
DIMS_ROWS = [(16, 1), (16, 2049), (72, 33), (128, 1000), (512, 7), (1536, 64), (7168, 1), (7168, 257),
             (8200, 3), (65_536, 2)]
DTYPES = [torch.bfloat16, torch.float16]


# ----------------------------------------------------------------------------------------------
# the check (device-agnostic: the CPU tests below run it on known-wrong outputs)

def delta(dim: int) -> float:
    """The kernel's fp32 factor is within this relative distance of torch's (module docstring)."""
    return (dim + 10) * 2.0**-24


def allowed_interval(x, weight, eps: float):
    """Per element, the lowest and highest outputs of the formula for a factor within DELTA of torch's."""
    xf = x.float()
    factor = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    d = delta(x.shape[-1])
    low = torch.nextafter((factor.double() * (1 - d)).float(), torch.tensor(0.0, device=x.device))
    high = torch.nextafter((factor.double() * (1 + d)).float(), torch.tensor(float("inf"), device=x.device))
    ends = [weight * (xf * f).to(x.dtype) for f in (low, high)]
    return torch.minimum(*ends), torch.maximum(*ends)


def ordered(x) -> torch.Tensor:
    """16-bit floats as integers in value order (+0 and -0 both 0): the difference counts rounding steps."""
    bits = x.view(torch.int16).long()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def check_norm(got, x, weight, eps: float, *, what: str = "") -> None:
    """got is the formula with the factor moved within DELTA; differing from torch's output in at most
    FLIP_FRACTION of the elements, and with unit weights by at most one step each."""
    expected = rn.rms_norm_reference(x, weight, eps)
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    assert not got.isnan().any(), f"{what}: NaN left in the output (a row or value not written)"
    low, high = allowed_interval(x, weight, eps)
    outside = (got < low) | (got > high)
    differ = got != expected
    fraction = differ.float().mean().item() if got.numel() else 0.0
    print(f"{what}: {int(differ.sum())} of {got.numel()} elements differ from torch ({fraction:.2e})")
    assert not outside.any(), (f"{what}: {int(outside.sum())} elements outside the interval, e.g. got "
                               f"{got[outside][:4].tolist()} vs torch {expected[outside][:4].tolist()}")
    assert fraction <= FLIP_FRACTION, f"{what}: {fraction:.3%} of the elements differ from torch"
    if bool((weight == 1).all()):
        steps = (ordered(got) - ordered(expected)).abs().max().item() if got.numel() else 0
        assert steps <= 1, f"{what}: an output {steps} rounding steps from torch's"


def random_rows(rng, shape, dtype, device):
    """Normal values, each row scaled by 10^U(-3, 3): sums of squares over many magnitudes."""
    scale = 10.0 ** rng.uniform(-3, 3, size=shape[:-1] + (1,))
    values = rng.standard_normal(shape) * scale
    return torch.as_tensor(values, dtype=torch.float32).to(device=device, dtype=dtype)


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**63)
    return np.random.default_rng(seed), seed


# ----------------------------------------------------------------------------------------------
# CPU: the module is torch's ops; the checks; the tolerance is not vacuous

def literal_formula(x, weight, eps):
    """The model's RMSNorm as it was written before the kernel (the bit-exact contract on the CPU)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_the_module_on_the_cpu_is_torchs_formula_bit_for_bit(dtype, weight_dtype):
    rng = np.random.default_rng(1)
    norm = RMSNorm(72, 1e-6).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.as_tensor(1 + 0.3 * rng.standard_normal(72)))
    x, residual = (random_rows(rng, (3, 5, 72), dtype, "cpu") for _ in range(2))
    assert torch.equal(norm(x), literal_formula(x, norm.weight, 1e-6))
    normed, summed = norm.add_forward(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(normed, norm(residual + x))
    with torch.no_grad():
        assert torch.equal(norm.add_forward(x, residual)[0], literal_formula(residual + x, norm.weight, 1e-6))


def test_autograd_flows_through_the_module():
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(4, 16, requires_grad=True)
    normed, summed = norm.add_forward(x, torch.randn(4, 16))
    (normed.sum() + summed.sum()).backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_rows_are_found_for_contiguous_sliced_and_expanded_tensors():
    base = torch.zeros(2, 3, 576)
    assert rn.row_stride(base) == 576
    assert rn.row_stride(base[..., :512]) == 576                  # MLA's latent: a slice of the last axis
    assert rn.row_stride(base[:, :1, :512]) == 576 * 3            # one row per request
    assert rn.row_stride(base[0, 0]) == 576                       # one row: its length
    assert rn.row_stride(torch.zeros(1, 64).expand(5, 64)) == 0   # the same row five times
    assert rn.row_stride(base[:, :2, :512]) is None               # rows not evenly spaced
    assert rn.row_stride(base.transpose(1, 2)) is None            # the last axis not contiguous
    assert rn.row_stride(torch.zeros(())) is None


def test_every_row_length_gets_a_kernel_that_covers_it_in_whole_warps():
    for dim in range(8, rn.MAX_DIM + 1, 8):
        name, threads = rn.kernel_choice("bfloat16", dim, fused=False)
        held = int(name.rsplit("_held", 1)[1])
        assert held in rn.HELD and threads % 32 == 0 and 32 <= threads <= rn.MAX_THREADS
        assert held * threads * rn.VALUES >= dim > (held * (threads - 32)) * rn.VALUES or threads == 32
    assert rn.kernel_choice("float16", 7168, fused=True) == ("rms_norm_add_f16_held1", 896)


BAD = [
    (dict(x=np.zeros((2, 16), np.float32)), "x: expected a torch tensor"),
    (dict(x=torch.zeros(2, 16)), r"x: expected one of \('bfloat16', 'float16'\)"),
    (dict(x=torch.zeros((), dtype=torch.bfloat16)), "x: expected at least one axis"),
    (dict(x=torch.zeros(2, 12, dtype=torch.bfloat16)), "x: the last axis must be a positive multiple of 8"),
    (dict(x=torch.zeros(16, 2, dtype=torch.bfloat16).t()), "x: each row"),
    (dict(x=torch.zeros(2, 20, dtype=torch.bfloat16)[:, 4:]), "x: every row must start at a multiple of 16"),
    (dict(weight=torch.ones(8, dtype=torch.bfloat16)), r"weight: expected a tensor of shape \(16,\)"),
    (dict(weight=torch.ones(16)), "weight: expected torch.bfloat16"),
    (dict(weight=torch.ones(32, dtype=torch.bfloat16)[::2]), "weight: expected a contiguous tensor"),
    (dict(eps=-1e-6), "eps: expected a finite number >= 0"),
    (dict(eps=float("nan")), "eps: expected a finite number >= 0"),
    (dict(out=torch.zeros(2, 16)), "out: expected x's shape, dtype and device"),
    (dict(out=torch.zeros(16, 2, dtype=torch.bfloat16).t()), "out: expected a C-contiguous buffer"),
    (dict(), "x: expected a CUDA tensor"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_refused_naming_the_argument(change, message):
    args = dict(x=torch.zeros(2, 16, dtype=torch.bfloat16), weight=torch.ones(16, dtype=torch.bfloat16), eps=1e-6,
                out=None) | change
    with pytest.raises(ValueError, match=message):
        rn.rms_norm(args["x"], args["weight"], args["eps"], out=args["out"])


@pytest.mark.parametrize("name, value, message", [
    ("residual", torch.zeros(2, 8, dtype=torch.bfloat16), "residual: expected x's shape"),
    ("residual", torch.zeros(16, 2, dtype=torch.bfloat16).t(), "residual: each row"),
    ("summed", torch.zeros(2, 16, dtype=torch.float16), "summed: expected x's shape, dtype"),
])
def test_the_fused_entry_point_checks_residual_and_summed(name, value, message):
    args = dict(residual=torch.zeros(2, 16, dtype=torch.bfloat16), summed=None) | {name: value}
    with pytest.raises(ValueError, match=message):
        rn.rms_norm_add(torch.zeros(2, 16, dtype=torch.bfloat16), args["residual"], torch.ones(16, dtype=torch.bfloat16),
                        1e-6, summed=args["summed"])


def test_the_check_accepts_another_summation_order_and_rejects_wrong_formulas():
    """Known-wrong variants on the CPU (torch's CPU ops stand in for a kernel): the check must fail them,
    and pass the formula with its fp32 sum taken in another order (one after another, as cumsum adds)."""
    rng = np.random.default_rng(5)
    x = random_rows(rng, (64, 512), torch.bfloat16, "cpu")
    weight = torch.as_tensor(1 + 0.3 * rng.standard_normal(512), dtype=torch.bfloat16)
    xf, eps = x.float(), 1e-6
    other_order = xf.pow(2).cumsum(-1)[..., -1:] * (np.float32(1) / np.float32(512))
    check_norm(weight * (xf * torch.rsqrt(other_order + eps)).to(x.dtype), x, weight, eps, what="sequential sum")
    factor = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    factor = (factor.double() * (1 + 64 * 2.0**-23)).float()  # 64 fp32 ulps up: a quarter of DELTA(512)
    moved = weight * (xf * factor).to(x.dtype)
    assert (moved != rn.rms_norm_reference(x, weight, eps)).any()  # it does flip some roundings
    check_norm(moved, x, weight, eps, what="factor 64 ulps up")
    wrong = {
        "mean over n - 1": weight * (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / 511 + eps)).to(x.dtype),
        "one rounding": (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype),
        "eps inside the mean": weight * (xf * torch.rsqrt((xf.pow(2) + 1e-2).mean(-1, keepdim=True))).to(x.dtype),
    }
    for what, got in wrong.items():
        with pytest.raises(AssertionError):
            check_norm(got, x, weight, eps, what=what)


def test_the_interval_holds_the_formula_and_excludes_a_one_percent_shift():
    rng = np.random.default_rng(6)
    x = random_rows(rng, (16, 1536), torch.bfloat16, "cpu")
    weight = torch.as_tensor(1 + 0.3 * rng.standard_normal(1536), dtype=torch.bfloat16)
    low, high = allowed_interval(x, weight, 1e-6)
    exact = rn.rms_norm_reference(x, weight, 1e-6)
    assert bool(((low <= exact) & (exact <= high)).all())
    assert bool(((exact * 1.01 > high) | (exact * 1.01 < low)).any())


@pytest.mark.parametrize("arch", cuda.ARCHITECTURES)
def test_nvcc_builds_every_norm_kernel_without_spills(arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    report = cuda.ptxas_report(rn.KERNEL_FILE, arch, tmp_path)
    names = {rn.kernel_choice(dtype, dim, fused=fused)[0] for dtype in rn.KERNEL_DTYPES
             for dim in (16, 8200, 16_392, 65_536) for fused in (False, True)}
    assert names == set(report.kernels), sorted(set(report.kernels) ^ names)
    for name, resources in report.kernels.items():
        assert resources.spilled_bytes == 0, f"{name} spills on {arch}: {resources}"
        assert resources.shared_bytes <= 99 * 1024


# ----------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.gpu


def require_gpu():
    from kdtree_lib.backend import cuda_available
    if not (cuda_available() and torch.cuda.is_available()):
        pytest.skip("needs a CUDA GPU with CuPy and torch")


def poisoned(like):
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def random_weight(rng, dim, dtype, *, unit: bool):
    if unit:
        return torch.ones(dim, dtype=dtype, device="cuda")
    return torch.as_tensor(1 + 0.3 * rng.standard_normal(dim), dtype=torch.float32).to("cuda", dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim, rows", DIMS_ROWS)
@pytest.mark.parametrize("unit", [False, True], ids=["weights", "unit"])
def test_gpu_norm_matches_torch(dtype, dim, rows, unit):
    require_gpu()
    rng, seed = fresh_rng()
    x = random_rows(rng, (rows, dim), dtype, "cuda")
    weight = random_weight(rng, dim, dtype, unit=unit)
    out = poisoned(x)
    got = rn.rms_norm(x, weight, 1e-6, out=out)
    assert got.data_ptr() == out.data_ptr()
    check_norm(got, x, weight, 1e-6, what=f"seed {seed} {dtype} {rows}x{dim}")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim, rows", DIMS_ROWS)
def test_gpu_fused_add_matches_torch(dtype, dim, rows):
    require_gpu()
    rng, seed = fresh_rng()
    x, residual = (random_rows(rng, (rows, dim), dtype, "cuda") for _ in range(2))
    weight = random_weight(rng, dim, dtype, unit=False)
    out, summed = poisoned(x), poisoned(x)
    got, got_sum = rn.rms_norm_add(x, residual, weight, 1e-6, out=out, summed=summed)
    assert torch.equal(got_sum, x + residual), f"seed {seed}: the sum is not torch's add"
    check_norm(got, got_sum, weight, 1e-6, what=f"seed {seed} {dtype} {rows}x{dim} fused")


@gpu
def test_gpu_strided_rows_and_leading_axes():
    """MLA's latent is a slice of a 576-wide row; a [B, T, H, d] head norm has three leading axes."""
    require_gpu()
    rng, seed = fresh_rng()
    wide = random_rows(rng, (3, 5, 576), torch.bfloat16, "cuda")
    latent = wide[..., :512]
    weight = random_weight(rng, 512, torch.bfloat16, unit=False)
    check_norm(rn.rms_norm(latent, weight, 1e-6), latent, weight, 1e-6, what=f"seed {seed} latent")
    heads = random_rows(rng, (2, 7, 4, 64), torch.bfloat16, "cuda")
    weight = random_weight(rng, 64, torch.bfloat16, unit=False)
    check_norm(rn.rms_norm(heads, weight, 1e-6), heads, weight, 1e-6, what=f"seed {seed} heads")
    residual = random_rows(rng, (3, 5, 576), torch.bfloat16, "cuda")[..., 64:]
    weight = random_weight(rng, 512, torch.bfloat16, unit=False)
    normed, summed = rn.rms_norm_add(latent, residual, weight, 1e-6)
    assert torch.equal(summed, latent + residual)
    check_norm(normed, summed, weight, 1e-6, what=f"seed {seed} strided fused")


@gpu
def test_gpu_a_rows_output_does_not_depend_on_the_rows_beside_it():
    """The block size follows the row length only: one row alone equals that row inside 1000 rows."""
    require_gpu()
    rng, _ = fresh_rng()
    for dim in (128, 7168):
        x = random_rows(rng, (1000, dim), torch.bfloat16, "cuda")
        weight = random_weight(rng, dim, torch.bfloat16, unit=False)
        together = rn.rms_norm(x, weight, 1e-6)
        for row in (0, 517, 999):
            assert torch.equal(rn.rms_norm(x[row:row + 1], weight, 1e-6), together[row:row + 1])


@gpu
def test_gpu_the_module_runs_the_kernel_outside_autograd_only():
    require_gpu()
    rng, seed = fresh_rng()
    norm = RMSNorm(7168, 1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(random_weight(rng, 7168, torch.bfloat16, unit=False))
    x, residual = (random_rows(rng, (4, 9, 7168), torch.bfloat16, "cuda") for _ in range(2))
    with torch.no_grad():
        assert torch.equal(norm(x), rn.rms_norm(x, norm.weight, 1e-6))
        normed, summed = norm.add_forward(x, residual)
        expected, expected_sum = rn.rms_norm_add(x, residual, norm.weight, 1e-6)
        assert torch.equal(normed, expected) and torch.equal(summed, expected_sum)
    assert torch.equal(norm(x), literal_formula(x, norm.weight, 1e-6))  # grad enabled, weight requires grad
    norm.requires_grad_(False)
    stream = residual.clone().requires_grad_(True)  # a gradient to the residual stream only: torch's ops
    normed_grad, summed_grad = norm.add_forward(x, stream)
    assert normed_grad.grad_fn is not None and summed_grad.grad_fn is not None
    assert torch.equal(normed_grad, literal_formula(x + residual, norm.weight, 1e-6))
    check_norm(normed, summed, norm.weight.detach(), 1e-6, what=f"seed {seed} module")


@gpu
def test_gpu_norm_in_a_cuda_graph_equals_eager():
    require_gpu()
    rng, _ = fresh_rng()
    norm = RMSNorm(1536, 1e-6).to("cuda", torch.bfloat16).requires_grad_(False)
    x, residual = (random_rows(rng, (8, 1536), torch.bfloat16, "cuda") for _ in range(2))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        norm.add_forward(x, residual)  # warm-up: compile and prepare outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = norm.add_forward(x, residual)
    x.copy_(random_rows(rng, (8, 1536), torch.bfloat16, "cuda"))
    graph.replay()
    eager, eager_sum = norm.add_forward(x, residual)
    torch.cuda.synchronize()
    assert torch.equal(normed, eager) and torch.equal(summed, eager_sum)
