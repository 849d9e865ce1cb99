"""memory.plan: K2.6's bytes per GPU against a count written out from its config, the
refusals (batch 8 at 32k on the box, too little free memory) and bad arguments."""
import json

import pytest

from kdtree_lib.dflash import DFlashConfig
from kdtree_lib.model import ModelConfig, load_config
from kdtree_lib.memory import BOX_GPU_BYTES, GIB, MemoryPlanError, plan
from kdtree_lib.pairs import tiny_config
from kdtree_lib.paths import REPO_ROOT

CONFIGS = REPO_ROOT / "data" / "configs"


@pytest.fixture(scope="module")
def k26():
    return load_config(CONFIGS / "kimi-k2.6.json")


@pytest.fixture(scope="module")
def k26_drafter():
    return DFlashConfig.from_dict(json.loads((CONFIGS / "kimi-k2.6-dflash.json").read_text()))


def test_k26_at_tp8_int4_weights_are_about_72_gib(k26, k26_drafter):
    result = plan(k26, 8, 1, 4096, 32, k26_drafter, drafter_placement="replicated")
    c, tp = k26, 8
    hidden, layers, moe_layers = c.hidden_size, c.num_hidden_layers, c.num_hidden_layers - c.first_k_dense_replace
    # written out from the config: routed experts at 4.5 bits (int4 + a bf16 scale per 32)
    experts = moe_layers * c.n_routed_experts * 3 * hidden * c.moe_intermediate_size * 4.5 / 8 / tp
    attention_split = c.q_lora_rank * c.num_attention_heads * 192 + c.kv_lora_rank * c.num_attention_heads * 256 \
        + c.num_attention_heads * 128 * hidden
    attention_whole = hidden * c.q_lora_rank + hidden * 576 + c.q_lora_rank + c.kv_lora_rank + 2 * hidden
    mlps = 3 * hidden * (c.intermediate_size + moe_layers * c.moe_intermediate_size)
    bf16 = 2 * (layers * (attention_split / tp + attention_whole) + mlps / tp + 2 * c.vocab_size * hidden / tp
                + moe_layers * c.n_routed_experts * hidden + hidden)
    print(result.table())
    assert result.items["weights int4"] == pytest.approx(experts, rel=1e-9)
    assert result.items["weights bf16"] == pytest.approx(bf16, rel=1e-9)
    assert 71.0 < result.weights / GIB < 72.0 and 76.3e9 < result.weights < 77.3e9  # fp32 routers: 0.62 GiB
    assert 6.4 < result.items["drafter"] / GIB < 6.6   # the real drafter, replicated, bf16
    assert result.fits and result.check() is result
    sharded = plan(k26, 8, 1, 4096, 32, k26_drafter)    # the default: its layers 1/8 per GPU, fc whole
    assert 1.2 < sharded.items["drafter"] / GIB < 1.4


def test_batch_8_at_32k_does_not_fit_on_the_box(k26, k26_drafter):
    """With the replicated MLA cache and a replicated drafter (DESIGN.md §7); the sharded drafter fits."""
    result = plan(k26, 8, 8, 32768, 32, k26_drafter, drafter_placement="replicated")
    assert 17.0 < result.items["MLA cache"] / GIB < 17.4   # 61 layers x 576 bf16, replicated
    assert not result.fits and result.gpu_bytes == BOX_GPU_BYTES
    with pytest.raises(MemoryPlanError, match="batch/context/tp") as error:
        result.check()
    assert "DOES NOT FIT" in str(error.value) and "MLA cache" in str(error.value)
    fixes = "\n".join(result.advice)
    assert "TP-sharded drafter" in fixes and "batch 5 at context 32768" in fixes
    smaller = plan(k26, 8, 5, 32768, 32, k26_drafter, drafter_placement="replicated")
    assert smaller.fits and not plan(k26, 8, 6, 32768, 32, k26_drafter, drafter_placement="replicated").fits
    assert plan(k26, 8, 8, 32768, 32, k26_drafter).fits


def test_with_the_service_running_nothing_fits(k26, k26_drafter):
    result = plan(k26, 8, 1, 4096, 8, k26_drafter, gpu_bytes=10 * 10 ** 9)
    assert not result.fits and "stop what else runs" in result.advice[0]


def test_bf16_experts_and_tp_degree(k26):
    bf16 = ModelConfig.from_dict({**json.loads((CONFIGS / "kimi-k2.6.json").read_text())["text_config"],
                                  "quantization_config": None})
    assert plan(bf16, 8, 1, 1024, 8).weights > 3.3 * plan(k26, 8, 1, 1024, 8).weights
    one, two = (plan(ModelConfig.from_dict(tiny_config()), tp, 2, 100, 8) for tp in (1, 2))
    assert two.items["weights bf16"] < one.items["weights bf16"] and two.items["MLA cache"] == one.items["MLA cache"]


@pytest.mark.parametrize("bad, match", [(dict(tp=0), "tp"), (dict(batch=0), "batch"), (dict(context=-1), "context"),
                                        (dict(budget=0), "budget"), (dict(drafter_placement="pipelined"),
                                                                     "drafter_placement")])
def test_bad_arguments(bad, match):
    args = dict(tp=1, batch=1, context=16, budget=4) | bad
    placement = {"drafter_placement": args.pop("drafter_placement")} if "drafter_placement" in args else {}
    with pytest.raises(ValueError, match=match):
        plan(ModelConfig.from_dict(tiny_config()), **args, **placement)


def test_the_routers_fp32_copies_are_planned():
    """model.Router keeps an fp32 copy of its weight beside the bf16 one (its scores are fp32): K2.6's 60
    routers at 384 x 7168 are 0.62 GiB on every rank, with the correction biases."""
    from kdtree_lib.memory import target_weight_bytes
    from kdtree_lib.model.config import load_config
    from kdtree_lib.paths import K26_CONFIG
    config = load_config(K26_CONFIG)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    for tp in (1, 8):
        assert target_weight_bytes(config, tp)["weights fp32"] == \
            moe_layers * config.n_routed_experts * (config.hidden_size + 1) * 4
