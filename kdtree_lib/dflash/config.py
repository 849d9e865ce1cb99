"""The DFlash drafter's configuration: DFlashConfig from a z-lab config.json, YaRN's settings, the
target layers its features come from, and where the drafter is placed over a TP group.

RoPE: default, or YaRN as transformers computes it for Qwen3 (`rope_parameters` / `rope_scaling`:
factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate,
attention_factor) over the full head_dim with rotate_half; cos and sin are multiplied by the
attention factor, so the logits by its square, with the softmax scale head_dim^-0.5 unchanged.
Ports disagree on that factor when the config gives none: "transformers" (the default) takes
transformers' value, mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set
(1.0 for the real drafter's mscale = mscale_all_dim = 1); "legacy" takes 0.1 ln(factor) + 1
(1.416 at factor 64), what the original YaRN code and some ports apply. An `attention_factor` key in
the config wins over either (DFlashConfig.from_dict(raw, yarn_attention=...), load_drafter(...)).
Keys z-lab's code defaults are defaulted the same way: block_size 16, target_layer_ids spread over
num_target_layers (build_target_layer_ids).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch

from ..checks import read_json_object
from ..model.model import yarn_inv_freq, yarn_mscale

ARCHITECTURE = "DFlashDraftModel"
DFLASH_KEYS = frozenset({"block_size", "mask_token_id", "target_layer_ids"})
ZLAB_BLOCK_SIZE = 16     # z-lab's default when a config has no block_size
YARN_ATTENTION = ("transformers", "legacy")
YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor"})
# keys that describe the file, the tokenizer or training, not the forward pass
METADATA_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "attention_dropout",
    "tie_word_embeddings", "max_window_layers", "use_sliding_window", "max_position_embeddings",
    "num_target_layers", "_name_or_path", "output_hidden_states", "return_dict",
})
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class YarnRope:
    """YaRN's settings (the rope_parameters keys), its attention factor resolved to a number."""
    factor: float
    original_max_position_embeddings: int
    attention_factor: float          # multiplies cos and sin
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_parameters(cls, rope: dict, yarn_attention: str = "transformers") -> "YarnRope":
        """From a rope_parameters dict; yarn_attention picks the attention factor the dict does not give."""
        if yarn_attention not in YARN_ATTENTION:
            raise ValueError(f"yarn_attention: expected one of {YARN_ATTENTION}, got {yarn_attention!r}")
        unknown = set(rope) - YARN_KEYS
        if unknown:
            raise ValueError(f"config.rope_parameters: keys {sorted(unknown)} are not implemented for YaRN")
        missing = {"factor", "original_max_position_embeddings"} - set(rope)
        if missing:
            raise ValueError(f"config.rope_parameters: YaRN needs {sorted(missing)}")
        factor = float(rope["factor"])
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = rope.get("attention_factor")
        if attention_factor is None and yarn_attention == "legacy":
            attention_factor = yarn_mscale(factor)
        elif attention_factor is None:
            attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else yarn_mscale(factor))
        return cls(factor=factor, original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                   attention_factor=float(attention_factor), beta_fast=float(rope.get("beta_fast") or 32),
                   beta_slow=float(rope.get("beta_slow") or 1), mscale=mscale, mscale_all_dim=mscale_all_dim,
                   truncate=bool(rope.get("truncate", True)))

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        return yarn_inv_freq(head_dim, theta, self.factor, self.original_max_position_embeddings, self.beta_fast,
                             self.beta_slow, self.truncate)

    def to_parameters(self) -> dict:
        raw = {"rope_type": "yarn", "factor": self.factor,
               "original_max_position_embeddings": self.original_max_position_embeddings,
               "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "mscale": self.mscale,
               "mscale_all_dim": self.mscale_all_dim, "truncate": self.truncate,
               "attention_factor": self.attention_factor}
        return {key: value for key, value in raw.items() if value is not None}


