"""Napkin math at the real shapes: parameters and bytes per component, KV bytes per token, and the
cost of one verify step's attention in the absorbed and the naive MLA forms (notebook 08)."""
from __future__ import annotations

from .config import ModelConfig
from ..paths import BF16_BYTES


def int4_bytes_per_weight(group_size: int) -> float:
    """Pack-quantized INT4: half a byte per weight plus one bf16 scale per group."""
    return 0.5 + BF16_BYTES / group_size


def parameter_table(config: ModelConfig) -> list[dict]:
    """One row per component: parameters per instance, instances, total, and bytes as stored
    (bf16, or INT4 for the routed experts of a quantized checkpoint)."""
    c = config
    heads, d = c.num_attention_heads, c.hidden_size
    moe, dense = len(c.moe_layers), c.num_hidden_layers - len(c.moe_layers)
    expert = 3 * d * c.moe_intermediate_size
    expert_bytes = int4_bytes_per_weight(c.quantization.group_size) if c.quantization else BF16_BYTES
    rows = [
        ("embed_tokens", c.vocab_size * d, 1, BF16_BYTES),
        ("attention: q_a + q_a_norm", d * c.q_lora_rank + c.q_lora_rank, c.num_hidden_layers, BF16_BYTES),
        ("attention: q_b", c.q_lora_rank * heads * c.qk_head_dim, c.num_hidden_layers, BF16_BYTES),
        ("attention: kv_a + kv_a_norm", d * c.cache_dim + c.kv_lora_rank, c.num_hidden_layers, BF16_BYTES),
        ("attention: kv_b", c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim), c.num_hidden_layers, BF16_BYTES),
        ("attention: o_proj", heads * c.v_head_dim * d, c.num_hidden_layers, BF16_BYTES),
        ("layer norms", 2 * d, c.num_hidden_layers, BF16_BYTES),
        ("dense MLP", 3 * d * c.intermediate_size, dense, BF16_BYTES),
        ("router (+ fp32 bias)", c.n_routed_experts * d, moe, BF16_BYTES),
        ("shared experts", c.n_shared_experts * expert, moe, BF16_BYTES),
        ("routed experts", c.n_routed_experts * expert, moe, expert_bytes),
        ("final norm", d, 1, BF16_BYTES),
        ("lm_head", c.vocab_size * d, 1, BF16_BYTES),
    ]
    return [{"component": name, "params_each": each, "instances": count, "params": each * count,
             "bytes": each * count * per} for name, each, count, per in rows]


def active_parameters(config: ModelConfig) -> int:
    """Parameters one token touches: everything but the routed experts it is not sent to."""
    total = sum(row["params"] for row in parameter_table(config))
    unused = config.n_routed_experts - config.num_experts_per_tok
    return total - len(config.moe_layers) * unused * 3 * config.hidden_size * config.moe_intermediate_size


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = BF16_BYTES) -> dict:
    """Cache bytes per token over all layers: the absorbed latent entry vs per-head K and V."""
    c = config
    return {"absorbed (c_kv | k_rope)": c.num_hidden_layers * c.cache_dim * bytes_per_value,
            "per-head K and V": c.num_hidden_layers * c.num_attention_heads
            * (c.qk_head_dim + c.v_head_dim) * bytes_per_value}


def verify_attention_cost(config: ModelConfig, context: int, nodes: int, *, heads: int | None = None) -> dict:
    """FLOPs and bytes of one layer's attention for one request's verify step of `nodes` tree nodes
    after `context` cached tokens, in three forms (bf16 operands; weights counted once):

    absorbed     : q·W_UK, scores and values in the 512-wide latent space, W_UV on the output;
    naive/expand : per-head K and V expanded from the latent cache with kv_b (transformers' way);
    naive/cached : per-head K and V kept in the cache (no expansion, 9x the cache bytes).
    """
    c = config
    h = heads or c.num_attention_heads
    keys = context + nodes
    latent, rope, nope, v = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    w_kv_b = h * (nope + v) * latent * BF16_BYTES
    latent_cache = keys * c.cache_dim * BF16_BYTES
    per_head_cache = keys * h * (nope + rope + v) * BF16_BYTES
    attend = 2 * nodes * h * keys * (nope + rope + v)              # scores + values, per-head widths
    return {
        "absorbed": {
            "flops": 2 * nodes * h * keys * (latent + rope) + 2 * nodes * h * keys * latent
            + 2 * nodes * h * latent * (nope + v),
            "bytes": latent_cache + w_kv_b + nodes * h * (2 * latent + rope) * BF16_BYTES},
        "naive/expand": {
            "flops": 2 * keys * latent * h * (nope + v) + attend,
            "bytes": latent_cache + w_kv_b + 2 * per_head_cache + nodes * h * (nope + rope + v) * BF16_BYTES},
        "naive/cached": {
            "flops": attend,
            "bytes": per_head_cache + nodes * h * (nope + rope + v) * BF16_BYTES},
    }


def compute_bound_nodes(config: ModelConfig, context: int, ridge_flop_per_byte: float, *, heads: int | None = None,
                        max_nodes: int = 1024) -> int | None:
    """The smallest tree (nodes N) whose absorbed verify attention does at least `ridge_flop_per_byte`
    FLOPs per byte (the GPU's ridge point: from there it is compute-bound); None within max_nodes."""
    for nodes in range(1, max_nodes + 1):
        cost = verify_attention_cost(config, context, nodes, heads=heads)["absorbed"]
        if cost["flops"] / cost["bytes"] >= ridge_flop_per_byte:
            return nodes
    return None
