"""The pair's references and the made-to-format real pair, at the pair's level (they need the target
and the drafter both): an independent reference of z-lab's DFlash block forward with transformers'
Qwen3 RoPE, and a real pair at tiny dims on disk (K2.6's keys and layout from model.reference, the
real drafter's config keys and z-lab's weight names, Kimi's tokenizer files).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from .dflash import DFlashConfig, DFlashDrafter, write_safetensors
from .model.reference import CONFIG_DIR, kimi_text_config, random_model, save_kimi_checkpoint
from .tokenizer import KIMI_RESERVED_SPECIAL_TOKENS, save_tiktoken

DRAFTER_DIMS = dict(intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16)
TOKENIZER_MERGES = 64
TOKENIZER_TEXT = ("def forward(self, x):\n    return self.proj(x) + x\n\nclass Model:\n    def __init__(self):\n"
                  "        self.layers = []\n        for i in range(10):\n            self.layers.append(i)\n")



def qwen3_rope(drafter_config: dict, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 (N, head_dim) of transformers' Qwen3RotaryEmbedding for a drafter's
    config.json dict (rope_parameters or rope_scaling + rope_theta; YaRN's attention factor applied)."""
    raw = dict(drafter_config)
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {"rope_type": "default"})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    config = Qwen3Config(hidden_size=raw["hidden_size"], num_attention_heads=raw["num_attention_heads"],
                         head_dim=raw["head_dim"], rope_parameters=rope,
                         max_position_embeddings=raw.get("max_position_embeddings", 4096))
    positions = torch.as_tensor(positions, dtype=torch.long)
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


@torch.no_grad()
def zlab_block_logits(drafter, features, bonus, rope=None) -> torch.Tensor:
    """float32 [D, V]: z-lab's DFlash computation for one request, written out. The context and the
    block are concatenated before the k/v projections, RoPE over positions 0..C+Q-1 (queries take
    the last Q) with rotate_half, attention over everything (a sliding window by position where a
    layer has one). rope(positions) -> (cos, sin) (N, d); default: transformers' Qwen3 RoPE of the
    drafter's config."""
    c = drafter.config
    q_len, ctx_len = c.block_size, features.shape[0]
    ctx = drafter.hidden_norm(drafter.fc(features))
    block = torch.tensor([bonus] + [c.mask_token_id] * (q_len - 1))
    x = drafter.target.embed(block)
    pos = torch.arange(ctx_len + q_len)
    cos, sin = (rope or (lambda p: qwen3_rope(c.to_dict(), p)))(pos)

    def rotate(t, cos, sin):  # t (N, heads, d)
        half = t.shape[-1] // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], -1)
        return t * cos[:, None] + rotated * sin[:, None]

    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = rotate(a.q_norm(a.q_proj(h).view(q_len, c.num_attention_heads, c.head_dim)), cos[-q_len:], sin[-q_len:])
        both = torch.cat([ctx, h])
        k = rotate(a.k_norm(a.k_proj(both).view(-1, c.num_key_value_heads, c.head_dim)), cos, sin)
        v = a.v_proj(both).view(-1, c.num_key_value_heads, c.head_dim)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * c.head_dim ** -0.5
        window = c.window(i)
        if window is not None:
            diff = pos[-q_len:, None] - pos[None, :]
            scores = scores.masked_fill(~((diff < window) & (-diff < window)), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q_len, -1)
        x = x + a.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.target.lm_head(drafter.norm(x))[1:].float()



def kimi_dflash_config(target_config: dict, target_layer_ids=(1, 2), **dims) -> dict:
    """The real drafter's config.json (data/configs/kimi-k2.6-dflash.json), every key kept, at small
    dims for `target_config`: its hidden size and vocabulary, the mask id where K2.6's lies
    (second-to-last), YaRN as the real one."""
    raw = json.loads((CONFIG_DIR / "kimi-k2.6-dflash.json").read_text())
    raw.update(DRAFTER_DIMS | dims, hidden_size=target_config["hidden_size"], vocab_size=target_config["vocab_size"],
               num_target_layers=target_config["num_hidden_layers"])
    raw["dflash_config"] = {"mask_token_id": target_config["vocab_size"] - 2, "target_layer_ids": list(target_layer_ids)}
    return raw


def tiny_tiktoken_ranks(merges: int = TOKENIZER_MERGES, text: str = TOKENIZER_TEXT) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then `merges` merges learned greedily on `text`."""
    ranks = {bytes([i]): i for i in range(256)}
    words = [[bytes([b]) for b in piece.encode()] for piece in text.split(" ")]
    while len(ranks) < 256 + merges:
        counts = {}
        for word in words:
            for pair in zip(word, word[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            raise ValueError(f"text: too short for {merges} merges")
        best = max(counts, key=lambda pair: (counts[pair], pair))
        ranks[best[0] + best[1]] = len(ranks)
        words = [_merge(word, best) for word in words]
    return ranks


def _merge(word: list[bytes], pair: tuple[bytes, bytes]) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def save_kimi_pair(folder, *, seed: int = 0, std: float = 0.3) -> tuple[Path, Path]:
    """(target, drafter) folders of a made-to-format real pair at tiny dims: the target in K2.6's
    layout (text_config with K2.6's keys, `language_model.` prefix, 3 files + index, INT4 routed
    experts) with Kimi's tiktoken.model + tokenizer_config.json beside it, and a DFlash drafter with
    the real drafter's config keys (YaRN) and z-lab's weight names. Random weights."""
    folder = Path(folder)
    ranks = tiny_tiktoken_ranks()
    vocab = len(ranks) + KIMI_RESERVED_SPECIAL_TOKENS
    text = kimi_text_config(vocab_size=vocab, num_hidden_layers=4)
    target = save_kimi_checkpoint(random_model(text, seed=seed, std=std), text, folder / "target", int4=True)
    base = len(ranks)
    save_tiktoken(target, ranks, {base: "[BOS]", base + 1: "[EOS]", base + 2: "<|im_end|>", base + 3: "<|im_user|>"},
                  bos="[BOS]", eos="[EOS]")
    return target, save_random_drafter(folder / "drafter", kimi_dflash_config(text), seed=seed + 1, std=0.2)


def save_random_drafter(path, raw: dict, *, seed: int = 0, std: float = 0.02) -> Path:
    """A DFlash checkpoint with random bf16 weights for the config.json dict `raw` (written as is):
    norms 1 + std/2 noise, projections normal(std); built tensor by tensor (a real-shape drafter
    never exists in float32)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(DFlashConfig.from_dict(raw))
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in drafter.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator)
        state[f"model.{name}"] = (1 + std / 2 * noise if name.endswith("norm.weight") else std * noise).to(torch.bfloat16)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_safetensors(state, path, shard_bytes=4 << 30)
    return path
