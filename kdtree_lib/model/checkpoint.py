"""Checkpoints: Hugging Face safetensors directories in the DeepseekV3 and Kimi K2.x layouts.

- one `model.safetensors`, or several files with `model.safetensors.index.json`;
- tensor names `model.layers.{i}...` and `lm_head.weight`, optionally under the `language_model.`
  prefix of K2.5/K2.6 (their vision tower is skipped), routed experts one tensor per expert;
- bf16/fp32 weights, and compressed-tensors pack-quantized INT4 (K2.6's routed experts):
  `X.weight_packed` int32 [out, in/8] holds eight 4-bit codes q+8 per int32 along the input
  dimension (code j in bits 4j..4j+3), `X.weight_scale` bf16 [out, in/group] one scale per group of
  32 inputs, `X.weight_shape` [2] = (out, in); weight = (code - 8) * scale. Routed experts stay
  INT4 (repacked into the MoE kernel's layout, docs/moe-int4.md) unless the caller asks for them
  dequantized; any other INT4 tensor is dequantized at load.

Each tensor-parallel rank reads only its shard: `safe_open(...).get_slice(name)[rows or columns]`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..checks import read_json_object
from ..moe import fits_kernel_layout
from .config import ModelConfig, QuantConfig, load_config
from .model import Experts, Transformer
from .tp import TensorParallel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
KIMI_PREFIX = "language_model."
INT4_CODES_PER_WORD = 8


def load_target(path, *, device="cpu", dtype=torch.bfloat16, tp_group=None, moe_parallel: str = "tp",
                attention: str = "absorbed", attention_backend: str = "auto",
                dequantize_experts: bool = False) -> Transformer:
    """The target model from a checkpoint directory; with tp_group, this rank's shard only.

    A pack-quantized checkpoint's routed experts stay INT4 on `device` (4.5 bits per weight, run by
    kdtree_lib.moe) when this rank's expert shapes fit the kernel layout (hidden and expert width
    multiples of 64: K2.6 at TP up to 32); dequantize_experts=True (parity tests) or a shape that
    does not fit loads them dequantized to `dtype`.
    """
    config = load_config(path)
    if attention == "absorbed":
        config.check_absorbable(str(Path(path) / "config.json"))
    tp = TensorParallel.from_group(tp_group)
    width = config.moe_intermediate_size // (tp.size if moe_parallel == "tp" else 1)
    int4 = config.quantization is not None and not dequantize_experts and fits_kernel_layout(config.hidden_size, width)
    model = empty_target(config, tp, device=device, dtype=dtype, int4_experts=int4, moe_parallel=moe_parallel,
                         attention=attention, attention_backend=attention_backend)
    load_weights(model, CheckpointReader(path, config.quantization))
    return model.eval()


def empty_target(config: ModelConfig, tp: TensorParallel, *, device, dtype, int4_experts: bool = False,
                 **options) -> Transformer:
    """The rank's model with uninitialized weights on `device` (built on meta: no wasted init);
    int4_experts: routed experts as INT4 buffers (Experts.keep_int4), no float stack on the way."""
    with torch.device("meta"):
        model = Transformer(config, tp, **options).to(dtype=dtype)  # router bias stays fp32
    if int4_experts:
        for module in model.modules():
            if isinstance(module, Experts):
                module.keep_int4()
    return model.to_empty(device=device).requires_grad_(False)


@torch.no_grad()
def load_weights(model: Transformer, reader: "CheckpointReader") -> None:
    """Fill every parameter and buffer of `model` with its rank's shard from `reader`."""
    tp = model.tp
    experts = {name: module for name, module in model.named_modules() if isinstance(module, Experts)}
    for name, module in experts.items():
        load_experts(module, reader, f"model.{name}", model.config.hidden_size, model.config.moe_intermediate_size)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        owner = name.rsplit(".", 1)[0]
        if owner in experts:
            continue
        dim = getattr(model.get_submodule(owner), "tp_dim", None)
        full = list(tensor.shape)
        start = stop = None
        if dim is not None:
            full[dim] *= tp.size
            start, stop = tp.rank * tensor.shape[dim], (tp.rank + 1) * tensor.shape[dim]
        tensor.copy_(reader.read(checkpoint_name(name, model.config), tuple(full), dim, start, stop))


