"""The stand-in pairs' shapes, and how their drafter/target step-time ratio compares with the real pair's.

Two shapes (issue 33):

    k26-mini   the committed pair: a 6-layer target (hidden 256, 16 experts top-4, bf16 experts) and a
               5-layer drafter with plain RoPE. Its drafter costs about one target step on the H200.
    k26-deep   K2.6's proportions: 16 layers (the first dense, then MoE: 32 routed experts of width
               64, top-8, one shared expert, K2.6's routing and YaRN from K2.6's own text_config), INT4
               routed experts in K2.6's checkpoint format; a 2-layer DFlash drafter with the real
               drafter's config keys (YaRN, target_layer_ids spread over the depth).

Proportions kept from K2.6 (61 layers, hidden 7168): expert width / hidden 2048/7168 = 0.29 (64/256 =
0.25), dense and drafter MLP / hidden 18432/7168 = 2.57 (640/256 = 2.5), query rank / hidden 0.21
(64/256 = 0.25), top-8 routed plus one shared expert, drafter layers / target layers 6/61 = 0.10
(2/16 = 0.125), six feature layers as the real drafter reads. The MLA latent stays 512 + 64 (the verify
kernels' contract) with K2.6's 128/64/128 per head, so the softmax scale is K2.6's; two heads keep the
latent's up-projection (kv_b) inside the size budget. Narrower than k26-mini in every width but the
hidden size: the INT4 MoE kernel's down projection takes a hidden size that is a multiple of 128 at
expert widths up to 512 (moe.plan_moe), so hidden is 128 or 256, and at 128 the drafter (as wide as
the target's hidden size) would be a quarter of k26-mini's per layer.

The step-time ratio (`standin_ratio`) is modelled, not measured: at these widths a batch-1 step in a
CUDA graph is bound by its kernels' latency, not by its bytes (the committed target's 37 MB read in
about 9 us at the H200's copy bandwidth; its AR step takes 1.2 ms). So the model is

    step seconds = layers x (seconds per layer) + bytes read / copy bandwidth

with one seconds-per-layer for the target and one for the drafter, fitted on the committed H200 decode
rows of the k26-mini pair (CUDA graph, batch 1): the target's from its AR step (6 layers), the drafter's
from the chain round minus the AR step (5 layers; the round's extra top-k, chain build and 8-node
verify are charged to the drafter's layers, and each model's fixed parts (embedding, head) to its
layers). The real pair's ratio (`real_pair_ratios`) is the CT200 projection's, computed as notebook 13
computes it (its parameters, the committed rows): the drafter's forward over the target's step at
batch 1, for the AR step and for DDTree's verify steps.

    python -m kdtree_lib.standin      # sizes, both ratios, the training-time estimate
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, replace

from . import cli
from .paths import BF16_BYTES, MODELS_DIR, REPO_ROOT

CURRENT = "k26-mini"   # the committed pair (pairs.DEFAULT_PAIR)
DEEP = "k26-deep"      # the pair with K2.6's proportions (train's default)
CHECKPOINT_BUDGET_BYTES = 48e6
SHARD_BYTES = 16_000_000

# the committed pair's shape: transformers' DeepseekV3Config keys at ~19M parameters (hidden 256, 4
# heads of K2.6's per-head dims, 16 experts top-4 and one shared, YaRN) and its 5-layer drafter
# (plain RoPE; hidden size and vocabulary are the target's; features from target layers 1-4)
K26_MINI = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True,
    rms_norm_eps=1e-5, max_position_embeddings=262144, num_nextn_predict_layers=0, tie_word_embeddings=False,
    rope_interleave=True, attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0})
DRAFTER = dict(intermediate_size=768, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, feature_layers=4, rope_theta=50000.0, rms_norm_eps=1e-6)

# k26-deep: the dims over K2.6's text_config (every other key, routing and rope_scaling included, is
# K2.6's own) and over the real drafter's config.json
DEEP_TARGET = dict(vocab_size=8192, hidden_size=256, intermediate_size=640, moe_intermediate_size=64,
                   num_hidden_layers=16, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=32, num_experts_per_tok=8)
DEEP_DRAFTER = dict(intermediate_size=640, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64)
DEEP_FEATURE_LAYERS = 6   # as many target layers as the real drafter reads (1, 12, 24, 35, 47, 58 of 61)
# a smoke run's shapes (k26-deep's structure: dense first layer, widths the INT4 kernel plans, YaRN, two features)
TINY_TARGET = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, qk_nope_head_dim=32,
                   v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2)
TINY_DRAFTER = dict(intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16)
TINY_FEATURE_LAYERS = 2


@dataclass(frozen=True)
class PairShape:
    """A trainable pair's shape in the real formats: the target's text_config and the drafter's
    config.json, both from K2.6's files with these dims (vocabulary and special ids the tokenizer's)."""
    name: str
    target_dims: dict
    drafter_dims: dict
    feature_layers: int

    def text_config(self, vocab_size: int, eot: int) -> dict:
        """K2.6's text_config, every key kept (routing, YaRN's rope_scaling), at these dims; bos and eos
        the tokenizer's end-of-text id (the stand-in tokenizer has no other special tokens)."""
        from .model.reference import kimi_text_config
        text = kimi_text_config(**(self.target_dims | {"vocab_size": vocab_size}))
        return text | {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}

    def drafter_config(self, text_config: dict, block_size: int, mask_id: int) -> dict:
        """The real drafter's config.json (every key) for this target: these dims, YaRN, block size,
        the mask id, target_layer_ids spread from layer 1 to the second-to-last."""
        from .dflash import build_target_layer_ids
        from .pair_reference import kimi_dflash_config
        layers = build_target_layer_ids(text_config["num_hidden_layers"], self.feature_layers)
        raw = kimi_dflash_config(text_config, layers, **self.drafter_dims)
        raw["dflash_config"]["mask_token_id"] = mask_id
        return raw | {"block_size": block_size}


