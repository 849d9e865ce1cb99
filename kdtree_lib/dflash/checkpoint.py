"""The DFlash drafter's checkpoints in z-lab's format: config.json + safetensors (one file, or shards
with an index), written whole, read per tensor-parallel rank (a sharded drafter's rank reads only its
slices)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model.tp import TensorParallel
from .config import DEFAULT_DRAFTER_PLACEMENT, DRAFTER_PLACEMENTS, DFlashConfig
from .model import DFlashDrafter

SHARD_BYTES = 16 * 1024 * 1024


def save_drafter(drafter: DFlashDrafter, path, *, dtype=torch.bfloat16, shard_bytes: int = SHARD_BYTES) -> None:
    """config.json + safetensors (one file, or shards of at most `shard_bytes` with an index)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = drafter.config.to_dict() | {"dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {name: t.detach().to(dtype).contiguous().cpu() for name, t in drafter.state_dict().items()}
    write_safetensors(state, path, shard_bytes)


def write_safetensors(state: dict, path: Path, shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    shards, current, size = [], {}, 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = state[name]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_drafter_weights(path: Path, drafter: DFlashDrafter) -> dict:
    """This rank's slice of every tensor of the checkpoint at `path` (model.safetensors, or shards
    with an index; names with or without z-lab's "model." prefix), read slice by slice: a sharded
    drafter's rank reads only its 1/tp of the split weights."""
    from ..model.checkpoint import read_weight_map
    index = path / "model.safetensors.index.json"
    files = sorted(set(read_weight_map(index).values())) if index.is_file() else ["model.safetensors"]
    tp, state, names = drafter.tp, {}, set(drafter.state_dict())
    for file in files:
        if not (path / file).is_file():
            raise ValueError(f"{path}: weight file {file} is missing")
        with safe_open(path / file, framework="pt") as handle:
            for stored in handle.keys():
                name = stored.removeprefix("model.")
                owner = name.rsplit(".", 1)[0]
                dim = getattr(drafter.get_submodule(owner), "tp_dim", None) if name in names else None
                if dim is None or not name.endswith(".weight"):
                    state[name] = handle.get_tensor(stored)
                    continue
                tensor = handle.get_slice(stored)
                share = tensor.get_shape()[dim] // tp.size
                state[name] = tensor[(slice(None),) * dim + (slice(tp.rank * share, (tp.rank + 1) * share),)]
    return state


def load_drafter(path, target, *, device=None, dtype=None, yarn_attention: str = "transformers",
                 placement: str = DEFAULT_DRAFTER_PLACEMENT) -> DFlashDrafter:
    """A DFlash checkpoint (z-lab format), bound to `target`, on the target's device and dtype.
    yarn_attention: YaRN's attention-factor convention (config.py's docstring). placement "sharded":
    the layers split over the target's tensor-parallel group (this rank's slices only)."""
    if placement not in DRAFTER_PLACEMENTS:
        raise ValueError(f"placement: expected one of {DRAFTER_PLACEMENTS}, got {placement!r}")
    path = Path(path)
    tp = getattr(target, "tp", TensorParallel()) if placement == "sharded" else TensorParallel()
    drafter = DFlashDrafter(DFlashConfig.load(path, yarn_attention=yarn_attention), tp)
    state = read_drafter_weights(path, drafter)
    expected = set(drafter.state_dict())
    if set(state) != expected:
        raise ValueError(f"{path}: weights missing {sorted(expected - set(state))[:5]}, "
                         f"unexpected {sorted(set(state) - expected)[:5]}")
    drafter.load_state_dict(state)
    drafter.bind(target)
    weight = drafter.target.weight
    return drafter.to(device=device or weight.device, dtype=dtype or weight.dtype).eval()
