"""A real-shape pair made directly on the device (bench.inputs.real_shape_pair): no checkpoint on disk, INT4
experts in the kernel layout, the real drafter's shapes. On the CPU at small shapes: its INT4 weights are the
slices of one full tensor whatever the TP degree, their scale gives std 1/sqrt(fan-in), and the pair decodes
losslessly through generate (DDTree and the chain equal AR). On a GPU (-m gpu): K2.6's layer shapes decode, a
CUDA graph equal to eager, stage times per budget after that budget's warm-up, peak memory within the plan."""
import dataclasses
import os

import numpy as np
import pytest
import torch

from kdtree_lib.bench import tp_step
from kdtree_lib.bench.inputs import INT4_CODE_STD, RandomWeights, real_shape_pair, real_shape_pair_with_prompts
from kdtree_lib.decode import generate
from kdtree_lib.model import ModelConfig
from kdtree_lib.model.checkpoint import dequantize_int4
from kdtree_lib.pairs import tiny_config
from tolerances import logit_bound


def test_int4_weights_are_slices_of_one_tensor_with_the_fan_in_std():
    weights = RandomWeights("cpu", torch.float32, seed=1, group_size=32)
    packed, scale = weights.read_int4("model.layers.1.mlp.experts.3.down_proj.weight", (64, 256))
    rows = weights.read_int4("model.layers.1.mlp.experts.3.down_proj.weight", (64, 256), 0, 32, 64)
    columns = weights.read_int4("model.layers.1.mlp.experts.3.down_proj.weight", (64, 256), 1, 128, 256)
    assert torch.equal(rows[0], packed[32:]) and torch.equal(rows[1], scale[32:])
    assert torch.equal(columns[0], packed[:, 16:]) and torch.equal(columns[1], scale[:, 4:])
    values = dequantize_int4(packed, scale, 32)
    # 16,384 draws of a uniform code: the sample std is within a few percent of the target (std error ~0.6%)
    assert float(values.std()) == pytest.approx(256 ** -0.5, rel=0.05)
    assert INT4_CODE_STD == pytest.approx(np.arange(16).std())
    with pytest.raises(ValueError, match="align"):
        weights.read_int4("w", (64, 256), 1, 16, 64)
    with pytest.raises(ValueError, match="group"):
        weights.read_int4("w", (64, 100))


def test_a_small_real_shape_pair_decodes_losslessly_on_the_cpu():
    config = ModelConfig.from_dict(tiny_config())
    deeper = dataclasses.replace(config, num_hidden_layers=8)  # feature layers up to 6: clamped to the 3 made
    drafter_config = tp_step.drafter_config(deeper, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=32,
                                            block_size=4, feature_layers=3)
    assert max(drafter_config.target_layer_ids) > 2
    target, drafter = real_shape_pair(3, device="cpu", dtype=torch.float32, config=config, drafter_config=drafter_config)
    assert target.config.num_hidden_layers == 3
    assert all(getattr(block.mlp, "experts", None) is None or block.mlp.experts.int4 for block in target.layers)
    assert any(getattr(block.mlp, "experts", None) is not None for block in target.layers)
    assert max(drafter.config.target_layer_ids) <= 2
    prompts = [np.random.default_rng(b).integers(0, config.vocab_size, 12) for b in range(2)]
    with torch.no_grad():
        ar = generate(target, drafter, prompts, method="ar", max_new_tokens=10)
        tree = generate(target, drafter, prompts, method="ddtree", budget=8, max_new_tokens=10)
        chain = generate(target, drafter, prompts, method="chain", max_new_tokens=10)
    expected = [t.tolist() for t in ar.tokens]
    assert [t.tolist() for t in tree.tokens] == expected and [t.tolist() for t in chain.tokens] == expected
    with pytest.raises(ValueError, match="layers"):
        real_shape_pair(0, device="cpu", config=config, drafter_config=drafter_config)
    chosen = real_shape_pair_with_prompts(3, prompts_per_package=2, prompt_tokens=12, device="cpu", dtype=torch.float32,
                                          config=config, drafter_config=drafter_config)
    assert chosen.name == "real-shapes-3L:kimi-k2.6+kimi-k2.6-dflash" and not chosen.stand_in
    assert list(chosen.packages) == ["random"] and len(chosen.prompts) == 4
    assert all(len(p) == 12 and 0 <= p.min() and p.max() < config.vocab_size for p in chosen.prompts)
    assert "acceptance means nothing" in chosen.description