SHAPES = {DEEP: PairShape(DEEP, DEEP_TARGET, DEEP_DRAFTER, DEEP_FEATURE_LAYERS)}
TINY_SHAPE = PairShape(DEEP, TINY_TARGET, TINY_DRAFTER, TINY_FEATURE_LAYERS)


def shape_of(name: str, *, tiny: bool = False) -> PairShape:
    if name not in SHAPES:
        raise ValueError(f"pair: expected one of {sorted(SHAPES)} to train, got {name!r}")
    return replace(TINY_SHAPE, name=name) if tiny else SHAPES[name]


# ----------------------------------------------------------------------------------------------
# configs as the loaders read them, and their bytes

@dataclass(frozen=True)
class PairConfigs:
    """A pair's configs as the loaders read them (ModelConfig, DFlashConfig)."""
    target: object
    drafter: object


def pair_configs(shape: PairShape, vocab_size: int = 8192, eot: int = 0, block_size: int = 8) -> PairConfigs:
    """The configs `shape` writes (INT4 routed experts), through the loaders' own parsers."""
    from .dflash import DFlashConfig
    from .model import ModelConfig
    from .model.checkpoint import INT4_QUANTIZATION_CONFIG
    text = shape.text_config(vocab_size, eot)
    return PairConfigs(ModelConfig.from_dict(text | {"quantization_config": INT4_QUANTIZATION_CONFIG}),
                       DFlashConfig.from_dict(shape.drafter_config(text, block_size, vocab_size - 1)))


def current_configs() -> PairConfigs:
    """The committed k26-mini pair's configs (bf16 experts, a plain-RoPE block-8 drafter)."""
    from .dflash import DFlashConfig, build_target_layer_ids
    from .model import ModelConfig
    target = ModelConfig.from_dict(K26_MINI)
    dims = dict(DRAFTER)
    layers = build_target_layer_ids(target.num_hidden_layers, dims.pop("feature_layers"))
    return PairConfigs(target, DFlashConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, block_size=8,
                                            mask_token_id=target.vocab_size - 1, target_layer_ids=layers,
                                            num_target_layers=target.num_hidden_layers, **dims))


def target_bytes(config) -> float:
    """Bytes of the target's checkpoint as stored (bf16; INT4 routed experts where quantized)."""
    from .model.costs import parameter_table
    return float(sum(row["bytes"] for row in parameter_table(config)))


