"""The CuPy verify-attention kernels (kernels/verify_attn.cu, kernels/verify_attn_sm90a.cu) against
the fp32 torch reference.

GPU tests draw fresh random inputs on every run (the seed is printed), use ragged sizes on purpose
(N not a multiple of 16, L not a multiple of the tile, N = 1, a request of length 0, differing
lengths, padding nodes), poison the outputs and the cache past each request's tree, force every
kernel variant the device runs (the wgmma one on compute capability 9.0) and split count, and
compare the output's error with a torch run's error in the kernel's own precision steps (flash-attention's
criterion) and the LSE's with the float32 rounding bound of its computation (`bench.error_bounds`). CPU tests cover the host checks, the launch plan, nvcc builds: the
portable kernel and the probes for sm_90 and sm_120, the wgmma kernel for sm_90a (no register spills).
"""
import os
import shutil

import numpy as np
import pytest


from kdtree_lib import cuda
from kdtree_lib.bench import ceilings
from kdtree_lib.bench import verify_attn as bench
from kdtree_lib.contracts import tree_from_parents
from kdtree_lib.verify_attn import (KERNEL_CONFIGS, KERNEL_FILE, KERNEL_FILE_SM90A, MIN_SPLIT_KEYS, _check_kernel_args,
                                    plan_launch, prepare_verify_launch, runnable_configs, verify_attention)

H200 = {"sms": 132, "smem_per_block": 232448, "smem_per_sm": 233472, "wgmma": True}
RTX_5090 = {"sms": 170, "smem_per_block": 101376, "smem_per_sm": 102400}
WGMMA = "rows64_keys64_wgmma_pipelined"
PORTABLE_CONFIGS = [name for name, c in KERNEL_CONFIGS.items() if not c.wgmma]


# ----------------------------------------------------------------------------------------------
# CPU: launch plan

@pytest.mark.parametrize("device", [H200, RTX_5090], ids=["sm90", "sm120"])
@pytest.mark.parametrize("batch, rows, slots", [(1, 8, 1025), (1, 128, 32784), (3, 136, 4097), (64, 1024, 131200),
                                                (8, 16, 70), (2, 1, 1)])
def test_plan_covers_every_key_and_row(device, batch, rows, slots):
    plan = plan_launch(batch, rows, slots, **device)
    config = plan.config
    assert config.smem_bytes <= device["smem_per_block"]
    assert plan.row_blocks * config.rows >= rows > (plan.row_blocks - 1) * config.rows
    assert plan.chunk % config.keys == 0
    assert plan.splits * plan.chunk >= slots > (plan.splits - 1) * plan.chunk
    if plan.splits > 1:  # splitting never starts a partial second wave, nor cuts below the minimum
        resident = device["smem_per_sm"] // (config.smem_bytes + 1024)
        assert batch * plan.row_blocks * plan.splits <= device["sms"] * max(1, resident)
        assert plan.chunk >= MIN_SPLIT_KEYS


def test_plan_picks_the_variant_by_rows_and_shared_memory():
    assert plan_launch(1, 8, 4096, **H200).config.rows == 16
    assert plan_launch(1, 24, 4096, **H200).config.rows == 32
    assert plan_launch(1, 128, 4096, **H200).config.rows == 64
    assert plan_launch(1, 128, 4096, **RTX_5090).config_name == "rows32_keys32_stages2"  # Q in registers: 77 KB
    assert plan_launch(1, 8, 4096, **RTX_5090).config_name == "rows16_keys32_stages2"
    with pytest.raises(ValueError, match="shared memory"):
        plan_launch(1, 8, 4096, sms=1, smem_per_block=48 * 1024, smem_per_sm=48 * 1024)
    with pytest.raises(ValueError, match="config"):
        plan_launch(1, 8, 4096, **H200, config="rows128")
    assert plan_launch(1, 8, 4096, **H200, splits=3).splits == 3
    with pytest.raises(ValueError, match="splits"):
        plan_launch(1, 8, 4096, **H200, splits=2000)


def test_the_wgmma_variant_needs_sm90a():
    assert plan_launch(1, 128, 4096, **H200).config_name == WGMMA  # preferred where it runs
    assert plan_launch(1, 128, 4096, **H200, config=WGMMA).config.wgmma
    with pytest.raises(ValueError, match="compute capability 9.0"):
        plan_launch(1, 128, 4096, **RTX_5090, config=WGMMA)
    assert not plan_launch(1, 128, 4096, **{**H200, "wgmma": False}).config.wgmma


