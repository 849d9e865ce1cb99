"""The verify-attention reference: absorbed == naive, tree == linear sequences, and bad input."""
import numpy as np
import pytest
import torch

from kdtree_lib.contracts import root_to_node_paths, tree_from_parents
from kdtree_lib.draft_topk import draft_topk
from kdtree_lib.tree_build import build_tree
from kdtree_lib.precision import rounding_bound
from kdtree_lib.verify_attn import (CACHE_DIM, DEFAULT_SCALE, LATENT_DIM, ROPE_DIM, absorb_query, key_mask,
                                    project_output, verify_attention, verify_attention_naive)


def random_case(batch=2, heads=3, budget=9, lengths=(5, 11), slack=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    tree = build_tree(draft_topk(rng.normal(size=(batch, 4, 40)).astype(np.float32) * 2, budget), budget)
    nodes = tree.capacity
    lengths = np.array(lengths, np.int32)
    slots = int(lengths.max()) + nodes + slack
    cache = torch.randn(batch, slots, CACHE_DIM, generator=gen).to(dtype)
    q_latent = torch.randn(batch, nodes, heads, LATENT_DIM, generator=gen).to(dtype) * 0.05
    q_rope = torch.randn(batch, nodes, heads, ROPE_DIM, generator=gen).to(dtype)
    return q_latent, q_rope, cache, lengths, tree


def test_scale_is_k26s():
    assert DEFAULT_SCALE == pytest.approx(0.1446796, abs=1e-7)


def test_absorbed_equals_naive_per_head_form():
    gen = torch.Generator().manual_seed(1)
    _, q_rope, cache, lengths, tree = random_case(heads=4)
    batch, nodes, heads = q_rope.shape[:3]
    q_nope = torch.randn(batch, nodes, heads, 128, generator=gen)
    w_uk = torch.randn(heads, 128, LATENT_DIM, generator=gen) * 0.05
    w_uv = torch.randn(heads, 128, LATENT_DIM, generator=gen) * 0.05
    o_latent, lse = verify_attention(absorb_query(q_nope, w_uk), q_rope, cache, lengths, tree)
    naive_out, naive_lse = verify_attention_naive(q_nope, q_rope, cache, lengths, tree, w_uk=w_uk, w_uv=w_uv)
    terms = CACHE_DIM + q_nope.shape[-1]  # the score and output sums of either form, both float32
    torch.testing.assert_close(project_output(o_latent, w_uv), naive_out, rtol=0,
                               atol=2 * rounding_bound(np.float32, terms=terms, magnitude=float(naive_out.abs().max())))
    torch.testing.assert_close(lse, naive_lse, rtol=0,
                               atol=2 * rounding_bound(np.float32, terms=terms, magnitude=float(naive_lse.abs().max())))


def linear_sequence_attention(q_latent, q_rope, keys, scale):
    """The last position of a causal linear sequence: plain softmax attention over `keys` (L, 576)."""
    scores = (keys[:, :LATENT_DIM] @ q_latent + keys[:, LATENT_DIM:] @ q_rope) * scale
    weights = np.exp(scores - scores.max())
    return weights @ keys[:, :LATENT_DIM] / weights.sum(), np.log(weights.sum()) + scores.max()


def test_tree_attention_equals_each_root_to_node_sequence():
    q_latent, q_rope, cache, lengths, tree = random_case(seed=3)
    out, lse = verify_attention(q_latent.numpy(), q_rope.numpy(), cache.numpy(), lengths, tree)
    assert isinstance(out, np.ndarray) and out.shape == q_latent.shape and lse.shape == q_latent.shape[:3]
    kv = cache.numpy().astype(np.float64)
    for b in range(tree.batch):
        start = lengths[b]
        for node, path in enumerate(root_to_node_paths(tree, b)):
            keys = np.concatenate([kv[b, :start], kv[b, start + np.array(path)]])  # prefix, then the path
            for h in range(q_latent.shape[2]):
                expected, expected_lse = linear_sequence_attention(
                    q_latent[b, node, h].double().numpy(), q_rope[b, node, h].double().numpy(), keys, DEFAULT_SCALE)
                terms = CACHE_DIM + len(keys)  # a score's sum, then the softmax-weighted sum over the keys
                np.testing.assert_allclose(out[b, node, h], expected, rtol=0, atol=rounding_bound(
                    np.float32, terms=terms, magnitude=np.abs(expected).max()))
                assert abs(lse[b, node, h] - expected_lse) <= rounding_bound(np.float32, terms=terms,
                                                                             magnitude=abs(expected_lse))


def test_padding_nodes_and_slots_past_the_tree_are_not_attended():
    tree = tree_from_parents(np.array([[-1, 0, 1, -1]]), np.array([[4, 5, 6, 0]]))
    allowed = key_mask(np.array([2]), tree, 9)[0].numpy()
    expected = np.array([
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0],  # padding: the prefix and itself
    ], bool)
    np.testing.assert_array_equal(allowed, expected)
    # poisoning the slots nobody may see changes nothing
    q_latent, q_rope, cache, lengths, tree = random_case(seed=5)
    out, lse = verify_attention(q_latent, q_rope, cache, lengths, tree)
    poisoned = cache.clone()
    for b in range(tree.batch):
        poisoned[b, lengths[b] + tree.n_nodes[b]:] = 1e4
    out2, lse2 = verify_attention(q_latent, q_rope, poisoned, lengths, tree)
    live = torch.as_tensor(np.arange(tree.capacity)[None, :] < tree.n_nodes[:, None])
    torch.testing.assert_close(out[live], out2[live])
    torch.testing.assert_close(lse[live], lse2[live])