@dataclass(frozen=True)
class DFlashConfig:
    """The drafter's architecture (field names are the config.json keys)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    yarn: YarnRope | None = None        # None: default RoPE
    attention_bias: bool = False
    is_causal: bool = False
    layer_types: tuple[str, ...] = ()   # empty: every layer full attention
    sliding_window: int | None = None

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size: expected at least 2 (bonus + one draft), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: expected 0..vocab_size-1={self.vocab_size - 1}, got {self.mask_token_id}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: expected at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: expected {self.num_hidden_layers} entries, got {len(self.layer_types)}")
        if any(kind not in LAYER_TYPES for kind in self.layer_types):
            raise ValueError(f"layer_types: expected entries in {LAYER_TYPES}, got {self.layer_types}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window: sliding_attention layers need a window")

    @property
    def draft_depth(self) -> int:
        """D: tokens drafted per block (the bonus is given)."""
        return self.block_size - 1

    @property
    def feature_size(self) -> int:
        """F: width of the concatenated target features."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def positional_mask(self) -> bool:
        """Whether any layer's mask depends on positions (causal, or a sliding window)."""
        return self.is_causal or any(self.window(i) is not None for i in range(self.num_hidden_layers))

    def window(self, layer: int) -> int | None:
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @classmethod
    def from_dict(cls, raw: dict, *, yarn_attention: str = "transformers") -> "DFlashConfig":
        """Parse a z-lab config.json dict; a key this module does not know is an error.
        yarn_attention: YaRN's attention factor when the config gives none (module docstring)."""
        architectures = raw.get("architectures") or [ARCHITECTURE]
        if architectures != [ARCHITECTURE]:
            raise ValueError(f"config.architectures: only {ARCHITECTURE} is implemented, got {architectures}")
        nested = dict(raw.get("dflash_config") or {})
        unknown = set(nested) - DFLASH_KEYS
        if unknown:
            raise ValueError(f"config.dflash_config: keys {sorted(unknown)} are not implemented")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.hidden_act: only 'silu' is implemented, got {raw['hidden_act']!r}")
        names = {f.name for f in fields(cls)} - {"yarn"}
        known = names | METADATA_KEYS | {"dflash_config", "hidden_act", "rope_parameters", "rope_scaling"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"config: keys {sorted(unknown)} are not known to the DFlash drafter")
        values = {name: raw[name] for name in names if name in raw}
        values.update(nested)
        values.setdefault("block_size", ZLAB_BLOCK_SIZE)
        if "target_layer_ids" not in values and values.get("num_target_layers"):
            values["target_layer_ids"] = build_target_layer_ids(values["num_target_layers"],
                                                                raw.get("num_hidden_layers", 0))
        missing = DFLASH_KEYS - set(values)
        if missing:
            raise ValueError(f"config: {sorted(missing)} missing (top level or under dflash_config)")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
        derived = {"head_dim": ("hidden_size", "num_attention_heads"), "num_key_value_heads": ("num_attention_heads",)}
        missing = [name for name in required if name not in derived] + sorted(
            {key for name in required for key in derived.get(name, ()) if key not in values})
        if missing:
            raise ValueError(f"config: missing required keys {sorted(set(missing))}")
        values["rope_theta"], values["yarn"] = _rope(raw, yarn_attention)
        values.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        values.setdefault("num_key_value_heads", raw["num_attention_heads"])
        values["target_layer_ids"] = tuple(int(i) for i in values["target_layer_ids"])
        values["layer_types"] = tuple(values.get("layer_types") or ())
        if "sliding_attention" not in values["layer_types"]:
            values["sliding_window"] = None
        return cls(**values)

    def to_dict(self) -> dict:
        """config.json in z-lab's layout (Qwen3 keys, DFlash's under dflash_config)."""
        raw = {"architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_act": "silu"}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in DFLASH_KEYS or f.name in ("rope_theta", "yarn", "layer_types", "sliding_window"):
                continue
            raw[f.name] = value
        raw["block_size"] = self.block_size
        raw["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        rope = self.yarn.to_parameters() if self.yarn else {"rope_type": "default"}
        raw["rope_parameters"] = rope | {"rope_theta": self.rope_theta}
        raw["layer_types"] = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        raw["sliding_window"] = self.sliding_window
        return raw

    @classmethod
    def load(cls, path, *, yarn_attention: str = "transformers") -> "DFlashConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ValueError(f"path: no drafter config {file}")
        raw = read_json_object(file)
        try:
            return cls.from_dict(raw, yarn_attention=yarn_attention)
        except ValueError as error:
            raise ValueError(f"{file}: {error}") from None


def _rope(raw: dict, yarn_attention: str) -> tuple[float, YarnRope | None]:
    """(rope_theta, YaRN settings or None) from rope_parameters, rope_scaling or the top level."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"config.rope_parameters.rope_type: only 'default' and 'yarn' are implemented, got {kind!r}")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))
    return theta, YarnRope.from_parameters(rope, yarn_attention) if kind == "yarn" else None


def build_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers spread from layer 1 to the second-to-last (the last layer's output is
    what the LM head reads; transformers even reports it after the final norm)."""
    last = num_target_layers - 2
    if count < 1 or last < 1 or count > last:
        raise ValueError(f"count: cannot pick {count} distinct layers in 1..{last} of a "
                         f"{num_target_layers}-layer target")
    if count == 1:
        return (last,)
    return tuple(round(1 + i * (last - 1) / (count - 1)) for i in range(count))


DRAFTER_PLACEMENTS = ("replicated", "sharded")
# The one default of every entry point that places the drafter (load_drafter, decode_tp.generate_tp,
# `python -m kdtree_lib.decode`, the memory plan): its layers split over the target's TP ranks, so its
# weights and its forward's time fall by 1/tp (docs/tp-decode.md). At TP = 1 both placements are one.
DEFAULT_DRAFTER_PLACEMENT = "sharded"
