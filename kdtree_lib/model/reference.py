"""transformers' DeepseekV3ForCausalLM as the reference the target must equal (tests, notebook 08),
and the target's checkpoints in K2.6's format at any dims. The pair's references (z-lab's DFlash
block, the made-to-format real pair on disk) are kdtree_lib.pair_reference's: this module is about
the target alone.

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
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.cache_utils import DynamicCache

from ..checks import to_numpy
from .checkpoint import save_checkpoint
from .config import tiny_config, transformers_kwargs
from ..contracts import Tree, unpack_mask
from ..paths import REPO_ROOT
from ..tokenizer import KIMI_RESERVED_SPECIAL_TOKENS

CONFIG_DIR = REPO_ROOT / "data" / "configs"


def random_model(config: dict, *, seed: int = 0, std: float = 0.08) -> DeepseekV3ForCausalLM:
    """DeepseekV3ForCausalLM (fp32, eager attention) with random weights and router biases."""
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


def kimi_tensors(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """model's tensors under K2.6's checkpoint names (routed experts one tensor per expert), unprefixed."""
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
    return tensors


def save_kimi_checkpoint(model: DeepseekV3ForCausalLM, config: dict, path, *, int4: bool):
    """model's weights in the K2.6 layout: wrapper config with text_config, `language_model.`
    prefix, 3 files + index, a vision tensor to skip, optionally INT4 routed experts."""
    tensors = kimi_tensors(model)
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": config, "vision_config": {"hidden_size": 4}}
    return save_checkpoint(path, wrapper, {name: t.detach().clone() for name, t in tensors.items()}, shards=3,
                           prefix="language_model.", quantize=(lambda name: ".experts." in name) if int4 else None)


# ----------------------------------------------------------------------------------------------
# the target in K2.6's format at tiny dims (pair_reference.save_kimi_pair adds the drafter and Kimi's
# tokenizer files: what tests run the real formats on)

KIMI_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok")
def kimi_text_config(**dims) -> dict:
    """K2.6's text_config (data/configs/kimi-k2.6.json), every key kept, at tiny_config's dims
    (and `dims`); its special ids moved into the tiny vocabulary as K2.6 places them after the
    base tokens. The quantization config is left to save_kimi_checkpoint(int4=True)."""
    text = dict(json.loads((CONFIG_DIR / "kimi-k2.6.json").read_text())["text_config"])
    text.pop("quantization_config")
    tiny = tiny_config(**dims)
    text.update({key: tiny[key] for key in KIMI_DIMS})
    base = text["vocab_size"] - KIMI_RESERVED_SPECIAL_TOKENS
    text.update(bos_token_id=base, eos_token_id=base + 1, pad_token_id=text["vocab_size"] - 1)
    return text


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