def target_step_bytes(config) -> float:
    """Bytes one batch-1 AR step reads: every weight but the embedding (one row) and the routed
    experts the token is not sent to."""
    from .model.costs import parameter_table
    rows = {row["component"]: row for row in parameter_table(config)}
    routed = rows["routed experts"]["bytes"] * config.num_experts_per_tok / config.n_routed_experts
    return target_bytes(config) - rows["embed_tokens"]["bytes"] - rows["routed experts"]["bytes"] + routed


def drafter_parameters(config) -> int:
    import torch
    from .dflash import DFlashDrafter
    with torch.device("meta"):
        return sum(p.numel() for p in DFlashDrafter(config).parameters())


def drafter_bytes(config) -> float:
    """Bytes of the drafter's checkpoint (bf16; it has no embedding or LM head of its own)."""
    return float(drafter_parameters(config) * BF16_BYTES)


def drafter_step_bytes(config) -> float:
    """Bytes one drafter forward reads: its weights and the target's LM head it applies."""
    return drafter_bytes(config) + config.vocab_size * config.hidden_size * BF16_BYTES


# ----------------------------------------------------------------------------------------------
# the stand-in's ratio on the H200: layers x seconds per layer + bytes / bandwidth

@dataclass(frozen=True)
class LayerTimes:
    """Batch-1 CUDA-graph step times of a small pair on one GPU (module docstring)."""
    target_layer: float      # s per target layer
    drafter_layer: float     # s per drafter layer
    bandwidth: float         # bytes/s, the GPU's measured copy bandwidth
    source: str

    def target_seconds(self, config) -> float:
        return config.num_hidden_layers * self.target_layer + target_step_bytes(config) / self.bandwidth

    def drafter_seconds(self, config) -> float:
        return config.num_hidden_layers * self.drafter_layer + drafter_step_bytes(config) / self.bandwidth

    def ratio(self, configs: PairConfigs) -> float:
        return self.drafter_seconds(configs.drafter) / self.target_seconds(configs.target)


def step_seconds(row: dict) -> float:
    """A decode row's graph step (graph_step_ms where the row has it, else its ms per round)."""
    from .results import as_float
    cell = row.get("graph_step_ms")
    return (as_float(cell) if cell not in (None, "") else as_float(row["ms_per_round"])) * 1e-3


def fit_layer_times(decode_rows: list[dict], bandwidth: float, configs: PairConfigs, pair: str) -> LayerTimes:
    """LayerTimes from the newest batch-1 CUDA-graph AR and chain rows of `pair` (its configs
    `configs`): the target's per-layer seconds from the AR step, the drafter's from the chain round
    minus the AR step, each after its bytes at `bandwidth`."""
    from . import results
    picked = {}
    for method in ("ar", "chain"):
        rows = results.select(decode_rows, impl="kdtree", method=method, batch=1, cuda_graph=True, pair=pair)
        if not rows:
            raise ValueError(f"decode_rows: no batch-1 CUDA-graph {method} row of pair {pair} (bench.decode on a GPU)")
        picked[method] = max(rows, key=lambda r: r["date"])
    ar, chain = step_seconds(picked["ar"]), step_seconds(picked["chain"])
    target = (ar - target_step_bytes(configs.target) / bandwidth) / configs.target.num_hidden_layers
    drafter = (chain - ar - drafter_step_bytes(configs.drafter) / bandwidth) / configs.drafter.num_hidden_layers
    if target <= 0 or drafter <= 0:
        raise ValueError(f"decode_rows: AR {ar * 1e3:.3f} ms and chain {chain * 1e3:.3f} ms leave no per-layer time")
    stamps = {m: f"{r['device']} {r['date'][:10]} {r['commit']}" for m, r in picked.items()}
    return LayerTimes(target, drafter, bandwidth,
                      f"{pair}: AR step {ar * 1e3:.3f} ms ({stamps['ar']}), chain round {chain * 1e3:.3f} ms "
                      f"({stamps['chain']}), copy {bandwidth / 1e12:.2f} TB/s")


def committed_layer_times() -> LayerTimes:
    """fit_layer_times on the committed rows: data/results/decode.csv (k26-mini on the H200) and the
    H200's copy bandwidth from data/results/tp_verify_step.csv."""
    from . import projection
    from .bench import tp_step
    from .pairs import pair_name, stand_in_paths
    from .results import read_rows
    with_bandwidth = [r for r in read_rows(tp_step.TOPIC) if r.get("copy_bandwidth") not in (None, "")]
    if not with_bandwidth:
        raise ValueError("data/results/tp_verify_step.csv: no copy_bandwidth rows (bench.tp_step on a GPU)")
    hardware = projection.measured_hardware(with_bandwidth, tp=1)
    return fit_layer_times(read_rows("decode"), hardware.memory_bandwidth, current_configs(),
                           pair_name(*stand_in_paths(8, pair=CURRENT)))