def test_the_tp_step_bench_times_int4_experts_as_the_box_holds_them():
    config = ModelConfig.from_dict(tiny_config())
    drafter = tp_step.drafter_config(config, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=32, block_size=4,
                                     feature_layers=1)
    settings = tp_step.BenchSettings(config=config, layers=3, batches=(1,), nodes=(1, 4), contexts=(8,), device="cpu",
                                     dtype="float32", graphs=False, repeats=1, warmup=0, drafter=drafter, topic=None,
                                     int4_experts=True, check=True)
    run = tp_step.run_tp_bench(settings, world_size=1)
    layers = [r for r in run["rows"] if r["scope"] == "layer"]
    assert layers and {r["expert_bits"] for r in run["rows"] if r["scope"] != "draft"} == {4.5}
    assert all(float(r["moe_seconds"]) > 0 for r in layers)
    # the segmented step is still the model's verify, INT4 experts included (float32 sums in two orders)
    torch.testing.assert_close(run["check"]["segmented"], run["check"]["verify"], rtol=0,
                               atol=logit_bound(config, run["check"]["verify"]))


@pytest.mark.gpu
def test_real_shapes_decode_on_one_gpu(tmp_path):
    """K2.6 at its layer shapes (KDTREE_REAL_LAYERS layers, default 3: one dense, then MoE with INT4
    experts resident) and the real drafter's shapes, random weights made directly on the GPU
    (bench.inputs.real_shape_pair: no checkpoint written, so a host with little free disk runs it):
    DDTree as a CUDA graph equals eager; step time by stage vs budget and peak memory vs the plan, as
    rows (tmp_path, or data/results/real_shape_decode.csv with KDTREE_APPEND_RESULTS=1). Each budget is
    decoded once untimed before its stage split is taken: its kernels' first-call compilation (NVRTC, per
    shape) would otherwise land in the first budget's stage times."""
    from kdtree_lib import results
    from kdtree_lib.memory import GIB, plan
    layers = int(os.environ.get("KDTREE_REAL_LAYERS", "3"))
    torch.cuda.reset_peak_memory_stats()
    target, drafter = real_shape_pair(layers, device="cuda", dtype=torch.bfloat16)
    prompts = [np.random.default_rng(b).integers(0, 163584, 512) for b in range(2)]
    budgets, new_tokens = (8, 32, 128), 32
    memory = plan(target.config, 1, len(prompts), 512 + new_tokens, max(budgets), drafter.config)
    rows = []
    for budget in budgets:
        def decode(**options):
            return generate(target, drafter, prompts, budget=budget, max_new_tokens=new_tokens, **options)
        decode(cuda_graph=False)  # the warm-up: this budget's shapes compiled and its decoder made, untimed
        eager = decode(cuda_graph=False, profile_stages=True)
        graph = decode(cuda_graph=True)
        assert [t.tolist() for t in graph.tokens] == [t.tolist() for t in eager.tokens]
        rows.append({"layers": layers, "budget": budget, "batch": len(prompts), "prompt_tokens": 512, "warmed_up": True,
                     "graph_step_ms": 1e3 * graph.decode_seconds / graph.rounds,
                     **{f"{stage}_ms": 1e3 * seconds / eager.rounds for stage, seconds in eager.stage_seconds.items()}})
    peak = torch.cuda.max_memory_allocated()
    for row in rows:
        row.update(peak_gib=peak / GIB, plan_gib=memory.total / GIB)
    append = os.environ.get("KDTREE_APPEND_RESULTS") == "1"
    print(results.append_rows("real_shape_decode", rows, results_dir=None if append else tmp_path))
    for row in rows:
        print(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    print(memory.table(), f"\nmeasured peak {peak / GIB:.2f} GiB")
    assert peak <= memory.total


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a host without a GPU gets")
def test_notebook_10_refuses_real_shapes_without_a_gpu(tmp_path):
    """real_shapes_layers asks for the real-shape pair, made on a GPU: without one the notebook stops at once,
    naming the parameter (its headless default, 0, keeps the CPU-sized pair: tests/test_notebooks.py)."""
    from kdtree_lib.notebooks import discover, run_notebook
    run = run_notebook(discover(only=["10"])[0], tmp_path, {"real_shapes_layers": 2}, cell_timeout=1800)
    assert not run.ok and "real_shapes_layers: 2 asks for the real-shape pair" in str(run.error)
