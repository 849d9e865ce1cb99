"""The target's architecture, read from a Hugging Face `config.json`.

Accepts a plain DeepseekV3 config (what transformers writes) or a Kimi K2.5/K2.6 wrapper, whose
language model sits under `text_config`. Every key must be one this module knows: a key it does
not know is an error, never silently ignored, because an ignored architecture switch would give
a model that loads and runs but computes something else.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from ..checks import read_json_object

# keys that describe the file or training, not the forward pass
METADATA_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "_name_or_path", "initializer_range", "use_cache", "pretraining_tp", "aux_loss_alpha",
    "seq_aux", "ep_size", "attention_dropout", "head_dim", "qk_head_dim", "output_hidden_states",
    "output_attentions", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder",
})
# keys of the K2.5/K2.6 multimodal wrapper around text_config (the vision side is not ours)
WRAPPER_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "text_config", "vision_config", "quantization_config", "bos_token_id", "eos_token_id",
    "pad_token_id", "media_placeholder_token_id", "ignore_index", "tie_word_embeddings",
    "use_unified_vision_chunk", "video_placeholder", "image_placeholder",
})
# switches that must hold the one value this implementation computes
REQUIRED_VALUES = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                   "moe_layer_freq": 1, "attention_bias": False}
# keys read by from_dict besides the dataclass fields
PARSED_KEYS = frozenset({"num_key_value_heads", "quantization_config", "rope_theta", "rope_scaling",
                         "rope_parameters", "rope_interleave"}) | frozenset(REQUIRED_VALUES)
# sizes that must be positive integers, and counts that may be 0
POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                 "max_position_embeddings", "rope_original_max_position")
NONNEGATIVE_INTS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "rope_factor", "routed_scaling_factor")
ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})


@dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors pack-quantized weights: symmetric ints, one bf16 scale per group."""
    num_bits: int = 4
    group_size: int = 32


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 / Kimi K2.x language model (field names are the config.json keys)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # dense MLP width (the first_k_dense_replace layers)
    moe_intermediate_size: int      # width of one routed (and one shared) expert
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_factor: float = 1.0        # YaRN scaling factor (1 = plain RoPE)
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # MTP modules in the checkpoint (not used by the target)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    quantization: QuantConfig | None = None

    def __post_init__(self):
        for name in POSITIVE_INTS + NONNEGATIVE_INTS:
            value, least = getattr(self, name), 1 if name in POSITIVE_INTS else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
        for name in POSITIVE_FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group: {self.n_group} does not divide n_routed_experts={self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: expected 1..n_group={self.n_group}, got {self.topk_group}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} > n_routed_experts")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: must be even, got {self.qk_rope_head_dim}")

    # derived sizes --------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Width of one absorbed-cache entry: [c_kv | k_rope]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> range:
        return range(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def yarn_mscale(self) -> float:
        """YaRN's attention-temperature factor for the softmax scale (1 without YaRN)."""
        if self.rope_factor <= 1 or not self.rope_mscale_all_dim:
            return 1.0
        return 0.1 * self.rope_mscale_all_dim * math.log(self.rope_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim) times YaRN's mscale squared (DeepSeek-V3's convention)."""
        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def absorbable(self) -> bool:
        """Whether the absorbed attention runs this model: verify_attn (kernel and reference) fixes the
        latent at K2.6's kv_lora_rank 512 + qk_rope_head_dim 64; the naive path takes any widths."""
        from ..verify_attn import LATENT_DIM, ROPE_DIM
        return (self.kv_lora_rank, self.qk_rope_head_dim) == (LATENT_DIM, ROPE_DIM)

    def check_absorbable(self, where: str = "config") -> None:
        """Refuse, naming the field, a model the absorbed attention cannot run (before it fails inside
        verify_attn at the first forward)."""
        from ..verify_attn import LATENT_DIM, ROPE_DIM
        for name, fixed in (("kv_lora_rank", LATENT_DIM), ("qk_rope_head_dim", ROPE_DIM)):
            if getattr(self, name) != fixed:
                raise ValueError(f"{where}.{name}: the absorbed attention (verify_attn) takes K2.6's {fixed}, got "
                                 f"{getattr(self, name)} (load with attention='naive' for other widths)")

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Parse a config.json dict (plain DeepseekV3, or a K2.5/K2.6 wrapper with text_config)."""
        wrapper_quant = None
        if "text_config" in raw:
            _check_known(raw, WRAPPER_KEYS, "config")
            wrapper_quant = raw.get("quantization_config")
            raw = raw["text_config"]
            where = "text_config"
        else:
            where = "config"
        names = {f.name for f in fields(cls) if not f.name.startswith("rope_") and f.name != "quantization"}
        _check_known(raw, names | METADATA_KEYS | PARSED_KEYS, where)
        for key, value in REQUIRED_VALUES.items():
            if key in raw and raw[key] != value:
                raise ValueError(f"{where}.{key}: only {value!r} is implemented, got {raw[key]!r}")
        heads = raw.get("num_key_value_heads")
        if heads is not None and heads != raw.get("num_attention_heads"):
            raise ValueError(f"{where}.num_key_value_heads: MLA needs it equal to num_attention_heads, got {heads}")
        if raw.get("q_lora_rank") is None:
            raise ValueError(f"{where}.q_lora_rank: a model without the query low-rank path is not supported")
        values = {key: raw[key] for key in names if key in raw}
        values.update(rope_interleave=raw.get("rope_interleave", True), **_rope_fields(raw, where))
        quant = raw.get("quantization_config", wrapper_quant)
        values["quantization"] = None if quant is None else _quant_config(quant, f"{where}.quantization_config")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
        if missing:
            raise ValueError(f"{where}: missing required keys {missing}")
        return cls(**values)


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from a checkpoint directory (its config.json) or a config file; a ValueError names
    the file and the key."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config: no such file {path}")
    raw = read_json_object(path)
    try:
        return ModelConfig.from_dict(raw)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _check_known(raw: dict, known: frozenset | set, where: str) -> None:
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (refusing to ignore them)")


def _rope_fields(raw: dict, where: str) -> dict:
    """RoPE settings from either the old (rope_theta + rope_scaling) or new (rope_parameters) keys."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    _check_known(rope, ROPE_KEYS, f"{where}.rope_parameters")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    out = {} if theta is None else {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "yarn":
        raise ValueError(f"{where}.rope_scaling.type: only 'yarn' is implemented, got {kind!r}")
    if "factor" not in rope or "original_max_position_embeddings" not in rope:
        raise ValueError(f"{where}.rope_scaling: YaRN needs factor and original_max_position_embeddings")
    out.update(rope_factor=float(rope["factor"]),
               rope_original_max_position=int(rope["original_max_position_embeddings"]),
               rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
               rope_mscale=float(rope.get("mscale") or 1), rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
               rope_truncate=bool(rope.get("truncate", True)))
    return out