def test_registers_cap_how_many_ctas_a_split_plan_counts_per_sm():
    """rows16_keys32_stages2 needs 75 KB (three would fit an H200 SM) but 128 threads of ~255
    registers: two per SM, so a split plan fills 2 x 132 CTAs, not a wave and a half."""
    config = KERNEL_CONFIGS["rows16_keys32_stages2"]
    assert H200["smem_per_sm"] // (config.smem_bytes + 1024) == 3
    plan = plan_launch(1, 16, 131072, **H200, config="rows16_keys32_stages2")
    assert plan.row_blocks == 1 and H200["sms"] < plan.splits <= 2 * H200["sms"]


def test_kernel_config_shared_memory_fits_its_target():
    assert KERNEL_CONFIGS["rows64_keys64_stages2"].smem_bytes <= H200["smem_per_block"]
    assert KERNEL_CONFIGS["rows16_keys32_stages2"].smem_bytes <= RTX_5090["smem_per_block"]
    assert KERNEL_CONFIGS[WGMMA].smem_bytes == 1024 + 3 * 64 * 1152 + 4 * 64 * 4
    assert all(c.smem_bytes <= H200["smem_per_block"] for c in KERNEL_CONFIGS.values())


def test_launch_enqueues_kernel_then_merge(monkeypatch):
    """The prepared launch's grids and argument counts (CPU: the kernels and launches are stand-ins)."""
    from kdtree_lib import verify_attn
    calls = []

    class StandIn:
        def __init__(self, function, grid, block, args, *, device, shared_mem=0):
            self.call = (function, grid, block, len(args), shared_mem)

        def __call__(self):
            calls.append(self.call)

    monkeypatch.setattr(verify_attn, "_kernel_functions", lambda config, half: ("main", "merge"))
    monkeypatch.setattr(cuda, "PreparedLaunch", StandIn)
    monkeypatch.setattr(cuda, "pointer", lambda x: np.uint64(0))
    monkeypatch.setattr(cuda, "device_index", lambda x: 0)
    plan = plan_launch(2, 3 * 8, 1000, **H200, splits=3)
    arrays = dict.fromkeys(("q_latent", "q_rope", "cache", "lengths", "mask", "out", "lse", "partial_out",
                            "partial_lse"))
    launch = verify_attn.VerifyLaunch(plan, False, arrays, (2, 3, 8, 1000, 1, 0.2), "out", "lse")
    assert launch() == ("out", "lse")
    assert calls == [("main", (plan.row_blocks, 3, 2), (plan.config.threads,), 15, plan.config.smem_bytes),
                     ("merge", (2 * 3 * 8, 4), (256,), 6, 0)]
    calls.clear()
    launch(merge=False)
    assert [name for name, *_ in calls] == ["main"]
    calls.clear()
    single = plan_launch(2, 24, 1000, **H200, splits=1)
    verify_attn.VerifyLaunch(single, False, arrays, (2, 3, 8, 1000, 1, 0.2), "out", "lse")()
    assert [name for name, *_ in calls] == ["main"]


def test_summary_reads_the_launchers_choice_and_each_variant():
    def row(provider, length, time_us, config=None, pct=None):
        return {"provider": provider, "batch": 1, "nodes": 16, "heads": 8, "rows": 128, "length": length,
                "time_us": time_us, "config": config, "pct_roofline": pct, "pct_roofline_mma": pct, "tflops": 1.0,
                "device": "H200", "date": "d"}
    rows = [row("kernel", 32768, 10.0, "a", 50.0), row("kernel", 131072, 40.0, "a", 52.0),
            row("kernel_variant", 32768, 8.0, "b", 60.0), row("kernel_variant", 131072, 30.0, "b", 70.0),
            row("torch_fallback", 32768, 30.0), row("torch_fallback", 131072, 120.0)]
    assert bench.variant_configs(rows) == ["b"]
    chosen, variant = bench.summary(rows), bench.summary(rows, "b")
    assert (chosen["pct_roofline_median"], chosen["speedup_median"], chosen["time_128k_over_32k_median"]) == (51.0, 3.0, 4.0)
    assert (variant["pct_roofline_median"], variant["speedup_min"], variant["compute_shapes"]) == (65.0, 3.75, 2)
    assert [r["provider"] for r in bench.kernel_rows(rows + [row("kernel_variant", 32768, 9.0, "a")], "a")] == [
        "kernel", "kernel"]  # the launcher's own row wins over a variant row of the same config
    assert [(r["length"], r["speedup"]) for r in bench.variant_ratios(rows, "b")] == [(32768, 1.25), (131072, 1.333)]


