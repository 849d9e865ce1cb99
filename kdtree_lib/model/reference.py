"""transformers' DeepseekV3ForCausalLM as the reference the target must equal (tests, notebook 08),
and an independent reference of z-lab's DFlash block forward with transformers' Qwen3 RoPE.

Builds a tiny random DeepseekV3 with the K2.6 switches (sigmoid noaux_tc routing, YaRN,
interleaved rope, one dense layer first; the MLA latent keeps K2.6's 512 + 64 widths, the verify
attention contract), writes it in the K2.6 checkpoint layout, and computes its logits for a
prefill and for a tree verify step. Two transformers details matter for a tree:
- its eager attention ignores a bool 4D mask; the mask must be additive float (0 / dtype min);
- `.to(bfloat16)` also casts the router's e_score_correction_bias, which must stay fp32.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.cache_utils import DynamicCache

from ..checks import to_numpy
from .checkpoint import save_checkpoint
from ..contracts import Tree, unpack_mask
from ..paths import REPO_ROOT
from ..tokenizer import KIMI_RESERVED_SPECIAL_TOKENS

CONFIG_DIR = REPO_ROOT / "data" / "configs"


def random_model(config: dict, *, seed: int = 0, std: float = 0.08) -> DeepseekV3ForCausalLM:
    """DeepseekV3ForCausalLM (fp32, eager attention) with random weights and router biases."""
    from ..pairs import transformers_kwargs
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**transformers_kwargs(config), attn_implementation="eager"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            elif "rotary_emb" not in name:
                tensor.copy_(std * torch.randn(tensor.shape, generator=generator))
    return model.eval()


def to_bfloat16(model: DeepseekV3ForCausalLM) -> DeepseekV3ForCausalLM:
    """model.to(bfloat16) with the routers' correction biases kept in fp32."""
    biases = {name: b.clone() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")}
    model = model.to(torch.bfloat16)
    for name, bias in biases.items():
        owner, attribute = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attribute, bias.to(model.device))
    return model


@torch.no_grad()
def prefill_logits(model, tokens) -> torch.Tensor:
    """float32 [B, T, V] logits of a causal forward over tokens [B, T]."""
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=model.device)
    return model(input_ids=tokens).logits.float()


@torch.no_grad()
def tree_logits(model, prompt, tree: Tree, b: int = 0) -> torch.Tensor:
    """float32 [N, V]: request b's tree verified after its prompt [P] (positions P + depth,
    attention to the whole prompt and to each node's ancestors)."""
    device = model.device
    prompt = torch.as_tensor(prompt, dtype=torch.long, device=device)[None]
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    nodes = tree.capacity
    ancestors = torch.as_tensor(unpack_mask(tree.mask, nodes)[b], device=device)           # (N, N)
    allowed = torch.cat([torch.ones(nodes, prompt.shape[1], dtype=torch.bool, device=device), ancestors], 1)
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    tokens = torch.as_tensor(to_numpy(tree.tokens)[b].astype(np.int64), device=device)[None]
    positions = prompt.shape[1] + torch.as_tensor(to_numpy(tree.depths)[b].astype(np.int64), device=device)[None]
    out = model(input_ids=tokens, position_ids=positions, attention_mask=additive[None, None],
                past_key_values=cache, use_cache=True)
    return out.logits[0].float()


