"""The W4A16 MoE of a verify step (kdtree_lib/moe.py, kernels/moe_int4.cu).

CPU: the kernel layout is a lossless permutation of the checkpoint's, and the MMA fragments the
kernel builds from it give the tile product; the reference equals dequantize-then-matmul; TP and EP
shards sum to the whole; load_target keeps INT4 experts INT4, each rank reading its slices only; bad
inputs are refused naming the tensor; the launch plan fits both targets; the benchmark's readers work
on synthetic rows; nvcc builds the kernels for sm_90 and sm_120 without spills.
GPU (`-m gpu`): the kernel against the dequantized fp32 reference at K2.6's per-rank shapes (TP=1 and
the TP=8 slice), M from 1 to 4096 with ragged loads, outputs poisoned, error at most twice torch bf16's
on the same dequantized weights; CUDA-graph replay equals eager bit for bit.
"""
import functools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kdtree_lib import cuda, moe  # noqa: E402
from kdtree_lib.model.checkpoint import dequantize_int4, quantize_int4  # noqa: E402
from tolerances import assert_within_baseline, logit_bound  # noqa: E402

K26 = {"hidden": 7168, "width": 2048, "experts": 384, "top_k": 8}
SM120_LIMITS = moe.SM120_SMEM_PER_BLOCK
H200_SMEM_PER_BLOCK = 232448