def test_target_comparison_counts_where_a_kernel_leads():
    def row(provider, nodes, length, pct, config):
        return {"provider": provider, "batch": 1, "nodes": nodes, "heads": 8, "rows": 8 * nodes, "length": length,
                "pct_roofline": pct, "config": config, "date": "d", "commit": "c", "device": "H200"}
    rows = [row("kernel", 16, 32768, 50.0, "a"), row("kernel_variant", 16, 32768, 40.0, "b"),
            row("kernel", 32, 32768, 70.0, "a"), row("kernel_variant", 32, 32768, 75.0, "b"),
            row("kernel", 64, 32768, 80.0, "a"),  # timed alone: compared with nothing
            row("kernel", 8, 32768, 10.0, "a")]   # N·H = 64: not a target shape
    comparison = bench.target_comparison(rows)
    assert [(c["nodes"], c["a"], c["b"], c["device"]) for c in comparison] == [
        (16, 50.0, 40.0, "H200"), (32, 70.0, 75.0, "H200"), (64, 80.0, None, "H200")]
    assert bench.leads(comparison, "a") == (1, 2) and bench.leads(comparison, "b") == (1, 2)
    assert [(k["config"], k["min"], k["median"], k["shapes"]) for k in bench.comparison_spread(comparison)] == [
        ("a", 50.0, 70.0, 3), ("b", 40.0, 57.5, 2)]
    assert [r["nodes"] for r in bench.below_target(rows)] == [16]  # under 60%, worst first
    assert [(r["nodes"], r["length"]) for r in bench.kernel_table(rows)] == [(8, 32768), (16, 32768), (32, 32768),
                                                                            (64, 32768)]


def test_run_over_run_compares_the_shapes_both_grid_runs_timed(monkeypatch):
    def row(run, date, nodes, time_us, provider="kernel"):
        return {"run": run, "date": date, "commit": run, "device": "H200", "provider": provider, "batch": "1",
                "nodes": str(nodes), "heads": "8", "length": "32768", "rows": str(8 * nodes), "time_us": str(time_us)}
    monkeypatch.setattr(bench, "benchmark_shapes", lambda: [None, None])  # a grid of two shapes
    rows = [row("old", "d1", 16, 36.0), row("old", "d1", 32, 48.0), row("ab", "d2", 16, 30.0),
            row("new", "d3", 16, 32.0), row("new", "d3", 64, 70.0), row("new", "d3", 16, 99.0, "sdpa")]
    assert [run[0]["run"] for run in bench.grid_runs(rows)] == ["new", "old"]  # the one-shape A/B run skipped
    new, old = bench.grid_runs(rows)
    assert [(r["nodes"], r["old_us"], r["new_us"], r["speedup"]) for r in bench.run_over_run(new, old)] == [
        (16, 36.0, 32.0, 1.125)]
    assert bench.run_over_run(new, old, nodes=64) == []


def test_fixed_cost_reads_the_short_call_of_the_same_shape():
    def row(provider, nodes, length, time_us, flops=None):
        return {"provider": provider, "batch": 1, "nodes": nodes, "heads": 8, "rows": 8 * nodes, "length": length,
                "time_us": time_us, "flops": flops, "pct_roofline": None, "launch_floor_us": 4.0}
    rows = [row("kernel", 16, 1024, 17.0, 2e8), row("roofline", 16, 1024, 1.0),
            row("kernel", 16, 32768, 32.0, 92e8), row("roofline", 16, 32768, 12.0),
            row("kernel", 8, 32768, 30.0, 46e8), row("roofline", 8, 32768, 6.0)]  # N·H = 64: not a target
    [entry] = bench.fixed_cost(rows)
    assert (entry["nodes"], entry["short_length"], entry["fixed_us"]) == (16, 1024, 16.0)
    assert entry["marginal_tflops"] == 600.0  # 9e9 FLOP in 15 us
    assert entry["bound_pct"] == 42.9  # 12 / (16 + 12)
    assert entry["launch_floor_us"] == 4.0
    assert bench.fixed_cost([r for r in rows if r["length"] == 32768]) == []  # no shorter call to read


# ----------------------------------------------------------------------------------------------
# CPU: host checks (metadata only)