def save_kimi_checkpoint(model: DeepseekV3ForCausalLM, config: dict, path, *, int4: bool):
    """model's weights in the K2.6 layout: wrapper config with text_config, `language_model.`
    prefix, 3 files + index, a vision tensor to skip, optionally INT4 routed experts."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # transformers stacks experts; checkpoints do not
            base = name.removesuffix(".gate_up_proj")
            for e, weight in enumerate(tensor):
                tensors[f"{base}.{e}.gate_proj.weight"], tensors[f"{base}.{e}.up_proj.weight"] = weight.chunk(2)
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix(".down_proj")
            tensors.update({f"{base}.{e}.down_proj.weight": weight for e, weight in enumerate(tensor)})
        elif "rotary_emb" not in name:
            tensors[name] = tensor
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": config, "vision_config": {"hidden_size": 4}}
    return save_checkpoint(path, wrapper, {name: t.detach().clone() for name, t in tensors.items()}, shards=3,
                           prefix="language_model.", quantize=(lambda name: ".experts." in name) if int4 else None)


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


# ----------------------------------------------------------------------------------------------
# a made-to-format real pair at tiny dims: K2.6's keys and layout, the real drafter's keys, Kimi's
# tokenizer files (what tests run the real formats on)

KIMI_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok")
DRAFTER_DIMS = dict(intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16)
TOKENIZER_MERGES = 64
TOKENIZER_TEXT = ("def forward(self, x):\n    return self.proj(x) + x\n\nclass Model:\n    def __init__(self):\n"
                  "        self.layers = []\n        for i in range(10):\n            self.layers.append(i)\n")


def kimi_text_config(**dims) -> dict:
    """K2.6's text_config (data/configs/kimi-k2.6.json), every key kept, at tiny_config's dims
    (and `dims`); its special ids moved into the tiny vocabulary as K2.6 places them after the
    base tokens. The quantization config is left to save_kimi_checkpoint(int4=True)."""
    from ..pairs import tiny_config
    text = dict(json.loads((CONFIG_DIR / "kimi-k2.6.json").read_text())["text_config"])
    text.pop("quantization_config")
    tiny = tiny_config(**dims)
    text.update({key: tiny[key] for key in KIMI_DIMS})
    base = text["vocab_size"] - KIMI_RESERVED_SPECIAL_TOKENS
    text.update(bos_token_id=base, eos_token_id=base + 1, pad_token_id=text["vocab_size"] - 1)
    return text


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
    from ..tokenizer import save_tiktoken
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
    from ..dflash import DFlashConfig, DFlashDrafter, write_safetensors
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


def save_random_kimi_checkpoint(path, text_config: dict, *, seed: int = 0, std: float = 0.02) -> Path:
    """A checkpoint in K2.6's layout (wrapper config, `language_model.` prefix, one file per layer
    and one for the rest, index) with random weights at any dims, the real ones included: the
    routed experts are written as random INT4 codes with bf16 scales (weights of about std), so no
    float expert is ever built; the rest bf16 normal(std), norms 1, router biases 0 (fp32)."""
    from .checkpoint import INT4_QUANTIZATION_CONFIG, checkpoint_name
    from .config import ModelConfig
    from .model import Experts, Transformer
    from safetensors.torch import save_file
    config = ModelConfig.from_dict(text_config)
    with torch.device("meta"):
        model = Transformer(config)
    generator = torch.Generator().manual_seed(seed)
    files: dict[str, dict[str, torch.Tensor]] = {}

    def file_of(name: str) -> dict:
        layer = name.split(".")[1] if name.startswith("layers.") else "rest"
        return files.setdefault(layer, {})

    experts = {name for name, module in model.named_modules() if isinstance(module, Experts)}
    shapes = {"gate_proj": (config.moe_intermediate_size, config.hidden_size),
              "up_proj": (config.moe_intermediate_size, config.hidden_size),
              "down_proj": (config.hidden_size, config.moe_intermediate_size)}
    uniform_code_std = 4.6  # of q uniform in -8..7
    for name in sorted(experts):
        for expert in range(config.n_routed_experts):
            for projection, (out, inputs) in shapes.items():
                base = f"model.{name}.{expert}.{projection}.weight"
                file_of(name).update({
                    f"{base}_packed": torch.randint(-2 ** 31, 2 ** 31 - 1, (out, inputs // 8), dtype=torch.int32,
                                                    generator=generator),
                    f"{base}_scale": torch.full((out, inputs // 32), std / uniform_code_std, dtype=torch.bfloat16),
                    f"{base}_shape": torch.tensor([out, inputs], dtype=torch.int64)})
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.rsplit(".", 1)[0] in experts:
            continue
        if name.endswith("e_score_correction_bias"):
            value = torch.zeros(tensor.shape, dtype=torch.float32)
        elif name.endswith("norm.weight"):
            value = torch.ones(tensor.shape, dtype=torch.bfloat16)
        else:
            value = (std * torch.randn(tensor.shape, generator=generator)).to(torch.bfloat16)
        file_of(name)[checkpoint_name(name, config)] = value
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = dict(text_config, quantization_config=INT4_QUANTIZATION_CONFIG)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    (path / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")
    weight_map, total = {}, 0
    for i, tensors in enumerate(files.values()):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file({f"language_model.{name}": t.contiguous() for name, t in tensors.items()}, str(path / file))
        weight_map.update(dict.fromkeys((f"language_model.{name}" for name in tensors), file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return path
