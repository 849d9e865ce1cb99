"""The pairs a notebook, test or benchmark runs: the trained stand-in pair, a tiny random pair (built
from model.config.tiny_config, the one tiny config the model tests use too), a checkpoint pair by
path, and the held-out prompts.

Pairs live here, apart from the decode loop, so training, sweeps and benchmarks get a pair without
importing the loop (checkpoint_pair, which hands the notebooks the loop to call too, imports it when
called). pair_name is the rows' `pair` column for a pair loaded by path.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checks import check_positive_int
from .dflash import DFlashConfig, DFlashDrafter, load_drafter
from .model import ModelConfig, Transformer, load_config, load_target
from .model.config import tiny_config, transformers_kwargs  # noqa: F401  (the pairs' tiny config, owned by the model)
from .corpus import PROMPTS_PATH
from .paths import MODELS_DIR
from .verify_attn import LATENT_DIM, ROPE_DIM

# The trained stand-in pairs by name: the target's folder under data/models; its drafters are
# "<name>-dflash" (block 8) and "<name>-dflash-b<block>". DEFAULT_PAIR is what notebooks, tests and
# benchmarks load; k26-deep (K2.6's proportions, issue 33) is selectable by name until it replaces it.
STAND_IN_PAIRS = ("k26-mini", "k26-deep")
DEFAULT_PAIR = "k26-mini"
TARGET_DIR = DEFAULT_PAIR


# ----------------------------------------------------------------------------------------------
# The random pair narrows the tiny config: with two heads and four experts a random target's greedy
# continuations stay varied (the decode tests need several distinct tokens per prompt).
RANDOM_PAIR_SHAPE = dict(moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
                         qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, routed_scaling_factor=2.5,
                         rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=256,
                                           beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))

# the tiny drafter's layers (DFlashConfig fields; hidden size and vocabulary are the target's)
TINY_DRAFTER = dict(intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, rope_theta=50000.0, rms_norm_eps=1e-6)


def random_pair(*, vocab: int = 64, block_size: int = 8, seed: int = 0, device="cpu", dtype=torch.float32,
                weight_std: float = 0.35, logit_scale: float = 1.0, draft_sharpness: float = 1.0):
    """A tiny random target (kdtree_lib.model) and DFlash drafter bound to it; no files, no transformers.

    weight_std: the target's weights are normal(0, weight_std) (smaller values make a target that
    repeats one token); logit_scale multiplies its LM head (larger: more peaked distributions);
    draft_sharpness scales the drafter's final norm, hence its logits (small values give flat
    drafts: a tree of budget >= vocabulary then holds every next token, so rounds accept >= 2).
    """
    generator = torch.Generator().manual_seed(seed)
    config = ModelConfig.from_dict(tiny_config(vocab_size=vocab, **RANDOM_PAIR_SHAPE))
    target = Transformer(config)
    with torch.no_grad():
        for name, tensor in [*target.named_parameters(), *target.named_buffers()]:
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            else:
                scale = weight_std * (logit_scale if name == "lm_head.weight" else 1.0)
                tensor.copy_(scale * torch.randn(tensor.shape, generator=generator))
    target = target.to(device=device, dtype=dtype).eval().requires_grad_(False)
    drafter = DFlashDrafter(DFlashConfig(hidden_size=config.hidden_size, vocab_size=vocab, block_size=block_size,
                                         mask_token_id=vocab - 1, num_target_layers=config.num_hidden_layers,
                                         target_layer_ids=(1,), **TINY_DRAFTER))
    with torch.no_grad():
        for name, tensor in drafter.named_parameters():
            tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator) if name.endswith("norm.weight")
                         else 0.2 * torch.randn(tensor.shape, generator=generator))
        drafter.norm.weight.mul_(draft_sharpness)
    drafter = drafter.bind(target).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return target, drafter


# ----------------------------------------------------------------------------------------------
# the trained stand-in pair

def check_pair(pair: str) -> str:
    if pair not in STAND_IN_PAIRS:
        raise ValueError(f"pair: expected one of {list(STAND_IN_PAIRS)}, got {pair!r}")
    return pair


def drafter_dir(block_size: int, pair: str = DEFAULT_PAIR) -> str:
    """The folder name of a stand-in pair's drafter of this block size."""
    return f"{check_pair(pair)}-dflash" if block_size == 8 else f"{pair}-dflash-b{block_size}"