def _cpu_args(dtype="bfloat16", nodes=5, l_max=40, batch=2):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    parents = np.array([[-1] + list(range(nodes - 1))] * batch, np.int32)
    tree = tree_from_parents(parents, np.zeros((batch, nodes), np.int32))
    return (torch.zeros(batch, nodes, 8, 512, dtype=dt), torch.zeros(batch, l_max, 576, dtype=dt), tree, nodes)


def test_kernel_rejects_float32():
    q, cache, tree, nodes = _cpu_args("float32")
    with pytest.raises(ValueError, match="q_latent: the cupy kernel takes bfloat16 or float16"):
        _check_kernel_args(q, cache, tree, nodes)


def test_kernel_rejects_a_cache_shorter_than_the_tree():
    q, cache, tree, nodes = _cpu_args(l_max=3)
    with pytest.raises(ValueError, match="cache: L_max=3"):
        _check_kernel_args(q, cache, tree, nodes)


def test_kernel_rejects_a_mask_of_the_wrong_shape():
    q, cache, tree, nodes = _cpu_args()
    tree.mask = tree.mask[:, :, :0]
    with pytest.raises(ValueError, match="tree.mask"):
        _check_kernel_args(q, cache, tree, nodes)


def test_kernel_rejects_outputs_of_the_wrong_shape():
    torch = pytest.importorskip("torch")
    q, cache, tree, nodes = _cpu_args()
    with pytest.raises(ValueError, match="out"):
        _check_kernel_args(q, cache, tree, nodes, out=torch.zeros(2, nodes, 8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lse"):
        _check_kernel_args(q, cache, tree, nodes, lse=torch.zeros(2, nodes, 8, dtype=torch.float16))
    assert _check_kernel_args(*_cpu_args("float16")) is True


def test_cupy_backend_refuses_host_inputs():
    torch = pytest.importorskip("torch")
    q, cache, tree, nodes = _cpu_args()
    rope = torch.zeros(2, nodes, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend"):
        verify_attention(q, rope, cache, np.array([1, 2], np.int32), tree, backend="cupy")


@pytest.mark.parametrize("probe, argument", [(ceilings.copy_bandwidth, "n_bytes"), (ceilings.matmul_rate, "size"),
                                             (ceilings.mma_sync_rate, "iters")])
def test_ceilings_refuse_a_size_that_is_not_a_positive_integer(probe, argument):
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=argument):
            probe(bad)


def test_the_error_check_rejects_known_wrong_answers():
    """gpu-mode style: ignoring the mask, or returning zeros, must fail the bounds the GPU tests use."""
    torch = pytest.importorskip("torch")
    inputs = bench.make_inputs(2, 9, 8, 40, seed=1, device="cpu")
    q_latent, q_rope, cache, lengths, tree = inputs
    ref_out, ref_lse = verify_attention(*inputs, backend="torch")
    bounds = bench.error_bounds(*inputs, ref_out, ref_lse)
    rel_bound, lse_limit = bounds["rel_err"], bounds["lse_err"]
    assert 0 < rel_bound < 0.1 and 0 < lse_limit < 0.1, (rel_bound, lse_limit)  # bounds that can fail
    tree.mask = torch.full_like(tree.mask, -1)  # attend to every tree slot
    wrong_out, wrong_lse = verify_attention(q_latent, q_rope, cache, lengths, tree, backend="torch")
    err = bench.errors(wrong_out, wrong_lse, ref_out, ref_lse)
    assert err["rel_err"] > rel_bound and err["lse_err"] > lse_limit
    assert bench.errors(torch.zeros_like(ref_out), ref_lse, ref_out, ref_lse)["rel_err"] > rel_bound


# ----------------------------------------------------------------------------------------------
# CPU: nvcc builds for both targets

def _ptxas_kernels(file_name, arch, tmp_path) -> dict:
    """{kernel: cuda.KernelResources} of an nvcc build; no kernel may spill."""
    report = cuda.ptxas_report(file_name, arch, tmp_path)
    for name, kernel in report.kernels.items():
        print(f"{arch} {name}: {kernel.registers} registers, {kernel.spill_stores}/{kernel.spill_loads} bytes spilled")
    for name, kernel in report.kernels.items():
        assert kernel.spilled_bytes == 0, f"{name} spills on {arch}"
        assert kernel.registers <= 255
    assert "wgmma.mma_async instructions are serialized" not in report.log
    return report.kernels


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", cuda.ARCHITECTURES)
def test_nvcc_builds_without_spills(arch, tmp_path):
    kernels = _ptxas_kernels(KERNEL_FILE, arch, tmp_path)
    assert {f"verify_attn_{name}" for name in PORTABLE_CONFIGS} <= set(kernels)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", cuda.ARCHITECTURES)
def test_nvcc_builds_the_benchmark_probes_without_spills(arch, tmp_path):
    assert set(_ptxas_kernels(ceilings.PROBES_FILE, arch, tmp_path)) == {"mma_sync_ceiling", "launch_floor", "launch_params"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_builds_the_wgmma_kernel_for_sm90a_only(tmp_path):
    kernels = _ptxas_kernels(KERNEL_FILE_SM90A, "sm_90a", tmp_path)
    wgmma_configs = [name for name, c in KERNEL_CONFIGS.items() if c.wgmma]
    assert {f"verify_attn_{name}_{dtype}" for name in wgmma_configs for dtype in ("bf16", "f16")} <= set(kernels)
    assert "verify_attn_merge_bf16" in kernels
    with pytest.raises(RuntimeError, match="needs sm_90a"):
        cuda.nvcc_compile(KERNEL_FILE_SM90A, "sm_90", tmp_path)


# ----------------------------------------------------------------------------------------------
# GPU: against the fp32 reference

SEED = int(os.environ.get("KDTREE_SEED", np.random.SeedSequence().entropy % 2**31))

# (batch, nodes, heads, lengths per request, live nodes per request or None)
CASES = [
    (1, 1, 8, [1000], None),                 # N = 1 (decode), one head group
    (2, 17, 8, [300, 1025], None),           # N odd, lengths differ, L not a multiple of the tile
    (3, 33, 16, [0, 63, 200], [33, 20, 1]),  # a request with no prefix, two mask words, padding nodes
    (1, 64, 8, [4097], None),                # 512 rows: 8 row blocks of the 64-row variant
    (2, 8, 64, [513, 2], None),              # many heads, a request with a 2-token prefix
    (1, 129, 8, [2000], [100]),              # 5 mask words, padding nodes
]


def _reference(q_latent, q_rope, cache, lengths, tree):
    torch = pytest.importorskip("torch")
    return verify_attention(q_latent, q_rope, torch.nan_to_num(cache), lengths, tree, backend="torch")


def assert_matches_reference(out, lse, inputs, ref_out, ref_lse, *, what: str = "") -> dict:
    """Every element written and finite, O and the LSE within bench.error_bounds; returns the errors."""
    err = bench.errors(out, lse, ref_out, ref_lse)
    bounds = bench.error_bounds(*inputs, ref_out, ref_lse)
    rel_bound, lse_limit = bounds["rel_err"], bounds["lse_err"]
    print(f"{what}: rel_err={err['rel_err']:.2e} (bound {rel_bound:.2e}) lse_err={err['lse_err']:.2e} "
          f"(bound {lse_limit:.2e})")
    assert err["finite"], f"{what}: NaN or inf in the output (poisoned output left unwritten, or cache leak)"
    assert err["rel_err"] <= rel_bound, (what, err, rel_bound)
    assert err["lse_err"] <= lse_limit, (what, err, lse_limit)
    return err


def _poisoned_launch(q_latent, q_rope, cache, lengths, tree, **kwargs):
    torch = pytest.importorskip("torch")
    out = torch.full(q_latent.shape, float("nan"), dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.full(q_latent.shape[:3], float("nan"), dtype=torch.float32, device=q_latent.device)
    launch = prepare_verify_launch(q_latent, q_rope, cache, lengths, tree, out=out, lse=lse, **kwargs)
    launch()
    return launch


def _skip_unless_runnable(config):
    if config is not None and config not in runnable_configs():
        pytest.skip(f"{config} does not run on this device")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, *KERNEL_CONFIGS])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case, config):
    _skip_unless_runnable(config)
    batch, nodes, heads, lengths, n_nodes = CASES[case]
    seed = SEED + case
    inputs = bench.make_inputs(batch, nodes, heads, 0, lengths=lengths, n_nodes=n_nodes, seed=seed, slack=37,
                               poison=True)
    ref_out, ref_lse = _reference(*inputs)
    for splits in (None, 1, 7):
        launch = _poisoned_launch(*inputs, config=config, splits=splits)
        assert_matches_reference(launch.out, launch.lse, inputs, ref_out, ref_lse,
                                 what=f"seed={seed} case={case} config={launch.plan.config_name} "
                                      f"splits={launch.plan.splits}")


@pytest.mark.gpu
def test_float16_cupy_in_cupy_out():
    import cupy
    torch = pytest.importorskip("torch")
    inputs = bench.make_inputs(2, 12, 8, 0, lengths=[700, 90], seed=SEED, dtype="float16")
    q_latent, q_rope, cache, lengths, tree = inputs
    ref_out, ref_lse = _reference(*inputs)
    bounds = bench.error_bounds(*inputs, ref_out, ref_lse)
    rel_bound, lse_limit = bounds["rel_err"], bounds["lse_err"]
    as_cupy = [cupy.asarray(x) for x in (q_latent, q_rope, cache, lengths)]
    tree.mask = cupy.asarray(tree.mask.view(torch.int32)).view(cupy.uint32)
    out, lse = verify_attention(*as_cupy, tree, backend="cupy")
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16 and lse.dtype == cupy.float32
    err = bench.errors(out, lse, ref_out, ref_lse)
    print(f"float16: {err}, bounds {rel_bound:.2e} {lse_limit:.2e}")
    assert err["finite"] and err["rel_err"] <= rel_bound and err["lse_err"] <= lse_limit


@pytest.mark.gpu
def test_float16_wgmma():
    _skip_unless_runnable(WGMMA)
    inputs = bench.make_inputs(2, 19, 8, 0, lengths=[700, 90], seed=SEED, dtype="float16", slack=11, poison=True)
    ref_out, ref_lse = _reference(*inputs)
    for splits in (1, 5):
        launch = _poisoned_launch(*inputs, config=WGMMA, splits=splits)
        assert_matches_reference(launch.out, launch.lse, inputs, ref_out, ref_lse, what=f"float16 {WGMMA} splits={splits}")


@pytest.mark.gpu
def test_torch_in_torch_out_on_the_current_stream():
    torch = pytest.importorskip("torch")
    inputs = bench.make_inputs(1, 5, 8, 77, seed=SEED)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(stream):
        out, lse = verify_attention(*inputs, backend="cupy")
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (1, 5, 8, 512)
    assert lse.dtype == torch.float32 and lse.shape == (1, 5, 8)
    ref_out, ref_lse = _reference(*inputs)
    assert_matches_reference(out, lse, inputs, ref_out, ref_lse, what="torch on a side stream")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, WGMMA])