def standin_ratio(configs: PairConfigs, times: LayerTimes | None = None) -> float:
    """The drafter/target step-time ratio of a stand-in pair at batch 1 on the H200 (CUDA graph),
    by the layer-time model (module docstring) fitted on the committed rows unless `times` is given."""
    return (times or committed_layer_times()).ratio(configs)


# ----------------------------------------------------------------------------------------------
# the real pair's ratio, as the CT200 projection computes it

PROJECTION_NOTEBOOK = "13_ct200_projection.ipynb"
RATIO_NODES = {"AR step": 1, "budget 8": 9, "budget 32": 33}


def real_pair_ratios(nodes: dict[str, int] = RATIO_NODES, *, context: int | None = None) -> dict[str, float]:
    """The real pair's drafter forward over the target's step at batch 1 on the box, as notebook 13
    computes both (its parameters: placement, efficiencies' fallbacks, expert bits, the first context,
    the assumed routing correlation; the committed H200 rows its fits read), per verify-step size."""
    from . import projection
    from .bench import tp_step
    from .model import load_config
    from .notebooks import NOTEBOOKS_DIR, declared_parameters
    from .results import read_rows
    p = {name: ast.literal_eval(spec["default"])
         for name, spec in declared_parameters(NOTEBOOKS_DIR / PROJECTION_NOTEBOOK).items()}
    config = load_config(REPO_ROOT / p["config_path"])
    box = replace(projection.CT200, allreduce_latency=p["allreduce_latency"],
                  allreduce_bus_bandwidth=p["allreduce_bus_bandwidth"])
    context = context or p["contexts"][0]
    rows = projection.latest_rows(read_rows(tp_step.TOPIC))
    tp = p["calibration_tp"] or None
    if not projection.select_rows(rows, "layer", tp=tp, graph=p["calibrate_on_graph"]):
        raise ValueError("data/results/tp_verify_step.csv: no H200 layer rows to calibrate the projection on")
    efficiency, h200, _ = projection.calibrate_on_rows(rows, config, tp=tp, graph=p["calibrate_on_graph"])
    verify = projection.verify_kernel_inputs(read_rows("verify_attn"), heads=config.num_attention_heads // box.gpus,
                                             assumed_time=projection.KernelTime(*p["assumed_verify_time"]))
    experts = projection.moe_kernel_inputs(read_rows("moe_int4"), tp=box.gpus,
                                           assumed_time=projection.KernelTime(*p["assumed_moe_time"]))
    efficiency = projection.box_efficiency(efficiency, verify.time, experts.time)
    draft_rows = projection.select_rows(rows, "draft", tp=tp)
    drafter_efficiency = (projection.drafter_efficiency(draft_rows, tp_step.drafter_config(config), h200)
                          if any(r.get("drafter_seconds") not in (None, "") for r in draft_rows)
                          else p["assumed_drafter_efficiency"])
    drafter = projection.drafter_costs(projection.real_drafter_config(config), box, efficiency=drafter_efficiency)
    seconds = drafter[p["drafter_placement"]](1, context)
    return {name: seconds / projection.step_costs(config, box, batch=1, nodes=n, context=context, efficiency=efficiency,
                                                  expert_bits=p["expert_bits"],
                                                  correlation=p["assumed_correlation"])["total"]
            for name, n in nodes.items()}


# ----------------------------------------------------------------------------------------------
# training time: the committed pair's H200 run scaled by FLOPs per token

def train_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token of the target: 6 x the parameters a token touches (the embedding's
    lookup aside) + the causal attention's 6 x layers x heads x (qk + v dims) x seq_len / 2."""
    from .model.costs import active_parameters
    c = config
    dense = active_parameters(c) - c.vocab_size * c.hidden_size
    attention = c.num_hidden_layers * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * seq_len / 2
    return 6 * dense + 6 * attention


