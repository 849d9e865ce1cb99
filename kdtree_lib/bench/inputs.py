"""Synthetic inputs the benchmarks share: models with random weights sharded per rank, latent caches,
best-first trees from a Zipf-like draft, and posteriors that follow a tree like a real target.

No checkpoint is read: a weight's full tensor is drawn from a generator seeded by its name and each
rank keeps its slice, so every TP degree shards the same model.
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import torch

from ..contracts import Tree, tree_from_parents
from ..dflash import DFlashConfig, DFlashDrafter
from ..draft_topk import draft_topk
from ..model import KVCache, ModelConfig, TensorParallel, Transformer
from ..model.checkpoint import INT4_CODES_PER_WORD, empty_target, load_weights
from ..synthetic import zipf_draft_logits
from ..tree_build import build_tree

FOLLOW_PROBABILITY = 0.8  # the target agrees with the drafter's best child this often (mean accept ~5)
INT4_CODE_STD = (255 / 12) ** 0.5  # std of a uniform INT4 code (0..15, centred on 8): scales set a weight's std


class RandomWeights:
    """Stands in for CheckpointReader in load_weights: each tensor is drawn whole from a generator
    seeded by its name (std 1/sqrt(fan-in); norms 1, router biases 0) and the requested slice is
    returned, so every TP degree shards the same model."""

    def __init__(self, device, dtype: torch.dtype, seed: int = 0, group_size: int = 32):
        self.device, self.dtype, self.seed, self.group_size = torch.device(device), dtype, seed, group_size

    def _generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:7], "little"))

    def read(self, name: str, shape: tuple[int, ...], dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> torch.Tensor:
        if name.endswith("e_score_correction_bias"):
            full = torch.zeros(shape, device=self.device)
        elif name.endswith("norm.weight"):
            full = torch.ones(shape, device=self.device, dtype=self.dtype)
        else:
            full = torch.randn(shape, generator=self._generator(name), device=self.device, dtype=self.dtype)
            full.mul_(shape[-1] ** -0.5)
        return full if dim is None else full.narrow(dim, start, stop - start)

    def read_int4(self, name: str, shape: tuple[int, int], dim: int | None = None, start: int | None = None,
                  stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An INT4 weight as CheckpointReader.read_int4 hands it out (packed int32 [out, in/8], bf16 scale
        [out, in/group], or their slice along dim), made on the device: uniform random codes, one scale
        per weight giving std 1/sqrt(fan-in), so load_experts repacks it into the kernel layout as it does
        a checkpoint's, with no file written."""
        out, inputs = shape
        if inputs % self.group_size:
            raise ValueError(f"shape: {name}'s input dimension {inputs} is not a multiple of the group {self.group_size}")
        words = torch.randint(0, 2**32, (out, inputs // INT4_CODES_PER_WORD), generator=self._generator(name),
                              device=self.device, dtype=torch.int64)
        packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        scale = torch.full((out, inputs // self.group_size), inputs ** -0.5 / INT4_CODE_STD, device=self.device,
                           dtype=torch.bfloat16)
        if dim is None:
            return packed, scale
        if dim == 1:
            if start % self.group_size or stop % self.group_size:
                raise ValueError(f"slice: [{start}:{stop}] of {name}'s input does not align with groups of {self.group_size}")
            return (packed[:, start // INT4_CODES_PER_WORD:stop // INT4_CODES_PER_WORD],
                    scale[:, start // self.group_size:stop // self.group_size])
        return packed.narrow(dim, start, stop - start), scale.narrow(dim, start, stop - start)


def random_target(config: ModelConfig, tp: TensorParallel, *, device, dtype: torch.dtype,
                  attention_backend: str = "auto", seed: int = 0, int4_experts: bool = False) -> Transformer:
    """This rank's shard of `config`'s model (absorbed attention, TP experts), random weights;
    int4_experts: the routed experts INT4-resident in the kernel layout (as a checkpoint's load)."""
    model = empty_target(config, tp, device=device, dtype=dtype, attention_backend=attention_backend,
                         int4_experts=int4_experts)
    group = config.quantization.group_size if config.quantization else 32
    load_weights(model, RandomWeights(device, dtype, seed, group_size=group))
    return model.eval()


def shape_configs(target=None, drafter=None) -> tuple[ModelConfig, DFlashConfig]:
    """(target config, drafter config) whose shapes a real-shape pair takes: each a config file or a folder
    holding config.json; None: K2.6's (data/configs/kimi-k2.6.json) and the real drafter's
    (data/configs/kimi-k2.6-dflash.json). A missing file is a ValueError naming the argument."""
    from ..model import load_config
    from ..checks import read_json_object
    from ..paths import REPO_ROOT
    configs = REPO_ROOT / "data" / "configs"
    target = Path(target) if target else configs / "kimi-k2.6.json"
    drafter = Path(drafter) if drafter else configs / "kimi-k2.6-dflash.json"
    files = {}
    for name, path in (("target", target), ("drafter", drafter)):
        files[name] = path / "config.json" if path.is_dir() else path
        if not files[name].is_file():
            raise ValueError(f"{name}: no config at {path} (expected a config file or a folder with config.json)")
    return load_config(files["target"]), DFlashConfig.from_dict(read_json_object(files["drafter"]))


K26_SHAPE_NAMES = ("kimi-k2.6", "kimi-k2.6-dflash")  # the default configs' names in a real-shape pair's name


def real_shape_name(layers: int, target=None, drafter=None) -> str:
    """The rows' pair column of a real-shape pair: "real-shapes-<layers>L:<target config>+<drafter config>" (the
    configs' file or folder names; K26_SHAPE_NAMES for the defaults), so rows say what shapes ran."""
    names = [Path(path).stem if path else default for path, default in zip((target, drafter), K26_SHAPE_NAMES)]
    return f"real-shapes-{layers}L:{names[0]}+{names[1]}"


def real_shape_pair_with_prompts(layers: int, *, prompts_per_package: int = 1, prompt_tokens: int = 32, device="cuda",
                                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, **shapes):
    """pairs.PairWithPrompts of real_shape_pair (K2.6's shapes, `layers` layers, random weights made on `device`;
    shapes: its config / drafter_config) and random prompt ids under the package "random", as
    pairs.pair_with_prompts gives its random pair: what notebook 10 runs its GPU sections on with
    real_shapes_layers. Its acceptance means nothing."""
    from ..pairs import PairWithPrompts
    target, drafter = real_shape_pair(layers, device=device, dtype=dtype, seed=seed, **shapes)
    rng = np.random.default_rng(seed)
    packages = {"random": [rng.integers(0, target.config.vocab_size, size=prompt_tokens)
                           for _ in range(2 * prompts_per_package)]}
    description = (f"REAL-SHAPE pair: K2.6's layer shapes cut to {layers} layers (INT4 experts) and the real drafter's, "
                   f"random weights made on {device} in {str(dtype).removeprefix('torch.')}, random prompts: timings "
                   "and memory are the real pair's, acceptance means nothing")
    return PairWithPrompts(target, drafter, description, real_shape_name(layers), False, packages)


def real_shape_configs(layers: int, config: ModelConfig, drafter_config: DFlashConfig) -> tuple[ModelConfig, DFlashConfig]:
    """`config` cut to `layers` layers, and `drafter_config` reading target features from layers that exist
    (its target_layer_ids clamped to the last one)."""
    if int(layers) < 1:
        raise ValueError(f"layers: expected at least 1, got {layers}")
    config = dataclasses.replace(config, num_hidden_layers=int(layers))
    ids = tuple(min(i, config.num_hidden_layers - 1) for i in drafter_config.target_layer_ids)
    return config, dataclasses.replace(drafter_config, target_layer_ids=ids)


def real_shape_pair(layers: int, *, device, dtype: torch.dtype = torch.bfloat16, tp: TensorParallel | None = None,
                    seed: int = 0, int4_experts: bool = True, config: ModelConfig | None = None,
                    drafter_config: DFlashConfig | None = None) -> tuple[Transformer, DFlashDrafter]:
    """(target, drafter) made directly on `device`, nothing written to disk: K2.6 at its layer shapes
    (data/configs/kimi-k2.6.json) with `layers` layers (the first dense, as in K2.6), routed experts INT4
    in the kernel layout, this rank's shard under `tp`; and the real DFlash drafter's shapes
    (data/configs/kimi-k2.6-dflash.json: six target features, clamped to the layers there are). Random
    weights: timings and memory are the real ones', acceptance is meaningless. config / drafter_config
    replace K2.6's and the real drafter's (small shapes for CPU tests; shape_configs reads them from files)."""
    if int(layers) < 1:
        raise ValueError(f"layers: expected at least 1, got {layers}")
    if config is None or drafter_config is None:
        default_config, default_drafter = shape_configs()
        config, drafter_config = config or default_config, drafter_config or default_drafter
    config, drafter_config = real_shape_configs(layers, config, drafter_config)
    target = random_target(config, tp or TensorParallel(), device=device, dtype=dtype, seed=seed,
                           int4_experts=int4_experts)
    return target, random_drafter(drafter_config, target, seed=seed)


def random_drafter(config: DFlashConfig, target: Transformer, *, seed: int = 0) -> DFlashDrafter:
    """A DFlash drafter with random weights on the target's device, bound to its embedding and LM head."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config).to(target.embed_tokens.weight.dtype)
    drafter = drafter.to_empty(device=target.device).requires_grad_(False)
    torch.manual_seed(seed)
    drafter.init_weights()
    return drafter.bind(target).eval()


def random_cache(model: Transformer, batch: int, context: int, capacity: int, *, seed: int = 0) -> KVCache:
    """Every request holds `context` committed tokens of random latent entries; room for `capacity`."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    dtype = model.embed_tokens.weight.dtype
    kv = [torch.randn(batch, capacity, model.config.cache_dim, generator=generator, device=model.device, dtype=dtype)
          for _ in model.layers]
    return KVCache(kv=kv, lengths=torch.full((batch,), context, dtype=torch.int32, device=model.device))


def synthetic_tree(batch: int, nodes: int, *, depth: int, vocab: int, seed: int = 0) -> Tree:
    """A best-first tree of `nodes` nodes (root included) per request from a Zipf-like draft;
    nodes = 1 is the root alone (an autoregressive step)."""
    if nodes == 1:
        return tree_from_parents(np.full((batch, 1), -1), np.zeros((batch, 1), np.int32), max_depth=depth)
    draft = draft_topk(zipf_draft_logits(batch, depth, vocab, seed=seed), min(nodes - 1, vocab), backend="numpy")
    return build_tree(draft, nodes - 1, root=np.zeros(batch, np.int32), backend="numpy")


def follow_posterior(tree, rng, probability: float = FOLLOW_PROBABILITY) -> np.ndarray:
    """Posterior tokens [B, N] (host tree): the first child's token with `probability`, else a token
    no node carries, so acceptance lengths are geometric like a real drafter's."""
    first_child = tree.first_child
    rows = np.arange(tree.batch)[:, None]
    child_token = tree.tokens[rows, np.maximum(first_child, 0)]
    agree = (first_child >= 0) & (rng.random(first_child.shape) < probability)
    return np.where(agree, child_token, int(tree.tokens.max()) + 1).astype(np.int32)


def peaked_logits(batch: int, depth: int, vocab: int, *, scale: float = 5.0, seed: int = 0,
                  device="cpu") -> torch.Tensor:
    """float32 logits [B, D, V] of scale * N(0, 1). At scale 5 over a few thousand tokens the mean top-1
    probability is near 0.5, so best-first trees are about 5 deep at budget 64, like a real drafter's."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(batch, depth, vocab, generator=generator, device=device) * scale


def random_draft(batch: int, depth: int, k: int, *, seed: int = 0, device="cpu"):
    """(DraftTopK [B, D, k], root tokens int32 [B]) on `device`: draft_topk of peaked logits over
    4k + 4096 tokens (so the top-k never reaches the flat tail)."""
    logits = peaked_logits(batch, depth, 4 * k + 4096, seed=seed, device=device)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    root = torch.randint(0, 1000, (batch,), dtype=torch.int32, generator=generator, device=device)
    return draft_topk(logits, k, backend="torch"), root