def test_bf16_inputs_give_bf16_output_close_to_fp32():
    q_latent, q_rope, cache, lengths, tree = random_case(seed=2)
    out32, lse32 = verify_attention(q_latent, q_rope, cache, lengths, tree)
    q16, r16, c16 = (x.to(torch.bfloat16) for x in (q_latent, q_rope, cache))
    out16, lse16 = verify_attention(q16, r16, c16, lengths, tree, backend="torch")
    assert out16.dtype == torch.bfloat16 and lse16.dtype == torch.float32
    assert (out16.float() - out32).abs().max() < 0.05
    assert (lse16 - lse32).abs().max() < 0.05


def test_bad_input_names_the_argument():
    q_latent, q_rope, cache, lengths, tree = random_case()
    args = dict(q_latent=q_latent, q_rope=q_rope, cache=cache, lengths=lengths, tree=tree)
    other_tree = build_tree(draft_topk(np.zeros((2, 4, 40), np.float32), 3), 3)
    cases = [
        (dict(q_latent=q_latent.int()), "q_latent: expected dtype"),
        (dict(q_latent=q_latent[..., :500]), "q_latent: expected shape"),
        (dict(q_rope=q_rope.to(torch.bfloat16)), "q_rope: expected dtype float32"),
        (dict(q_rope=q_rope[:, :, :2]), "q_rope: expected shape"),
        (dict(cache=cache[..., :512]), "cache: expected shape"),
        (dict(cache=cache[:1]), "cache: expected shape"),
        (dict(lengths=lengths.astype(np.float32)), "lengths: expected dtype"),
        (dict(lengths=np.array([5, cache.shape[1]], np.int32)), "lengths: each must be >= 0"),
        (dict(lengths=np.array([-1, 0], np.int32)), "lengths: each must be >= 0"),
        (dict(tree=other_tree), "tree: expected batch 2 and 10 nodes"),
        (dict(tree=None), "tree: expected a Tree"),
        (dict(scale=float("nan")), "scale: expected a positive finite number"),
        (dict(scale=0.0), "scale: expected a positive finite number"),
        (dict(backend="cupy"), "backend: 'cupy' needs"),
    ]
    for change, match in cases:
        kwargs = {**args, **change}
        with pytest.raises(ValueError, match=match):
            verify_attention(kwargs.pop("q_latent"), kwargs.pop("q_rope"), kwargs.pop("cache"),
                             kwargs.pop("lengths"), kwargs.pop("tree"), **kwargs)