def drafter_flops_per_token(configs: PairConfigs, seq_len: int, anchor_tokens: int) -> float:
    """FLOPs per context token of a drafter step: the frozen target's forward (a third of its
    training FLOPs) and the drafter's forward and backward over anchor_tokens block positions per
    seq_len context (its layers, the LM head on them, and each block's attention to the context)."""
    d = configs.drafter
    blocks = anchor_tokens / seq_len
    layers = drafter_parameters(d) - d.feature_size * d.hidden_size
    attention = d.num_hidden_layers * d.num_attention_heads * d.head_dim * 2 * seq_len / 2
    return (train_flops_per_token(configs.target, seq_len) / 3 + 6 * d.feature_size * d.hidden_size
            + 6 * blocks * (layers + d.vocab_size * d.hidden_size + attention))


def training_estimate(configs: PairConfigs, *, seq_len: int = 512, anchor_tokens: int = 512,
                      models_dir=MODELS_DIR) -> dict:
    """Seconds per step of each stage, scaled from the committed pair's H200 run (its eval.json:
    steps and seconds at the same batch) by FLOPs per token."""
    import json
    from .pairs import stand_in_paths
    target_dir, drafter_dir = stand_in_paths(8, models_dir, pair=CURRENT)
    runs = {name: json.loads((folder / "eval.json").read_text()) for name, folder in
            (("target", target_dir), ("drafter", drafter_dir))}
    old = current_configs()
    scale = {"target": train_flops_per_token(configs.target, seq_len) / train_flops_per_token(old.target, seq_len),
             "drafter": (drafter_flops_per_token(configs, seq_len, anchor_tokens)
                         / drafter_flops_per_token(old, seq_len, anchor_tokens))}
    return {stage: {"old_seconds_per_step": run["seconds"] / run["steps"], "flops_scale": scale[stage],
                    "seconds_per_step": run["seconds"] / run["steps"] * scale[stage], "device": run["device"]}
            for stage, run in runs.items()}


@cli.command
def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.standin", description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=DEEP, choices=sorted(SHAPES))
    args = parser.parse_args(argv)
    configs = pair_configs(shape_of(args.pair))
    t, d = configs.target, configs.drafter
    sizes = {"target": target_bytes(t), "drafter": drafter_bytes(d)}
    print(f"{args.pair}: target {t.num_hidden_layers} layers, hidden {t.hidden_size}, {t.num_attention_heads} heads, "
          f"{t.n_routed_experts} experts x {t.moe_intermediate_size} top-{t.num_experts_per_tok} + "
          f"{t.n_shared_experts} shared (INT4 routed); drafter {d.num_hidden_layers} layers, block {d.block_size}, "
          f"features from target layers {list(d.target_layer_ids)}")
    print(f"checkpoint bytes: target {sizes['target'] / 1e6:.1f} MB, drafter {sizes['drafter'] / 1e6:.1f} MB, "
          f"together {sum(sizes.values()) / 1e6:.1f} MB (budget {CHECKPOINT_BUDGET_BYTES / 1e6:.0f} MB)")
    times = committed_layer_times()
    print(f"H200 layer times fitted on {times.source}: target {times.target_layer * 1e6:.0f} us/layer, "
          f"drafter {times.drafter_layer * 1e6:.0f} us/layer")
    old = current_configs()
    print(f"H200 batch-1 graph model: {CURRENT} drafter {times.drafter_seconds(old.drafter) * 1e3:.3f} ms / target "
          f"{times.target_seconds(old.target) * 1e3:.3f} ms = {times.ratio(old):.3f}; {args.pair} drafter "
          f"{times.drafter_seconds(d) * 1e3:.3f} ms / target {times.target_seconds(t) * 1e3:.3f} ms = "
          f"{times.ratio(configs):.3f}")
    real = real_pair_ratios()
    print("real pair on the box (CT200 projection, notebook 13's parameters and rows), drafter / target step at "
          "batch 1: " + ", ".join(f"{name} {ratio:.3f}" for name, ratio in real.items()))
    for stage, e in training_estimate(configs).items():
        print(f"training {stage}: {e['old_seconds_per_step'] * 1e3:.0f} ms/step for {CURRENT} on {e['device']} x "
              f"{e['flops_scale']:.2f} FLOPs = about {e['seconds_per_step'] * 1e3:.0f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