def stand_in_paths(block_size: int = 8, models_dir=None, pair: str = DEFAULT_PAIR) -> tuple[Path, Path]:
    """(target, drafter) folders of the trained stand-in pair `pair` (block size 8 or 16)."""
    models_dir = Path(models_dir) if models_dir is not None else MODELS_DIR
    return models_dir / check_pair(pair), models_dir / drafter_dir(block_size, pair)


def load_pair(target_path, drafter_path, *, device="cpu", dtype=torch.float32):
    """The target and its drafter from checkpoint folders. The target runs absorbed attention (the
    verify kernel on a GPU) when its MLA widths are the verify contract's 512 + 64, else the naive
    per-head path (slower, and a step that cannot be captured in a CUDA graph)."""
    config = load_config(target_path)
    absorbable = config.absorbable
    if not absorbable:
        warnings.warn(f"{target_path}: kv_lora_rank {config.kv_lora_rank} + qk_rope_head_dim "
                      f"{config.qk_rope_head_dim} are not the verify kernel's {LATENT_DIM} + {ROPE_DIM}: "
                      "running the naive attention path", stacklevel=2)
    target = load_target(target_path, device=device, dtype=dtype, attention="absorbed" if absorbable else "naive",
                         attention_backend="auto")
    return target, load_drafter(drafter_path, target, device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# held-out prompts (data/corpus/heldout_prompts.jsonl: code of packages the pair never saw)

def _heldout_documents(path=None) -> list[dict]:
    return [json.loads(line) for line in Path(path or PROMPTS_PATH).read_text().splitlines()]


def _encoder(tokenizer_path):
    from .tokenizer import TOKENIZER_PATH, load_tokenizer
    tokenizer = load_tokenizer(tokenizer_path or TOKENIZER_PATH)
    return lambda text, tokens: np.asarray(tokenizer.encode(text).ids[:tokens], np.int64)


def load_prompts(count: int, prompt_tokens: int, *, tokenizer_path=None, path=None) -> list:
    """The first `count` committed held-out prompts, each cut to its first `prompt_tokens` tokens."""
    documents = _heldout_documents(path)
    if not 1 <= count <= len(documents):
        raise ValueError(f"count: expected 1..{len(documents)} prompts, got {count}")
    encode = _encoder(tokenizer_path)
    prompts = [encode(document["text"], prompt_tokens) for document in documents[:count]]
    if min(len(p) for p in prompts) < 2:
        raise ValueError(f"prompt_tokens: expected at least 2, got {prompt_tokens}")
    return prompts


def package_prompts(per_package: int, prompt_tokens: int, *, path=None, tokenizer_path=None,
                    encode=None) -> dict[str, list]:
    """{package: [int64 token arrays]}: the first `per_package` committed held-out prompts of each
    package, each cut to its first `prompt_tokens` tokens; encode(text, tokens) -> ids (default: the
    tokenizer at tokenizer_path, else the stand-in's). The one owner of "held-out prompts per package"."""
    encode = encode or _encoder(tokenizer_path)
    prompts: dict[str, list] = {}
    for document in _heldout_documents(path):
        chosen = prompts.setdefault(document["package"], [])
        if len(chosen) < per_package:
            chosen.append(encode(document["text"], prompt_tokens))
    return prompts


@dataclass
class PairWithPrompts:
    """A target, its drafter, and held-out prompts in their vocabulary (what notebooks 10 and 11 run)."""
    target: object
    drafter: object
    description: str                       # what the notebooks print: which pair, and why
    name: str                              # the rows' `pair` column
    stand_in: bool                         # the trained stand-in pair (False: a tiny random pair)
    packages: dict[str, list[np.ndarray]]  # {package: [int64 ids]}; "random" for a random pair

    @property
    def prompts(self) -> list[np.ndarray]:
        """Every package's prompts, packages interleaved (the first B mix the packages)."""
        groups = list(self.packages.values())
        return [group[i] for i in range(max(map(len, groups), default=0)) for group in groups if i < len(group)]


def pair_name(target_path, drafter_path) -> str:
    """The rows' `pair` column for a pair loaded from these folders: "<target folder>+<drafter folder>"."""
    return f"{Path(target_path).name}+{Path(drafter_path).name}"


def pair_with_prompts(block_size: int = 8, *, prompts_per_package: int = 1, prompt_tokens: int = 32, models_dir=None,
                      device="cpu", dtype=torch.float32, vocab: int = 64, seed: int = 0,
                      pair: str = DEFAULT_PAIR) -> PairWithPrompts:
    """The pair and its prompts, decided together so that they always agree: the trained stand-in
    pair of this block size with the committed held-out prompts (encoded by the target folder's
    tokenizer) when both checkpoints exist, else a tiny random pair (`vocab`) with random ids under
    the package name "random" (its acceptance numbers mean nothing, and the description says so).
    pair: which stand-in pair (STAND_IN_PAIRS); the rows' `pair` column names the one loaded."""
    prompts_per_package = check_positive_int("prompts_per_package", prompts_per_package)
    prompt_tokens = check_positive_int("prompt_tokens", prompt_tokens)
    target_path, drafter_path = stand_in_paths(block_size, models_dir, pair)
    if (target_path / "config.json").is_file() and (drafter_path / "config.json").is_file():
        target, drafter = load_pair(target_path, drafter_path, device=device, dtype=dtype)
        tokenizer = target_path / "tokenizer.json"
        packages = package_prompts(prompts_per_package, prompt_tokens,
                                   tokenizer_path=tokenizer if tokenizer.is_file() else None)
        target_vocab = target.config.vocab_size
        too_large = [name for name, group in packages.items() if any(p.max() >= target_vocab for p in group)]
        if too_large:
            raise ValueError(f"models_dir: the held-out prompts of {too_large} have ids >= {target_path.name}'s "
                             f"vocabulary {target_vocab} (a tokenizer of another pair?)")
        name = pair_name(target_path, drafter_path)
        return PairWithPrompts(target, drafter, f"stand-in pair {target_path.name} + {drafter_path.name}", name, True,
                               packages)
    target, drafter = random_pair(vocab=vocab, block_size=block_size, seed=seed, device=device, dtype=dtype)
    rng = np.random.default_rng(seed)
    packages = {"random": [rng.integers(0, vocab, size=prompt_tokens) for _ in range(2 * prompts_per_package)]}
    description = (f"tiny RANDOM pair (vocab {vocab}, block {block_size}) with random prompts: {target_path} or "
                   f"{drafter_path} has no checkpoint, so acceptance numbers mean nothing")
    return PairWithPrompts(target, drafter, description, f"random-v{vocab}-b{block_size}", False, packages)


def checkpoint_pair(target_path, drafter_path, *, tokenizer_path=None, tp: int = 1, prompts_per_package: int = 1,
                    prompt_tokens: int = 32, device=None, dtype=None, yarn_attention: str = "transformers"):
    """The real pair (or any pair in its formats) by path, for the notebooks (10, 11): (PairWithPrompts with
    the committed held-out prompts encoded by its tokenizer, the generate to call on it).

    tp == 1: both models in this process (a GPU in bf16 when there is one, else the CPU in float32);
    the returned generate is generate. tp > 1: `target` and `drafter` hold only their configs and
    the returned generate(target, drafter, prompts, **options) decodes on tp spawned ranks
    (generate_tp; the ranks load the pair on each call). A path without a checkpoint, or a
    tokenizer folder without a tokenizer, is a ValueError: there is no fallback to another pair.
    """
    from types import SimpleNamespace
    from .decode import generate
    from .decode_tp import check_paths, generate_tp
    from .tokenizer import load_text_tokenizer
    tp = check_positive_int("tp", tp)
    check_paths(target_path, drafter_path)
    tokenizer = load_text_tokenizer(tokenizer_path or target_path)
    gpu = torch.cuda.is_available()
    device = device or ("cuda" if gpu else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    packages = package_prompts(prompts_per_package, prompt_tokens,
                               encode=lambda text, tokens: np.asarray(tokenizer.encode(text)[:tokens], np.int64))
    if tp == 1:
        target = load_target(target_path, device=device, dtype=dtype)
        drafter = load_drafter(drafter_path, target, yarn_attention=yarn_attention)
        run = generate
    else:
        target = SimpleNamespace(config=load_config(target_path))
        drafter = SimpleNamespace(config=DFlashConfig.load(drafter_path, yarn_attention=yarn_attention))

        def run(_target, _drafter, prompts, **options):
            return generate_tp(target_path, drafter_path, prompts, tp=tp, device=device, dtype=dtype,
                               yarn_attention=yarn_attention, **options)
    name = pair_name(target_path, drafter_path)
    description = f"checkpoint pair {target_path} + {drafter_path} (TP={tp}, {device}, {str(dtype).removeprefix('torch.')})"
    return PairWithPrompts(target, drafter, description, name, True, packages), run