def test_bad_device_lengths_are_clamped_not_out_of_bounds(config):
    """Device lengths are not checked on the host (no sync): the kernel clamps to [0, L_max - N]."""
    _skip_unless_runnable(config)
    torch = pytest.importorskip("torch")
    q_latent, q_rope, cache, _, tree = bench.make_inputs(3, 6, 8, 0, lengths=[50, 50, 50], seed=SEED)
    l_max = cache.shape[1]
    bad = torch.tensor([-5, 10 ** 6, 20], dtype=torch.int32, device="cuda")
    clamped = torch.tensor([0, l_max - 6, 20], dtype=torch.int64, device="cuda")
    launch = _poisoned_launch(q_latent, q_rope, cache, bad, tree, config=config)
    ref_out, ref_lse = _reference(q_latent, q_rope, cache, clamped, tree)
    assert_matches_reference(launch.out, launch.lse, (q_latent, q_rope, cache, clamped, tree), ref_out, ref_lse,
                             what=f"clamped lengths, {config}")


@pytest.mark.gpu
def test_launch_floor_is_a_few_microseconds():
    floor = ceilings.launch_floor_seconds()
    assert 0 < floor < 100e-6


@pytest.mark.gpu
def test_long_context_split_merge():
    """32k keys through many splits (merge by LSE) and through one (a single CTA per row block)."""
    inputs = bench.make_inputs(1, 16, 8, 32768 + 5, seed=SEED)
    ref_out, ref_lse = _reference(*inputs)
    for config in (None, *[name for name in (WGMMA,) if name in runnable_configs()]):
        for splits in (None, 1):
            launch = _poisoned_launch(*inputs, config=config, splits=splits)
            assert_matches_reference(launch.out, launch.lse, inputs, ref_out, ref_lse,
                                     what=f"32k {launch.plan.config_name} splits={launch.plan.splits}")


@pytest.mark.gpu
def test_gpu_rejects_float32():
    inputs = bench.make_inputs(1, 3, 8, 20, seed=SEED, dtype="float32")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        verify_attention(*inputs, backend="cupy")