def checkpoint_experts(n_experts, hidden, width, *, seed=0):
    """Stacked checkpoint-layout INT4 tensors of random experts (quantize_int4, the format's writer)."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n_experts, 2 * width, hidden, generator=generator) / hidden ** 0.5
    down = torch.randn(n_experts, hidden, width, generator=generator) / width ** 0.5
    packed = [[quantize_int4(w) for w in stack] for stack in (gate_up, down)]
    return [torch.stack([p[i] for p in stack]) for stack in packed for i in (0, 1)]


def routing(tokens, n_experts, top_k, *, seed=0, total=None):
    rng = np.random.default_rng(seed)
    routes = np.stack([rng.choice(total or n_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return routes, weights


# ----------------------------------------------------------------------------------------------
# CPU: the layout

def test_repack_is_a_lossless_permutation():
    gate_up_packed, gate_up_scale, *_ = checkpoint_experts(3, 128, 64)
    codes, scales = moe.repack(gate_up_packed, gate_up_scale)
    assert codes.shape == (3, 128 // 16, 128 // 64, 32, 4) and scales.shape == (3, 8, 2, 8, 2, 2)
    assert codes.numel() * 4 + scales.numel() * 2 == gate_up_packed.numel() * 4 + gate_up_scale.numel() * 2  # 4.5 bits
    packed, scale = moe.unpack(codes, scales)
    assert torch.equal(packed, gate_up_packed) and torch.equal(scale, gate_up_scale)
    assert torch.equal(moe.dequantize(gate_up_packed, gate_up_scale)[2],
                       dequantize_int4(gate_up_packed[2], gate_up_scale[2], moe.GROUP_SIZE))


def test_mma_data_flow_computes_the_tile_product():
    """The tile product as kernels/moe_int4.cu runs it, with mma.sync m16n8k16's documented fragments.
    Lane (g, c), step b: A register i holds, low half then high half, nibbles i and i + 4 of word b =
    (row g + 8·(i % 2), input 16c + 4b + 2·(i // 2) + {0, 1}) scaled by that row's group
    2·chunk + c // 2 (docs/moe-int4.md's order: checked weight by weight); B registers b0, b1 are
    token g's activations 16c + 4b + {0, 1} and {2, 3}; accumulator r is (row g + 8·(r // 2), token
    2c + r % 2). Together they must give W·xᵀ for a 16-row tile and 8 tokens."""
    inputs = 128
    packed, scale, *_ = checkpoint_experts(1, inputs, 64)
    weight = moe.dequantize(packed, scale)[0, :16].double().numpy()             # tile 0: [16, inputs]
    codes, scales = moe.repack(packed, scale)
    words = codes[0, 0].numpy().view(np.uint32)                                # [chunks, 32, 4]
    pairs = scales[0, 0].float().numpy()                                       # [chunks, 8, 2, 2]
    x = np.random.default_rng(9).standard_normal((8, inputs))
    acc = np.zeros((32, 4))
    for chunk in range(inputs // 64):
        for b in range(4):
            a_tile, b_tile = np.zeros((16, 16)), np.zeros((16, 8))  # the MMA's A [m, k] and B [k, n]
            for lane in range(32):
                g, c = lane // 4, lane % 4
                for i in range(4):
                    for half in range(2):
                        code = (int(words[chunk, lane, b]) >> (4 * (i + 4 * half))) & 0xF
                        row, k = g + 8 * (i % 2), 2 * c + 8 * (i // 2) + half
                        a_tile[row, k] = (code - 8) * pairs[chunk, g, c // 2, i % 2]
                        assert a_tile[row, k] == weight[row, 64 * chunk + 16 * c + 4 * b + 2 * (i // 2) + half]
                activations = x[g, 64 * chunk + 16 * c:64 * chunk + 16 * c + 16]
                for register in range(2):  # b0, b1
                    for half in range(2):
                        b_tile[2 * c + 8 * register + half, g] = activations[4 * b + 2 * register + half]
            product = a_tile @ b_tile
            for lane in range(32):
                g, c = lane // 4, lane % 4
                for r in range(4):
                    acc[lane, r] += product[g + 8 * (r // 2), 2 * c + r % 2]
    expected = weight @ x.T                                                    # [16 rows, 8 tokens]
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for r in range(4):
            assert acc[lane, r] == pytest.approx(expected[g + 8 * (r // 2), 2 * c + r % 2], rel=1e-12, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# CPU: the reference

def test_reference_equals_dequantize_then_matmul():
    hidden, width, n_experts, top_k, tokens = 128, 64, 6, 3, 11
    tensors = checkpoint_experts(n_experts, hidden, width, seed=1)
    experts = moe.Int4Experts.from_checkpoint(*tensors, hidden=hidden, width=width, experts_per_repack=4)
    routes, weights = routing(tokens, n_experts, top_k, seed=2)
    x = np.random.default_rng(3).standard_normal((tokens, hidden)).astype(np.float32)
    out = moe.moe_forward(x, routes, weights, experts, backend="numpy")
    gate_up, down = dequantized(tensors, n_experts, hidden, width)
    expected = dense_loop(x, routes, weights, gate_up, down, np.float64)
    # the same-precision baseline: the same loop in float32 (dequantize, then matmul token by token)
    baseline = dense_loop(x, routes, weights, gate_up, down, np.float32)
    assert out.dtype == np.float32
    assert_within_baseline(out, expected, baseline, what="numpy backend")
    dense = moe.DenseExperts(torch.from_numpy(gate_up).float(), torch.from_numpy(down).float())
    torch_out = moe.moe_forward(torch.from_numpy(x), torch.from_numpy(routes), torch.from_numpy(weights), dense,
                                backend="torch")
    assert_within_baseline(torch_out, expected, baseline, what="torch backend, dense experts")
    with pytest.raises(AssertionError):  # a bound that a wrong answer fails: two tokens' outputs swapped
        assert_within_baseline(out[[1, 0, *range(2, tokens)]], expected, baseline)


def dequantized(tensors, n_experts, hidden, width):
    """The checkpoint's INT4 experts as float64 gate_up [E, 2W, H] and down [E, H, W] (exact in float32 too)."""
    gate_up = dequantize_int4(tensors[0].reshape(-1, hidden // 8), tensors[1].reshape(-1, hidden // 32), 32)
    down = dequantize_int4(tensors[2].reshape(-1, width // 8), tensors[3].reshape(-1, width // 32), 32)
    return (gate_up.double().numpy().reshape(n_experts, 2 * width, hidden),
            down.double().numpy().reshape(n_experts, hidden, width))


def dense_loop(x, routes, weights, gate_up, down, dtype):
    """The MoE layer written out token by token in `dtype`."""
    x, weights, gate_up, down = (np.asarray(a).astype(dtype) for a in (x, weights, gate_up, down))
    out = np.zeros(x.shape, dtype)
    for t in range(x.shape[0]):
        for s in range(routes.shape[1]):
            gate, up = np.split(gate_up[routes[t, s]] @ x[t], 2)
            out[t] += weights[t, s] * (down[routes[t, s]] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def test_tp_and_ep_shards_sum_to_the_whole():
    hidden, width, n_experts, top_k, tokens = 64, 128, 4, 2, 9
    tensors = checkpoint_experts(n_experts, hidden, width, seed=4)
    whole = moe.Int4Experts.from_checkpoint(*tensors, hidden=hidden, width=width)
    routes, weights = routing(tokens, n_experts, top_k, seed=5)
    x = np.random.default_rng(6).standard_normal((tokens, hidden)).astype(np.float32)
    full = moe.moe_forward(x, routes, weights, whole)
    gate_up_packed, gate_up_scale, down_packed, down_scale = tensors
    tp = []
    for lo, hi in ((0, width // 2), (width // 2, width)):  # TP: a slice of every expert's width
        rows = torch.cat([torch.arange(lo, hi), width + torch.arange(lo, hi)])
        shard = moe.Int4Experts.from_checkpoint(gate_up_packed[:, rows], gate_up_scale[:, rows],
                                                down_packed[:, :, lo // 8:hi // 8], down_scale[:, :, lo // 32:hi // 32],
                                                hidden=hidden, width=hi - lo)
        tp.append(moe.moe_forward(x, routes, weights, shard))
    ep = []
    for first in (0, n_experts // 2):  # EP: whole experts, half of them
        part = slice(first, first + n_experts // 2)
        shard = moe.Int4Experts.from_checkpoint(*(t[part] for t in tensors), hidden=hidden, width=width,
                                                first_expert=first, total_experts=n_experts)
        ep.append(moe.moe_forward(x, routes, weights, shard))
    # the shards' sum is as close to the float64 layer as the whole layer in float32 (the same-precision baseline)
    expected = dense_loop(x, routes, weights, *dequantized(tensors, n_experts, hidden, width), np.float64)
    assert_within_baseline(sum(tp), expected, full, what="TP shards")
    assert_within_baseline(sum(ep), expected, full, what="EP shards")


# ----------------------------------------------------------------------------------------------
# CPU: bad input, refused before any launch

def _small_case():
    hidden, width, n_experts = 64, 64, 4
    tensors = checkpoint_experts(n_experts, hidden, width)
    experts = moe.Int4Experts.from_checkpoint(*tensors, hidden=hidden, width=width)
    routes, weights = routing(5, n_experts, 2)
    return tensors, experts, torch.randn(5, hidden), torch.from_numpy(routes), torch.from_numpy(weights)


def test_packed_weights_that_disagree_with_the_config():
    tensors, *_ = _small_case()
    with pytest.raises(ValueError, match="gate_up_packed"):
        moe.Int4Experts.from_checkpoint(*tensors, hidden=128, width=64)
    with pytest.raises(ValueError, match="down_packed"):
        moe.Int4Experts.from_checkpoint(tensors[0], tensors[1], tensors[2][:, :32], tensors[3], hidden=64, width=64)
    with pytest.raises(ValueError, match="gate_up_scale"):
        moe.Int4Experts.from_checkpoint(tensors[0], tensors[1][..., :1], *tensors[2:], hidden=64, width=64)
    with pytest.raises(ValueError, match="down_codes"):
        experts = moe.Int4Experts.from_checkpoint(*tensors, hidden=64, width=64)
        moe.Int4Experts(experts.gate_up_codes, experts.gate_up_scales, experts.down_codes[:, :2],
                        experts.down_scales, hidden=64, width=64)
    with pytest.raises(ValueError, match="x"):
        _, experts, x, routes, weights = _small_case()
        moe.moe_forward(x[:, :32], routes, weights, experts)


def test_a_group_size_other_than_the_checkpoints():
    tensors, *_ = _small_case()
    with pytest.raises(ValueError, match="group_size"):
        moe.Int4Experts.from_checkpoint(*tensors, hidden=64, width=64, group_size=64)


def test_routes_out_of_range():
    _, experts, x, routes, weights = _small_case()
    for bad in (experts.n_experts, -1):
        wrong = routes.clone()
        wrong[3, 1] = bad
        with pytest.raises(ValueError, match="routes"):
            moe.moe_forward(x, wrong, weights, experts)
    with pytest.raises(ValueError, match="routes"):
        moe.moe_forward(x, routes[:4], weights, experts)


def test_weights_with_nan():
    tensors, experts, x, routes, weights = _small_case()
    weights[2, 0] = float("nan")
    with pytest.raises(ValueError, match="weights"):
        moe.moe_forward(x, routes, weights, experts)
    scale = tensors[3].clone()
    scale[1, 5, 0] = float("nan")
    with pytest.raises(ValueError, match="down_scale"):
        moe.Int4Experts.from_checkpoint(*tensors[:3], scale, hidden=64, width=64)


def test_capacity_too_small():
    _, experts, x, routes, weights = _small_case()
    with pytest.raises(ValueError, match="capacity"):
        moe.moe_forward(x, routes, weights, experts, capacity=routes.numel() - 1)
    with pytest.raises(ValueError, match="capacity"):
        moe.prepare_moe_launch(x, routes, weights, experts, capacity=3)


def test_the_kernel_takes_at_most_16_experts_per_token():
    """moe_combine holds a token's slots in registers: more is refused before anything is prepared."""
    torch = pytest.importorskip("torch")
    _, experts, x, routes, weights = _small_case()
    wide = torch.as_tensor(routes)[:, :1].repeat(1, moe.COMBINE_MAX_TOP_K + 1)
    wide_weights = torch.full(wide.shape, 1.0 / wide.shape[1])
    with pytest.raises(ValueError, match="routes: the cupy kernel takes at most 16"):
        moe.prepare_moe_launch(x, wide, wide_weights, experts, capacity=wide.numel())


def test_the_kernel_takes_bf16_cuda_tokens():
    _, experts, x, routes, weights = _small_case()
    with pytest.raises(ValueError, match="x: the cupy kernel"):
        moe.prepare_moe_launch(x, routes, weights, experts)
    with pytest.raises(ValueError, match="backend"):
        moe.moe_forward(x, routes, weights, experts, backend="cupy")


def test_the_error_check_rejects_known_wrong_answers():
    """gpu-mode style: scales ignored, or one slot's weight dropped, must fail the GPU tests' bound."""
    _, experts, x, routes, weights = _small_case()
    ref = moe.moe_forward(x, routes, weights, experts, backend="torch")
    bf16 = moe.moe_forward(x.bfloat16(), routes, weights, experts, backend="torch").float()
    allowed = 2 * relative_error(bf16, ref)
    dropped = weights.clone()
    dropped[:, 1] = 0
    assert relative_error(moe.moe_forward(x, routes, dropped, experts, backend="torch"), ref) > allowed
    unscaled = moe.Int4Experts(experts.gate_up_codes, torch.ones_like(experts.gate_up_scales) / 64,
                               experts.down_codes, experts.down_scales, hidden=64, width=64)
    assert relative_error(moe.moe_forward(x, routes, weights, unscaled, backend="torch"), ref) > allowed


def relative_error(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------------------------
# CPU: load_target keeps a pack-quantized checkpoint's routed experts INT4

@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    """A made-to-format K2.6 checkpoint (INT4 routed experts) whose TP=2 expert slices fit the kernel
    layout (hidden 128, width 128 = 2 x 64)."""
    from kdtree_lib.model.reference import random_model, save_kimi_checkpoint
    from kdtree_lib.pairs import tiny_config
    config = tiny_config(hidden_size=128, moe_intermediate_size=128)
    return save_kimi_checkpoint(random_model(config, seed=3), config, tmp_path_factory.mktemp("int4"), int4=True)


def test_int4_experts_stay_int4_and_give_the_dequantized_models_logits(int4_checkpoint):
    from kdtree_lib.model import load_target
    from kdtree_lib.model.model import Experts
    resident = load_target(int4_checkpoint, dtype=torch.float32)
    dequantized = load_target(int4_checkpoint, dtype=torch.float32, dequantize_experts=True)
    experts = [m for m in resident.modules() if isinstance(m, Experts)]
    assert experts and all(e.int4 and not hasattr(e, "gate_up_proj") for e in experts)
    config = resident.config
    weights = 3 * config.hidden_size * config.moe_intermediate_size * config.n_routed_experts
    for e in experts:  # 4.5 bits per weight, kept through a cast of the model
        assert sum(t.numel() * t.element_size() for t in e.buffers()) * 8 == 4.5 * weights
        assert (e.gate_up_codes.dtype, e.down_scales.dtype) == (torch.int32, torch.bfloat16)
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(8))
    ours = resident.prefill(tokens, resident.new_cache(1, 9)).logits
    theirs = dequantized.prefill(tokens, dequantized.new_cache(1, 9)).logits
    # the same fp32 weights; only the experts' summation order may differ: two float32 forwards of one model
    assert float((ours - theirs).abs().max()) <= logit_bound(config, theirs)


def test_each_rank_reads_only_its_int4_slices(int4_checkpoint):
    from kdtree_lib.model import CheckpointReader, TensorParallel, load_config
    from kdtree_lib.model.checkpoint import empty_target, load_weights
    config = load_config(int4_checkpoint)

    class ExpertBytes(CheckpointReader):
        """Counts the bytes of routed-expert codes and scales apart (not the [2] shape records)."""
        expert_bytes = 0

        def read_raw(self, name, *args):
            tensor = super().read_raw(name, *args)
            if ".experts." in name and not name.endswith("_shape"):
                self.expert_bytes += tensor.numel() * tensor.element_size()
            return tensor

    def bytes_read(tp, int4):
        model = empty_target(config, tp, device="cpu", dtype=torch.float32, int4_experts=int4)
        reader = ExpertBytes(int4_checkpoint, config.quantization)
        load_weights(model, reader)
        return reader.expert_bytes, reader.bytes_read

    whole = bytes_read(TensorParallel(), True)
    ranks = [bytes_read(TensorParallel(rank=r, size=2), True) for r in range(2)]
    assert ranks[0][0] == ranks[1][0] == whole[0] / 2  # each rank: half of every expert's codes and scales
    assert ranks[0] == bytes_read(TensorParallel(rank=0, size=2), False)  # what the dequantizing load reads


# ----------------------------------------------------------------------------------------------
# CPU: the plan and the builds

@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("tokens", [1, 8, 9, 16, 17, 512, 4096])
@pytest.mark.parametrize("smem", [SM120_LIMITS, H200_SMEM_PER_BLOCK], ids=["sm120", "h200"])
def test_plan_fits_the_shapes_and_both_targets(tp, tokens, smem):
    hidden, width = K26["hidden"], K26["width"] // tp
    plan = moe.plan_moe(tokens, hidden, width, smem_per_block=smem)
    gate_up, down = moe.GEMM_CONFIGS[plan.gate_up], moe.GEMM_CONFIGS[plan.down]
    assert gate_up.gate_up and not down.gate_up
    assert width % gate_up.rows_per_cta == 0 and hidden % down.rows_per_cta == 0
    assert max(gate_up.smem_bytes, down.smem_bytes) <= SM120_LIMITS
    assert gate_up.token_tiles == down.token_tiles == moe.token_tiles(tokens)
    assert 8 * gate_up.token_tiles >= min(tokens, 32)
    assert down.split == (1 if tp == 8 else moe.WARPS)  # the TP=8 slice's 256 inputs: whole rows per warp


def test_plan_takes_fewer_token_tiles_where_a_small_layer_needs_them():
    plan = moe.plan_moe(40, 128, 128, smem_per_block=SM120_LIMITS)  # 128 rows: no 256-row down CTA
    assert moe.GEMM_CONFIGS[plan.down].token_tiles == 1 and moe.GEMM_CONFIGS[plan.gate_up].token_tiles == 4


def test_plan_refuses_sizes_no_configuration_divides():
    with pytest.raises(ValueError, match="width"):
        moe.plan_moe(4, 7168, 64 + 8, smem_per_block=SM120_LIMITS)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", cuda.ARCHITECTURES)
def test_nvcc_builds_every_configuration_without_spills(arch, tmp_path):
    kernels = cuda.ptxas_report(moe.KERNEL_FILE, arch, tmp_path).kernels
    assert set(moe.GEMM_CONFIGS) | {"moe_route", "moe_combine"} <= set(kernels)
    for name, resources in kernels.items():
        print(f"{arch} {name}: {resources.registers} registers, {resources.spilled_bytes} bytes spilled")
        assert resources.spilled_bytes == 0, f"{name} spills on {arch}"
        assert resources.registers <= 255


def test_the_benchmark_reads_its_targets_from_rows():
    from kdtree_lib.bench import moe_int4 as bench

    def row(provider, tokens, time_us, pct=None, **extra):
        return {"provider": provider, "tp": 8, "routing": "uniform", "tokens": tokens, "time_us": time_us,
                "pct_roofline": pct, "launch_floor_us": 4.0, **extra}
    rows = [row("roofline", 1, 6.0), row("kernel", 1, 14.0, 42.9), row("kernel", 8, 50.0, 80.0),
            row("kernel", 64, 900.0, 65.0), row("kernel_ep", 8, 75.0, ep_rank_experts_hit=12),
            row("kernel", 8, 1.0, 99.0, tp=1)]  # another TP: not a target
    summary = bench.summary(rows)
    assert (summary["pct_roofline_min"], summary["shapes_at_target"], summary["target_shapes"]) == (65.0, 1, 2)
    assert summary["single_token_bound_us"] == [15.0] and summary["single_token_ok"]  # 1.5 x (6 + 4)
    [entry] = bench.parallel_comparison(rows)
    assert (entry["tokens"], entry["tp_us"], entry["ep_us"], entry["ep_over_tp"]) == (8, 50.0, 75.0, 1.5)
    plans = rows + [row("kernel_tt2", 64, 700.0, plan="b")]
    for r in plans:
        r.setdefault("plan", "a")
    assert [(b["tokens"], b["best_plan"], b["best_us"]) for b in bench.best_plans(plans)] == [
        (1, "a", 14.0), (8, "a", 50.0), (64, "b", 700.0)]


def test_the_benchmark_plots_draw_every_provider(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kdtree_lib.bench import moe_int4 as bench
    from kdtree_lib.plots import moe_int4 as moe_plots
    rows = [{"provider": provider, "tp": 8, "routing": routing, "tokens": m, "time_us": 10.0 * m,
             "experts_hit": min(384, 8 * m)}
            for provider in moe_plots.PROVIDER_STYLE for routing in bench.ROUTINGS for m in (1, 8, 64)]
    fig, (left, right) = plt.subplots(1, 2)
    moe_plots.plot_time(left, rows, tp=8, routing="uniform")
    moe_plots.plot_union(right, rows, tp=8)
    assert len(left.lines) == len(moe_plots.PROVIDER_STYLE) and len(right.lines) == len(bench.ROUTINGS)
    plt.close(fig)


def test_correlated_routing_shrinks_the_union():
    from kdtree_lib.bench import moe_int4 as bench
    uniform, _ = bench.make_routing(256, 384, 8, "uniform", seed=0, device="cpu")
    correlated, weights = bench.make_routing(256, 384, 8, "correlated", seed=0, device="cpu")
    assert correlated.shape == weights.shape == (256, 8) and correlated.dtype == torch.int32
    assert all(len(set(r.tolist())) == 8 for r in correlated)  # distinct experts per token, as a router picks
    assert len(torch.unique(correlated)) < len(torch.unique(uniform))


def test_the_benchmark_covers_issue_31s_grid_in_one_command():
    from kdtree_lib.bench import moe_int4 as bench
    args = bench.parse_args([])
    assert args.tokens == [1, 4, 8, 16, 32, 64, 128, 256, 512] and args.tp == [8, 1]
    assert args.routing == ["uniform", "correlated"] and not args.ncu
    assert bench.parse_args(["--quick"]).tokens == list(bench.QUICK_TOKENS)
    assert bench.parse_args(["--tokens", "2", "3", "--routing", "correlated", "--tp", "8"]).tokens == [2, 3]
    profiled = bench.parse_args(["--ncu"])
    assert (profiled.tokens, profiled.routing, profiled.tp) == ([1, 8, 64, 512], ["uniform"], [8, 1])


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--tokens", "1"], "not allowed with"), (["--tokens", "0"], "positive integer"),
    (["--tp", "2"], "invalid choice"), (["--routing", "zipf"], "invalid choice"),
    (["--profile-target"], "--shapes-file"), ([], "CUDA")])
def test_the_benchmark_refuses_in_one_line(argv, message, capsys, monkeypatch):
    from kdtree_lib.bench import moe_int4 as bench
    if not argv:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the grid needs a GPU
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_profile_refuses_without_ncu(capsys, monkeypatch):
    from kdtree_lib.bench import moe_int4 as bench
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    assert bench.main(["--ncu"]) == 2
    assert "ncu" in capsys.readouterr().err


def test_the_ncu_command_profiles_the_moe_kernels_of_the_chosen_shapes(tmp_path):
    from kdtree_lib.bench import moe_int4 as bench
    command = bench.ncu_command("ncu", tmp_path / "r", tmp_path / "s.json", [8], [1, 64], ["uniform"])
    text = " ".join(command)
    assert "--profile-from-start off" in text and "--kernel-name regex:^moe_" in text
    assert all(f"--section {section}" in text for section in bench.NCU_SECTIONS)
    assert command[command.index("--metrics") + 1].split(",") == list(bench.NCU_METRICS)
    target = command[command.index("-m"):]
    assert target[:3] == ["-m", "kdtree_lib.bench.moe_int4", "--profile-target"]
    args = bench.parse_args(target[2:])  # the target parses what the profile hands it
    assert (args.tp, args.tokens, args.routing, args.shapes_file) == ([8], [1, 64], ["uniform"], tmp_path / "s.json")
    assert bench.profile_shapes(args.tp, args.tokens, args.routing) == [(8, "uniform", 1), (8, "uniform", 64)]


NCU_SHAPE = {"tp": 8, "routing": "uniform", "tokens": 8, "width": 256, "experts_hit": 61, "device": "GPU",
             "plan": "moe_gate_up_t2_s8_tt1_d8+moe_down_t1_s1_tt1_d4", "gate_up_bytes": 61 * 2064384,
             "down_bytes": 61 * 1032192, "weight_bytes": 61 * 3096576}


def ncu_raw_csv(names=("moe_route", "moe_gate_up_t2_s8_tt1_d8", "moe_down_t1_s1_tt1_d4", "moe_combine")) -> str:
    """A raw page as `ncu --import --csv --page raw --print-units base` prints it (header, units, kernels)."""
    header = ["ID", "Kernel Name", "Grid Size", "Block Size", "gpu__time_duration.sum", "dram__bytes_read.sum",
              "dram__bytes_write.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
              "lts__t_sector_hit_rate.pct", "sm__warps_active.avg.pct_of_peak_sustained_active",
              "sm__maximum_warps_per_active_cycle_pct", "launch__registers_per_thread",
              "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"]
    units = ["", "", "", "", "ns", "byte", "byte", "%", "%", "%", "%", "register/thread", "", "", "", ""]
    lines = ["==PROF== Disconnected", ",".join(f'"{h}"' for h in header), ",".join(f'"{u}"' for u in units)]
    for i, name in enumerate(names):
        lines.append(",".join(f'"{v}"' for v in [i, f"{name}", "(1, 61, 1)", "(256, 1, 1)", "50,000", "125,000,000",
                                                  "1,000,000", "60.5", "12.25", "11.9", "12.5", "128", "7.5",
                                                  "0.25", "1.5", "1"]))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("cell, unit, value", [
    ("4,032", "ns", 4.032e-6), ("4,032", "nsecond", 4.032e-6), ("1.5", "us", 1.5e-6), ("2", "ms", 2e-3),
    ("3", "s", 3.0), ("1,536", "byte", 1536.0), ("1.5", "Kbyte", 1500.0), ("2", "Gbyte/s", 2e9),
    ("49.10", "%", 49.1), ("12", "register/thread", 12.0), ("128", "sector", 128.0), ("7", "%/byte", 7.0),
    ("(1, 1, 1)", "", "(1, 1, 1)")])
def test_an_ncu_cell_in_base_units(cell, unit, value):
    """The units the H200's ncu printed on its raw page (2026-12-02: "ns", "byte", "byte/s", "%", ...): a
    time in "ns" had been read as seconds, a million-fold too long."""
    from kdtree_lib.bench import moe_int4 as bench
    assert bench._ncu_value(cell, unit) == pytest.approx(value) if isinstance(value, float) else \
        bench._ncu_value(cell, unit) == value


def test_the_ncu_summary_reads_the_raw_page():
    from kdtree_lib.bench import moe_int4 as bench
    rows = bench.ncu_summary(ncu_raw_csv(), [NCU_SHAPE])
    assert [r["kernel"] for r in rows] == ["moe_route", "moe_gate_up_t2_s8_tt1_d8", "moe_down_t1_s1_tt1_d4",
                                            "moe_combine"]
    gate_up = rows[1]
    assert gate_up["duration_us"] == 50.0 and gate_up["dram_read_mb"] == 125.0 and gate_up["dram_write_mb"] == 1.0
    assert gate_up["dram_tbps"] == 2.52  # 126 MB in 50 us
    assert gate_up["expert_mb"] == round(61 * 2064384 / 1e6, 3) and rows[0]["expert_mb"] is None
    assert (gate_up["l2_hit_pct"], gate_up["achieved_occupancy_pct"], gate_up["theoretical_occupancy_pct"]) == (
        12.2, 11.9, 12.5)  # 12.25 rounds to even
    assert gate_up["top_stalls"] == "long_scoreboard 7.50; wait 1.50; barrier 0.25"  # selected: no stall
    with pytest.raises(ValueError, match="expected 8"):
        bench.ncu_summary(ncu_raw_csv(), [NCU_SHAPE, NCU_SHAPE])
    with pytest.raises(ValueError, match="expected 'moe_down_t1_s1_tt1_d4'"):
        bench.ncu_summary(ncu_raw_csv(("moe_route", "moe_gate_up_t2_s8_tt1_d8", "moe_down_t2_s1_tt2_d4",
                                       "moe_combine")), [NCU_SHAPE])


FAKE_NCU = """#!{python}
# ncu as the profile calls it: a profile run writes the report and (as the target would) the shapes;
# --import prints the raw page.
import sys
from pathlib import Path
args = sys.argv[1:]
if "--import" in args:
    sys.stdout.write(Path({raw!r}).read_text())
else:
    Path(args[args.index("--export") + 1] + ".ncu-rep").write_bytes(b"report")
    Path(args[args.index("--shapes-file") + 1]).write_text({shapes!r})
"""


def test_the_profile_writes_its_report_raw_page_and_summary_without_overwriting(tmp_path, monkeypatch):
    import json
    import sys
    from kdtree_lib.bench import moe_int4 as bench
    (tmp_path / "raw.csv").write_text(ncu_raw_csv())
    tools = tmp_path / "bin"
    tools.mkdir()
    fake = tools / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, raw=str(tmp_path / "raw.csv"),
                                    shapes=json.dumps([NCU_SHAPE])))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    results_dir = tmp_path / "results"
    first = bench.profile([8], [8], ["uniform"], results_dir=results_dir, log=lambda *_: None)
    second = bench.profile([8], [8], ["uniform"], results_dir=results_dir, log=lambda *_: None)
    assert first != second and first.parent == second.parent == results_dir / "ncu"
    names = sorted(p.name for p in (results_dir / "ncu").iterdir())
    assert len(names) == 8 and not [n for n in names if "partial" in n or n.startswith(".")], names
    for suffix in (".ncu-rep", ".raw.csv", ".summary.csv", ".shapes.json"):
        assert Path(str(first).replace(".summary.csv", suffix)).is_file()
    import csv
    summary = list(csv.DictReader(first.open()))
    assert len(summary) == 4 and summary[1]["dram_tbps"] == "2.52" and summary[1]["plan"] == NCU_SHAPE["plan"]


# ----------------------------------------------------------------------------------------------
# CPU: the plan chooser from measured rows

PLAN_A = "moe_gate_up_t2_s8_tt1_d8+moe_down_t1_s1_tt1_d4"  # token tiles 1
PLAN_B = "moe_gate_up_t4_s8_tt2_d3+moe_down_t2_s1_tt2_d4"  # 2
PLAN_C = "moe_gate_up_t4_s8_tt4_d2+moe_down_t2_s1_tt4_d4"  # 4


def plan_row(tokens, plan, time_us, *, provider="kernel", routing="uniform", run="r2", device="GPU A",
             width=256):
    return {"device": device, "run": run, "date": run, "commit": "c", "hidden": 7168, "width": width,
            "routing": routing, "tokens": tokens, "provider": provider, "plan": plan, "time_us": time_us}


def test_the_chooser_takes_the_fastest_measured_plan_of_the_newest_run():
    rows = [plan_row(64, PLAN_A, 100.0, run="r1"), plan_row(64, PLAN_C, 900.0, run="r1", provider="kernel_tt4"),
            # the newest run: C fastest for uniform routing by 10%, A for correlated by 50%: A wins overall
            plan_row(64, PLAN_C, 500.0), plan_row(64, PLAN_A, 550.0, provider="kernel_tt1"),
            plan_row(64, PLAN_B, 700.0, provider="kernel_tt2"),
            plan_row(64, PLAN_C, 300.0, routing="correlated"),
            plan_row(64, PLAN_A, 200.0, routing="correlated", provider="kernel_tt1"),
            plan_row(64, PLAN_B, 250.0, routing="correlated", provider="kernel_tt2"),
            plan_row(64, PLAN_B, 10.0, provider="kernel_ep"),          # another call: not a candidate
            plan_row(64, "moe_gate_up_gone+moe_down_gone", 1.0, provider="kernel_tt1"),  # an older kernel's
            plan_row(1, PLAN_B, 40.0), plan_row(1, PLAN_A, 30.0, provider="kernel_tt1"),
            plan_row(512, PLAN_B, 800.0), plan_row(512, PLAN_C, 900.0, provider="kernel_tt4"),
            plan_row(64, PLAN_C, 1.0, device="GPU B")]
    measured = moe.MeasuredPlans.from_rows([{k: str(v) for k, v in r.items()} for r in rows])  # as read from CSV
    assert {m: p.name for m, p in measured.best[("GPU A", 7168, 256)].items()} == {1: PLAN_A, 64: PLAN_A, 512: PLAN_B}
    assert measured.plan(64, 7168, 256, "GPU B").name == PLAN_C
    nearest = {m: measured.plan(m, 7168, 256, "GPU A") for m in (1, 7, 8, 181, 182, 512, 513)}
    assert nearest[1].name == nearest[7].name == PLAN_A  # 7: nearer 64 than 1 in log2
    assert nearest[8].name == PLAN_A                     # 8 is as near 1 as 64 (3 octaves): the smaller M
    assert nearest[181].name == PLAN_A and nearest[182].name == PLAN_B  # sqrt(64 * 512) = 181.02
    assert nearest[512].name == PLAN_B and nearest[513] is None  # outside the measured range: the formula
    assert measured.plan(64, 7168, 2048, "GPU A") is None and measured.plan(64, 7168, 256, "GPU C") is None


def test_the_chooser_needs_a_plan_timed_in_every_routing():
    rows = [plan_row(8, PLAN_A, 50.0), plan_row(8, PLAN_B, 40.0, routing="correlated")]
    assert moe.MeasuredPlans.from_rows(rows).best == {}


def test_choose_plan_falls_back_to_the_formula():
    measured = moe.MeasuredPlans({("GPU A", 7168, 256): {64: moe.MoePlan(*PLAN_A.split("+")),
                                                         512: moe.MoePlan(*PLAN_C.split("+"))}})
    formula = moe.plan_moe(64, 7168, 256, smem_per_block=SM120_LIMITS)
    assert formula.name == PLAN_C
    choose = functools.partial(moe.choose_plan, hidden=7168, width=256, measured=measured)
    assert choose(64, smem_per_block=SM120_LIMITS, device="GPU A", from_rows=True).name == PLAN_A
    assert choose(64, smem_per_block=SM120_LIMITS, device="GPU A", from_rows=False) == formula
    assert choose(64, smem_per_block=SM120_LIMITS, device="GPU B", from_rows=True) == formula
    assert choose(4096, smem_per_block=SM120_LIMITS, device="GPU A", from_rows=True) == moe.plan_moe(
        4096, 7168, 256, smem_per_block=SM120_LIMITS)  # past the measured M
    small = 32 * 1024  # PLAN_C's gate_up reduces through 64 KB: the formula's plan for this block instead
    assert choose(512, smem_per_block=small, device="GPU A", from_rows=True) == moe.plan_moe(
        512, 7168, 256, smem_per_block=small) != moe.MoePlan(*PLAN_C.split("+"))


def test_the_chosen_plans_are_no_slower_than_the_formulas_in_the_committed_rows():
    """On the rows it chooses from, the chooser never picks a plan slower than the formula's (geometric
    mean over routings), at every measured (device, width, M)."""
    from kdtree_lib import results
    from kdtree_lib.bench import moe_int4 as bench
    from kdtree_lib.paths import RESULTS_DIR
    rows = results.read_rows(bench.TOPIC, results_dir=RESULTS_DIR)
    measured = moe.MeasuredPlans.from_rows(rows)
    assert measured.best, "no committed MoE rows to choose from"
    for (device, hidden, width), plans in measured.best.items():
        newest = results.latest_run(bench.plan_rows(rows), device=device, hidden=hidden, width=width)
        for tokens, chosen in plans.items():
            formula = moe.plan_moe(tokens, hidden, width, smem_per_block=SM120_LIMITS)
            at = [r for r in newest if r["tokens"] == tokens and r["width"] == width]
            ratio = []
            for routing in {r["routing"] for r in at}:
                times = {r["plan"]: r["time_us"] for r in at if r["routing"] == routing}
                ratio.append(times[chosen.name] / times[formula.name])
            assert np.prod(ratio) <= 1.0, (device, width, tokens, chosen.name, formula.name, ratio)


# ----------------------------------------------------------------------------------------------
# GPU: against the dequantized fp32 reference at K2.6's per-rank shapes

SEED = int(os.environ.get("KDTREE_SEED", np.random.SeedSequence().entropy % 2 ** 31))


@pytest.fixture(scope="module", params=[8, 1], ids=["tp8", "tp1"])
def k26_experts(request):
    """One MoE layer's routed experts on this rank: all 384, width 2048 / tp (TP inside the experts)."""
    tp = request.param
    experts = moe.random_experts(K26["experts"], K26["hidden"], K26["width"] // tp, seed=SEED, device="cuda")
    yield tp, experts
    del experts
    torch.cuda.empty_cache()


def gpu_routing(tokens, *, seed, load="uniform"):
    """routes int32 [tokens, 8] (distinct experts per token) and fp32 weights on the GPU. load:
    "uniform"; "one_expert": slot 0 of every token is expert 7; "few": all routes within 16 experts,
    so most experts get no token."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    pool = 16 if load == "few" else K26["experts"]
    scores = torch.rand(tokens, pool, generator=generator, device="cuda")
    if load == "one_expert":
        scores[:, 7] = 2.0  # always the top choice
    routes = scores.topk(K26["top_k"], dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, K26["top_k"], generator=generator, device="cuda") * 2.5 / K26["top_k"]
    return routes, weights


CASES = [(1, "uniform"), (3, "uniform"), (8, "uniform"), (17, "uniform"), (64, "few"), (257, "uniform"),
         (512, "one_expert"), (4096, "uniform"), (4096, "one_expert")]


def _check_against_reference(experts, tokens, load, seed, **launch_options):
    routes, weights = gpu_routing(tokens, seed=seed, load=load)
    generator = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(tokens, experts.hidden, generator=generator, device="cuda").to(torch.bfloat16)
    ref = moe.moe_forward(x.float(), routes, weights, experts, backend="torch")
    bf16 = moe.moe_forward(x, routes, weights, experts, backend="torch")
    out = torch.full_like(x, float("nan"))
    launch = moe.prepare_moe_launch(x, routes, weights, experts, out=out, **launch_options)
    launch()
    kernel_error, torch_error = relative_error(out, ref), relative_error(bf16, ref)
    print(f"seed={seed} M={tokens} {load} width={experts.width} {launch.plan.name}: kernel {kernel_error:.2e}, "
          f"torch bf16 {torch_error:.2e}")
    assert bool(torch.isfinite(out).all()), "NaN left in the poisoned output (a row not written)"
    assert kernel_error <= 2 * torch_error
    return launch, out


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[f"M{m}-{load}" for m, load in CASES])
def test_kernel_matches_reference(k26_experts, case):
    tp, experts = k26_experts
    tokens, load = case
    if tp == 1 and tokens in (3, 17, 257):
        pytest.skip("TP=1 runs the smallest, the ragged and the largest cases (time)")
    _check_against_reference(experts, tokens, load, SEED + tokens)


@pytest.mark.gpu
def test_every_configuration_and_a_padded_capacity(k26_experts):
    tp, experts = k26_experts
    for config in (c for c in moe.GEMM_CONFIGS.values()):
        rows = 2 * experts.width if config.gate_up else experts.hidden
        if (rows // 2 if config.gate_up else rows) % config.rows_per_cta:
            continue
        plan = moe.plan_moe(8 * config.token_tiles, experts.hidden, experts.width, smem_per_block=10 ** 6)
        plan = moe.MoePlan(config.name, plan.down) if config.gate_up else moe.MoePlan(plan.gate_up, config.name)
        _check_against_reference(experts, 8 * config.token_tiles + 3, "few", SEED, plan=plan, capacity=1000)


@pytest.mark.gpu
def test_graph_replay_equals_eager(k26_experts):
    _, experts = k26_experts
    launch, eager = _check_against_reference(experts, 33, "uniform", SEED)
    eager = eager.clone()
    launch.out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(launch.out, eager)


@pytest.mark.gpu
def test_an_int4_checkpoint_runs_through_the_kernel(int4_checkpoint):
    """load_target on the GPU in bf16: INT4 experts through the kernel, logits against the fp32
    dequantized model, at most twice the error of the bf16 dequantized model (torch's grouped GEMM)."""
    from kdtree_lib.model import load_target
    tokens = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(SEED)).cuda()

    def logits(**options):
        model = load_target(int4_checkpoint, device="cuda", **options)
        return model.prefill(tokens, model.new_cache(1, tokens.shape[1])).logits.float()
    ref = logits(dtype=torch.float32, dequantize_experts=True)
    kernel_error = relative_error(logits(dtype=torch.bfloat16), ref)
    torch_error = relative_error(logits(dtype=torch.bfloat16, dequantize_experts=True), ref)
    print(f"tiny INT4 model, bf16 logits: kernel experts {kernel_error:.2e}, torch bf16 experts {torch_error:.2e}")
    assert kernel_error <= 2 * torch_error


@pytest.mark.gpu
def test_auto_backend_runs_the_kernel_on_bf16_cuda_tokens():
    experts = moe.random_experts(16, 256, 128, seed=SEED, device="cuda")
    routes = torch.randint(0, 16, (5, 4), device="cuda")
    weights = torch.rand(5, 4, device="cuda")
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    out = moe.moe_forward(x, routes, weights, experts)
    ref = moe.moe_forward(x.float(), routes, weights, experts)
    assert out.dtype == torch.bfloat16 and ref.dtype == torch.float32
    assert relative_error(out, ref) <= 2 * relative_error(moe.moe_forward(x, routes, weights, experts,
                                                                          backend="torch"), ref)


@pytest.mark.gpu
def test_every_plan_the_rows_choose_matches_the_reference(k26_experts):
    """What moe.PLAN_FROM_ROWS would run on this device: each M measured in the committed rows for this
    width, and one between each pair (the nearest-M choice), with the plan chosen for it."""
    from kdtree_lib.backend import device_name
    tp, experts = k26_experts
    measured = moe.measured_plans()
    points = sorted(measured.best.get((device_name(), experts.hidden, experts.width), {}))
    if not points:
        pytest.skip(f"no committed rows of {device_name()} at width {experts.width}")
    for tokens in sorted(set(points) | {round((a * b) ** 0.5) for a, b in zip(points, points[1:])}):
        plan = moe.choose_plan(tokens, experts.hidden, experts.width, smem_per_block=moe._device_smem_per_block(),
                               measured=measured, from_rows=True)
        _check_against_reference(experts, tokens, "uniform", SEED + tokens, plan=plan)


@pytest.mark.gpu
def test_the_grid_times_every_provider_and_stamps_the_plan(tmp_path):
    from kdtree_lib.bench import moe_int4 as bench
    rows = bench.run((8,), (1, 16), ("uniform",), reps=2, results_dir=tmp_path, log=print)
    providers = {r["provider"] for r in rows}
    assert {"kernel", "kernel_99kb", "torch_bf16", "roofline", "kernel_ep"} <= providers
    for r in bench.plan_rows(rows):
        gate_up, down = r["plan"].split("+")
        assert gate_up in moe.GEMM_CONFIGS and down in moe.GEMM_CONFIGS and r["time_us"] > 0
    assert all(r["plan_from_rows"] == moe.PLAN_FROM_ROWS for r in rows)
    assert len(bench.results.read_rows(bench.TOPIC, results_dir=tmp_path)) == len(rows)


@pytest.mark.gpu
def test_the_profile_target_records_its_shapes(tmp_path):
    import json
    from kdtree_lib.bench import moe_int4 as bench
    shapes_file = tmp_path / "shapes.json"
    assert bench.main(["--profile-target", "--shapes-file", str(shapes_file), "--tp", "8", "--tokens", "1", "8"]) == 0
    shapes = json.loads(shapes_file.read_text())
    assert [(s["tp"], s["routing"], s["tokens"]) for s in shapes] == [(8, "uniform", 1), (8, "uniform", 8)]
    assert shapes[0]["experts_hit"] == 8 and shapes[0]["gate_up_bytes"] + shapes[0]["down_bytes"] == shapes[0][
        "weight_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("ncu") is None, reason="ncu (Nsight Compute) not installed")
def test_the_ncu_profile_measures_each_kernel(tmp_path):
    """The sections and metric names of NCU_SECTIONS / NCU_METRICS exist on this ncu and GPU."""
    from kdtree_lib.bench import moe_int4 as bench
    import csv
    summary = bench.profile([8], [8], ["uniform"], results_dir=tmp_path)
    rows = list(csv.DictReader(summary.open()))
    assert [r["kernel"] for r in rows][::3] == ["moe_route", "moe_combine"] and len(rows) == 4
    for r in rows[1:3]:  # gate_up and down: the passes over the experts
        assert float(r["dram_tbps"]) > 0 and float(r["dram_read_mb"]) > 0 and r["l2_hit_pct"] != ""
        assert float(r["achieved_occupancy_pct"]) > 0 and r["top_stalls"]