def load_experts(experts: Experts, reader: "CheckpointReader", prefix: str, hidden: int, width: int) -> None:
    """Stack this rank's experts (or expert-width slices) from the per-expert tensors: packed as
    stored into INT4 experts, dequantized (where stored INT4) into float ones."""
    lo, hi = experts.width_range
    for local, expert in enumerate(experts.expert_ids):
        base = f"{prefix}.{expert}"
        if experts.int4:
            gate, up = (reader.read_int4(f"{base}.{p}_proj.weight", (width, hidden), 0, lo, hi) for p in ("gate", "up"))
            down = reader.read_int4(f"{base}.down_proj.weight", (hidden, width), 1, lo, hi)
            experts.load_int4(local, torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]]), *down)
            continue
        gate = reader.read(f"{base}.gate_proj.weight", (width, hidden), 0, lo, hi)
        up = reader.read(f"{base}.up_proj.weight", (width, hidden), 0, lo, hi)
        experts.gate_up_proj[local].copy_(torch.cat([gate, up]))
        experts.down_proj[local].copy_(reader.read(f"{base}.down_proj.weight", (hidden, width), 1, lo, hi))


def checkpoint_name(name: str, config: ModelConfig) -> str:
    """The checkpoint tensor holding model parameter `name`."""
    if name == "lm_head.weight":
        return "model.embed_tokens.weight" if config.tie_word_embeddings else name
    return f"model.{name}"