def _quant_config(quant: dict, where: str) -> QuantConfig:
    """Check a compressed-tensors config is the one format implemented: int4, symmetric, grouped."""
    method, layout = quant.get("quant_method"), quant.get("format")
    if (method, layout) != ("compressed-tensors", "pack-quantized"):
        raise ValueError(f"{where}: only compressed-tensors pack-quantized is implemented, "
                         f"got quant_method={method!r} format={layout!r}")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}.config_groups: expected one group, got {sorted(groups)}")
    name, group = next(iter(groups.items()))
    weights = group.get("weights") or {}
    expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, value in expected.items():
        if weights.get(key, value) != value:
            raise ValueError(f"{where}.config_groups.{name}.weights.{key}: expected {value!r}, "
                             f"got {weights[key]!r}")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ValueError(f"{where}.config_groups.{name}.{key}: activation quantization is not implemented")
    from ..moe import GROUP_SIZE
    if weights.get("group_size", GROUP_SIZE) != GROUP_SIZE:
        raise ValueError(f"{where}.config_groups.{name}.weights.group_size: only {GROUP_SIZE} is implemented "
                         f"(the INT4 kernel's and the dequantizer's group), got {weights['group_size']!r}")
    return QuantConfig(num_bits=4, group_size=GROUP_SIZE)


# ----------------------------------------------------------------------------------------------
# the tiny config: K2.6's switches at test size

def tiny_config(**overrides) -> dict:
    """A DeepseekV3 config.json dict at test size with Kimi K2.6's switches (YaRN, sigmoid noaux_tc
    routing, a dense first layer, a shared expert). The MLA latent keeps the verify contract's
    512 + 64 widths, so the absorbed path and the kernels run on it."""
    config = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=64,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        rope_theta=50000.0, rope_interleave=True, num_nextn_predict_layers=0,
        hidden_act="silu", scoring_func="sigmoid", topk_method="noaux_tc", attention_bias=False,
        bos_token_id=0, eos_token_id=1,
    )
    config.update(overrides)
    return config


def transformers_kwargs(config: dict) -> dict:
    """A config.json dict as transformers' DeepseekV3Config takes it (rope_parameters, no metadata keys)."""
    kwargs = dict(config)
    kwargs["rope_parameters"] = dict(kwargs.pop("rope_scaling"), rope_type="yarn", rope_theta=kwargs.pop("rope_theta"))
    kwargs["rope_parameters"].pop("type")
    for key in ("architectures", "model_type", "scoring_func", "topk_method"):
        kwargs.pop(key, None)
    return kwargs