class CheckpointReader:
    """Tensors of a safetensors checkpoint, read whole or as a slice along one dimension.

    `bytes_read` counts the bytes of every tensor or slice handed out (packed bytes for INT4).
    """

    def __init__(self, path, quantization: QuantConfig | None = None):
        self.path = Path(path)
        self.quantization = quantization or QuantConfig()
        self.bytes_read = 0
        self._handles = {}
        stored = self._weight_map()
        prefixed = any(name.startswith(KIMI_PREFIX) for name in stored)
        self.location = {name.removeprefix(KIMI_PREFIX): (file, name) for name, file in stored.items()
                         if not prefixed or name.startswith(KIMI_PREFIX)}
        for name, (file, _) in self.location.items():
            if not (self.path / file).is_file():
                raise ValueError(f"checkpoint: shard file {file} (holding tensor {name}) is missing in {self.path}")

    def _weight_map(self) -> dict[str, str]:
        if (self.path / INDEX_FILE).is_file():
            return read_weight_map(self.path / INDEX_FILE)
        if (self.path / SINGLE_FILE).is_file():
            with self._open(SINGLE_FILE) as handle:
                return {name: SINGLE_FILE for name in handle.keys()}
        raise ValueError(f"checkpoint: neither {INDEX_FILE} nor {SINGLE_FILE} in {self.path}")

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def _slice(self, name: str):
        file, stored = self.location[name]
        if file not in self._handles:
            self._handles[file] = self._open(file)
        try:
            return self._handles[file].get_slice(stored)
        except SafetensorError:
            raise ValueError(f"checkpoint: tensor {stored} is not in {self.path / file}, where {INDEX_FILE} "
                             "places it (a damaged or mismatched shard?)") from None

    def _open(self, file: str):
        """One shard, opened; a damaged one (truncated, not safetensors) is a ValueError naming the file."""
        try:
            return safe_open(self.path / file, framework="pt")
        except SafetensorError as err:
            raise ValueError(f"checkpoint: {self.path / file} is not a readable safetensors file ({err}); "
                             "truncated or partly downloaded?") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read_raw(self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None):
        """Tensor `name` as stored, or its [start:stop) slice along dim (0 or 1)."""
        index = (slice(None),) if dim is None else (slice(None),) * dim + (slice(start, stop),)
        tensor = self._slice(name)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read(self, name: str, shape: tuple[int, ...], dim: int | None = None,
             start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor `name` of full `shape` (checked), or its [start:stop) slice along dim;
        pack-quantized weights (`name`_packed) are dequantized."""
        if name in self:
            stored = self.shape(name)
            if stored != tuple(shape):
                raise ValueError(f"checkpoint: tensor {name} has shape {list(stored)}, the config implies {list(shape)}")
            return self.read_raw(name, dim, start, stop)
        if name.endswith(".weight") and f"{name}_packed" in self:
            return dequantize_int4(*self.read_int4(name, shape, dim, start, stop), self.quantization.group_size)
        raise ValueError(f"checkpoint: tensor {name} is missing in {self.path}")

    def read_int4(self, name: str, shape: tuple[int, int], dim: int | None = None, start: int | None = None,
                  stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pack-quantized weight `name` of full `shape` (checked), or its [start:stop) slice along dim,
        as stored: (packed int32 [out, in/8], scale bf16 [out, in/group])."""
        group = self.quantization.group_size
        out, inputs = shape
        packed, scale, recorded = f"{name}_packed", f"{name}_scale", f"{name}_shape"
        if recorded in self and tuple(self.read_raw(recorded).tolist()) != tuple(shape):
            raise ValueError(f"checkpoint: tensor {recorded} says {self.read_raw(recorded).tolist()}, "
                             f"the config implies {list(shape)}")
        expected = {packed: (out, inputs // INT4_CODES_PER_WORD), scale: (out, inputs // group)}
        for part, part_shape in expected.items():
            if inputs % group or part not in self or self.shape(part) != part_shape:
                found = f"shape {list(self.shape(part))}" if part in self else "no such tensor"
                raise ValueError(f"checkpoint: tensor {part} should have shape {list(part_shape)} "
                                 f"(weight {list(shape)}, group {group}), found {found} in {self.path}")
        if dim == 1:
            if start % group or stop % group:
                raise ValueError(f"checkpoint: slice [{start}:{stop}] of {name}'s input dimension does not "
                                 f"align with its quantization groups of {group}")
            codes = self.read_raw(packed, 1, start // INT4_CODES_PER_WORD, stop // INT4_CODES_PER_WORD)
            scales = self.read_raw(scale, 1, start // group, stop // group)
        else:
            codes, scales = self.read_raw(packed, dim, start, stop), self.read_raw(scale, dim, start, stop)
        return codes, scales


def read_weight_map(index: Path) -> dict[str, str]:
    """{tensor name: shard file} of a model.safetensors.index.json; a ValueError naming the file and
    the key when it is not JSON or has no such map."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index}: expected a 'weight_map' object of tensor name -> shard file, "
                         f"got {type(weight_map).__name__ if weight_map is not None else 'none'}")
    return weight_map


# ----------------------------------------------------------------------------------------------
# INT4 pack-quantized format

def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """int32 [out, in/8] codes and [out, in/group] scales -> float32 [out, in]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed[..., None] >> shifts) & 0xF                            # (out, in/8, 8)
    values = (codes - 8).reshape(len(packed), -1, group).float()           # (out, in/group, group)
    return (values * scale.float()[..., None]).reshape(len(packed), -1)


def quantize_int4(weight: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest INT4 of weight [out, in]: (packed int32 [out, in/8], bf16 scale)."""
    out, inputs = weight.shape
    grouped = weight.float().reshape(out, inputs // group, group)
    scale = (grouped.abs().amax(-1) / 7).clamp_min(1e-8).to(torch.bfloat16)
    codes = (grouped / scale.float()[..., None]).round().clamp(-8, 7).long() + 8
    words = (codes.reshape(out, -1, INT4_CODES_PER_WORD) << torch.arange(0, 32, 4)).sum(-1)  # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), scale


INT4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                              "strategy": "group", "group_size": 32}}},
}


def save_checkpoint(path, config: dict, tensors: dict[str, torch.Tensor], *, shards: int = 1,
                    prefix: str = "", quantize=None) -> Path:
    """Write an HF-layout checkpoint: config.json, `shards` safetensors files (+ index when > 1).

    tensors use the DeepseekV3 names; `prefix` (e.g. "language_model.") is prepended to every one;
    weights for which quantize(name) is true are stored pack-quantized INT4 (and the config says so).
    For a K2.x wrapper config (with text_config), the quantization config goes into text_config.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    stored = {}
    for name, tensor in tensors.items():
        if quantize is not None and quantize(name):
            packed, scale = quantize_int4(tensor)
            stored.update({f"{name}_packed": packed, f"{name}_scale": scale,
                           f"{name}_shape": torch.tensor(list(tensor.shape), dtype=torch.int64)})
        else:
            stored[name] = tensor
    if quantize is not None and len(stored) != len(tensors):
        config = json.loads(json.dumps(config))
        (config.get("text_config", config))["quantization_config"] = INT4_QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(stored)
    files = [SINGLE_FILE] if shards == 1 else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, file in enumerate(files):
        part = names[i * len(names) // shards:(i + 1) * len(names) // shards]
        save_file({prefix + n: stored[n].contiguous() for n in part}, str(path / file))
        weight_map.update({prefix + n: file for n in part})
    if shards > 1:
        total = sum(t.numel() * t.element_size() for t in stored.values())
        (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return path
