"""Small, deterministic problems for the reference notebooks: a toy target model, a toy drafter, a
toy speculative decode loop, random MLA inputs with rotary positions, and a backend smoke check.

- `ToyTarget` gives next-token logits for any prefix (a random table indexed by the last `context`
  tokens), so the target's exact sampling distribution can be computed (`token_marginals`) and
  compared with what speculative decoding emits.
- `generate` runs autoregressive, chain (DFlash) or tree (DDTree) decoding with the library's
  draft_topk -> build_tree -> posterior_tokens -> accept, the same steps as the real loop.
- `mla_problem` and `linear_sequence_attention` show tree attention equal to running each
  root-to-node path as an ordinary causal sequence, positions included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .checks import check_positive_int, to_numpy
from .contracts import AcceptResult, root_to_node_paths, Tree, tree_from_parents
from .tree_accept import accept, compact_cache, posterior_tokens
from .draft_topk import draft_topk
from .tree_build import build_tree
from .verify_attn import DEFAULT_SCALE, LATENT_DIM, ROPE_DIM, absorb_query, verify_attention

METHODS = ("ar", "chain", "tree", "unverified")


# ----------------------------------------------------------------------------------------------
# a toy target and drafter

class ToyTarget:
    """Next-token logits from the last `context` tokens through a fixed random table [V^context, V]."""

    def __init__(self, vocab: int = 8, *, context: int = 2, sharpness: float = 1.5, seed: int = 0):
        self.vocab = check_positive_int("vocab", vocab)
        self.context = check_positive_int("context", context)
        if self.vocab ** self.context > 1 << 20:
            raise ValueError(f"vocab, context: the table has vocab**context = {self.vocab ** self.context} rows; "
                             "keep it at most 2**20")
        self.table = sharpness * np.random.default_rng(seed).standard_normal((self.vocab ** self.context, self.vocab))

    def logits(self, prefix) -> np.ndarray:
        """float64 [V]: logits of the token after `prefix` (a sequence of token ids, left-padded with 0)."""
        return self.table[self._row(prefix)]

    def node_logits(self, prefix, tree: Tree, b: int = 0) -> np.ndarray:
        """float64 [N, V]: the logits after prefix + each node's path (the root is prefix's last token).

        Padding nodes get the root's logits (their posterior is never read)."""
        tokens = to_numpy(tree.tokens)[b]
        out = np.repeat(self.logits(prefix)[None], tree.capacity, axis=0)  # (N, V)
        for node, path in enumerate(root_to_node_paths(tree, b)):
            out[node] = self.logits(list(prefix) + [int(tokens[i]) for i in path[1:]])
        return out

    def probs(self, prefix, temperature: float) -> np.ndarray:
        """float64 [V]: the target's sampling distribution (one-hot on the argmax at temperature 0)."""
        return _softmax(self.logits(prefix), temperature)

    def _row(self, prefix) -> int:
        last = [0] * self.context + [int(t) for t in prefix]
        row = 0
        for token in last[-self.context:]:
            if not 0 <= token < self.vocab:
                raise ValueError(f"prefix: token {token} outside the vocabulary 0..{self.vocab - 1}")
            row = row * self.vocab + token
        return row


class ToyDrafter:
    """Drafts D positions in one go, as a block-diffusion drafter does: position d's logits are the
    target's logits along its own greedy continuation, blurred by noise that grows with d."""

    def __init__(self, target: ToyTarget, *, noise: float = 1.0, seed: int = 0):
        if not noise >= 0:
            raise ValueError(f"noise: expected a number >= 0, got {noise!r}")
        self.target, self.noise = target, noise
        self.rng = np.random.default_rng(seed)

    def logits(self, prefix, depth: int) -> np.ndarray:
        """float32 [depth, V]: draft logits for the next `depth` positions after `prefix`."""
        sequence = list(prefix)
        rows = []
        for d in range(check_positive_int("depth", depth)):
            exact = self.target.logits(sequence)
            rows.append(exact + self.noise * math.sqrt(d + 1) * self.rng.standard_normal(exact.shape))
            sequence.append(int(np.argmax(exact)))
        return np.asarray(rows, np.float32)


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    if temperature == 0:
        return np.eye(len(logits))[int(np.argmax(logits))]
    scaled = logits / temperature
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


# ----------------------------------------------------------------------------------------------
# a toy decode loop, and the exact distribution it must reproduce

@dataclass
class ToyStep:
    """One round of speculative decoding, kept for plotting (batch of one request)."""
    prefix: list             # committed tokens, the last one being the tree's root
    tree: Tree
    posterior: np.ndarray    # int32 [1, N]
    result: AcceptResult


def generate(target: ToyTarget, drafter: ToyDrafter, prompt, max_new_tokens: int, *, method: str = "tree",
             budget: int = 8, depth: int = 4, top_k: int = 4, temperature: float = 0.0,
             rng: np.random.Generator | None = None, keep_steps: bool = False):
    """Decode `max_new_tokens` tokens after `prompt`: (tokens, tokens emitted per round, steps).

    method: "ar" one target token per round; "chain" the drafter's top-1 path (DFlash); "tree" the
    best-first tree (DDTree); "unverified" the drafter's top-1 path emitted without asking the
    target, a deliberately wrong baseline that shows the distribution checks are not vacuous.
    At T > 0 every target token is a fresh sample from the target at that node, so "ar", "chain"
    and "tree" all emit the target's own sampling distribution.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if not len(prompt):
        raise ValueError("prompt: expected at least one token (the first root)")
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    rng = rng if rng is not None else np.random.default_rng()
    sequence, per_round, steps = [int(t) for t in prompt], [], []
    while len(sequence) - len(prompt) < max_new_tokens:
        if method == "ar":
            emitted = [int(rng.choice(target.vocab, p=target.probs(sequence, temperature)))]
        elif method == "unverified":
            emitted = [int(t) for t in np.argmax(drafter.logits(sequence, depth), axis=-1)]
        else:
            draft = draft_topk(drafter.logits(sequence, depth)[None], top_k, backend="numpy")
            tree = build_tree(draft, budget, root=np.array([sequence[-1]], np.int32), mode=method, backend="numpy")
            posterior = posterior_tokens(target.node_logits(sequence, tree)[None], temperature=temperature,
                                         generator=rng)
            result = accept(tree, posterior, backend="numpy")
            accepted = result.path[0, :int(result.n_accepted[0])]
            emitted = [int(tree.tokens[0, node]) for node in accepted[1:]] + [int(result.bonus[0])]
            if keep_steps:
                steps.append(ToyStep(list(sequence), tree, posterior, result))
        per_round.append(len(emitted))
        sequence += emitted
    return sequence[len(prompt):len(prompt) + max_new_tokens], per_round, steps


def token_marginals(target: ToyTarget, prompt, n_tokens: int, temperature: float) -> np.ndarray:
    """float64 [n_tokens, V]: exact probability of each token at each new position under the target's
    sampling, by propagating the distribution over the last `context` tokens."""
    states = {tuple(([0] * target.context + [int(t) for t in prompt])[-target.context:]): 1.0}
    marginals = np.zeros((check_positive_int("n_tokens", n_tokens), target.vocab))
    for position in range(n_tokens):
        following: dict[tuple, float] = {}
        for state, mass in states.items():
            probs = target.probs(state, temperature)
            for token in np.flatnonzero(probs):
                marginals[position, token] += mass * probs[token]
                key = (state + (int(token),))[-target.context:]
                following[key] = following.get(key, 0.0) + mass * probs[token]
        states = following
    return marginals


def empirical_marginals(samples, vocab: int) -> np.ndarray:
    """float64 [T, V]: how often each token appears at each position of equal-length samples [S, T]."""
    samples = np.asarray(samples)
    return np.stack([np.bincount(samples[:, t], minlength=vocab) / len(samples) for t in range(samples.shape[1])])


def total_variation(p, q) -> np.ndarray:
    """½ Σ |p − q| over the last axis."""
    return 0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum(axis=-1)


def total_variation_bound(n_samples: int, vocab: int, *, failure_probability: float = 1e-6) -> float:
    """A TV distance that an empirical distribution of n samples exceeds with probability below
    `failure_probability`: E[TV] ≤ ½·sqrt((V−1)/n) (Cauchy–Schwarz) plus McDiarmid's sqrt(ln(1/δ)/2n)."""
    return 0.5 * math.sqrt((vocab - 1) / n_samples) + math.sqrt(math.log(1 / failure_probability) / (2 * n_samples))


# ----------------------------------------------------------------------------------------------
# MLA verify attention: random inputs with rotary positions, and the linear-sequence view

def rope(x, positions, *, base: float = 10000.0):
    """Rotary embedding (rotate-half form) of x [..., 64] at integer positions broadcastable to x[..., 0]."""
    import torch

    half = x.shape[-1] // 2
    frequencies = base ** (-torch.arange(half, dtype=torch.float64) / half)            # (32,)
    angles = torch.as_tensor(positions, dtype=torch.float64)[..., None] * frequencies  # (..., 32)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@dataclass
class MLAProblem:
    """Random absorbed-MLA inputs for one verify step (float32, torch), plus their unrotated parts."""
    tree: Tree
    q_nope: object      # [B, N, H, d_nope]
    q_rope: object      # [B, N, H, 64], rotated at position lengths + depth
    cache: object       # [B, L_max, 576], committed slots then tree node i at lengths + i (k_rope rotated)
    lengths: np.ndarray  # int32 [B]
    w_uk: object        # [H, d_nope, 512]
    w_uv: object        # [H, d_v, 512]
    q_rope_raw: object  # [B, N, H, 64] before rotation
    k_rope_raw: object  # [B, L_max, 64] before rotation

    @property
    def q_latent(self):
        return absorb_query(self.q_nope, self.w_uk)  # (B, N, H, 512)


def mla_problem(tree: Tree, *, heads: int = 4, committed: int = 16, d_nope: int = 128, d_v: int = 128,
                seed: int = 0) -> MLAProblem:
    """Random q, cache and kv_b_proj halves for `tree`, every request with `committed` cached tokens.

    Scales keep the softmax neither flat nor one-hot. Rotary positions follow docs/DESIGN.md §3:
    committed token t at position t, tree node i at position committed + depth(i).
    """
    import torch

    heads, d_nope, d_v = (check_positive_int(n, v) for n, v in (("heads", heads), ("d_nope", d_nope), ("d_v", d_v)))
    if not isinstance(committed, int) or committed < 0:
        raise ValueError(f"committed: expected an int >= 0, got {committed!r}")
    generator = torch.Generator().manual_seed(seed)
    tree = tree.to_numpy()
    batch, nodes = tree.batch, tree.capacity
    slots = committed + nodes

    def normal(*shape, std=1.0):
        return torch.randn(*shape, generator=generator) * std

    q_rope_raw = normal(batch, nodes, heads, ROPE_DIM)
    k_rope_raw = normal(batch, slots, ROPE_DIM)
    key_positions = np.concatenate([np.broadcast_to(np.arange(committed), (batch, committed)),
                                    committed + tree.depths], axis=1)                   # (B, L_max)
    cache = torch.cat([normal(batch, slots, LATENT_DIM), rope(k_rope_raw, key_positions)], dim=-1)  # (B, L, 576)
    return MLAProblem(tree=tree, q_nope=normal(batch, nodes, heads, d_nope, std=d_nope ** -0.25),
                      q_rope=rope(q_rope_raw, committed + tree.depths[:, :, None]),
                      cache=cache, lengths=np.full(batch, committed, np.int32),
                      w_uk=normal(heads, d_nope, LATENT_DIM, std=(d_nope * LATENT_DIM) ** -0.25),
                      w_uv=normal(heads, d_v, LATENT_DIM, std=LATENT_DIM ** -0.5),
                      q_rope_raw=q_rope_raw, k_rope_raw=k_rope_raw)


def causal_attention(q_latent, q_rope, kv, *, scale: float = DEFAULT_SCALE):
    """Plain causal absorbed-MLA attention of one linear sequence: the T_q queries are the last T_q
    positions of kv [T, 576]. q_latent [T_q, H, 512], q_rope [T_q, H, 64] -> out [T_q, H, 512]."""
    import torch

    length, queries = kv.shape[0], q_latent.shape[0]
    scores = (torch.einsum("qhc,tc->qht", q_latent, kv[:, :LATENT_DIM])
              + torch.einsum("qhr,tr->qht", q_rope, kv[:, LATENT_DIM:])) * scale  # (T_q, H, T)
    query_positions = torch.arange(length - queries, length)
    causal = torch.arange(length)[None, :] <= query_positions[:, None]             # (T_q, T)
    scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
    return torch.einsum("qht,tc->qhc", torch.softmax(scores, dim=-1), kv[:, :LATENT_DIM])


def linear_sequence_attention(problem: MLAProblem, *, scale: float = DEFAULT_SCALE):
    """out [B, N, H, 512]: each node's output computed without the tree, by running its root-to-node
    path as an ordinary sequence (committed tokens, then the path) with a causal mask and rotary
    positions 0, 1, 2, … along that sequence."""
    import torch

    tree, q_latent = problem.tree, problem.q_latent
    out = torch.zeros_like(q_latent)                                                 # (B, N, H, 512)
    committed = problem.lengths
    for b in range(tree.batch):
        for node, path in enumerate(root_to_node_paths(tree, b)):
            slots = list(range(committed[b])) + [committed[b] + i for i in path]
            positions = torch.arange(len(slots))
            kv = torch.cat([problem.cache[b, slots, :LATENT_DIM],
                            rope(problem.k_rope_raw[b, slots], positions)], dim=-1)  # (T, 576)
            q_rope = rope(problem.q_rope_raw[b, node][None], positions[-1:][:, None])  # (1, H, 64)
            out[b, node] = causal_attention(q_latent[b, node][None], q_rope, kv, scale=scale)[0]
    return out


def flat_sequence_tree(tree: Tree) -> Tree:
    """The tree's nodes read as one flat sequence in pop order (node i's parent is i − 1): the mask a
    verify step would use if it forgot the tree, i.e. causal over pop order. A known-wrong variant."""
    tree = tree.to_numpy()
    parents = np.where(np.arange(tree.capacity)[None, :] < tree.n_nodes[:, None],
                       np.arange(-1, tree.capacity - 1)[None, :], -1).astype(np.int32)
    return tree_from_parents(parents, tree.tokens, log_weights=tree.log_weights)


# ----------------------------------------------------------------------------------------------
# which backends run each entry point here

def backend_matrix(backends=("numpy", "torch", "cupy")) -> dict:
    """{(entry point, backend): status} from running each entry point once on tiny inputs.

    Status: "ok" (ran and agrees with the reference), "n/a" (the entry point has no such backend),
    "no GPU" (cupy without a CUDA device), or "error: …" (ran and failed or disagreed).
    """
    from .backend import cuda_available

    statuses = {}
    for name, run_case in _ENTRY_POINT_CASES.items():
        reference = run_case("numpy", _host)
        for backend in backends:
            if backend == "cupy" and not cuda_available():
                statuses[(name, backend)] = "no GPU"
                continue
            try:
                result = run_case(backend, _host if backend != "cupy" else _gpu)
                agrees = all(np.allclose(to_numpy(got).astype(np.float64), to_numpy(want).astype(np.float64),
                                         atol=2e-2, rtol=2e-2) for got, want in zip(result, reference))
                statuses[(name, backend)] = "ok" if agrees else "error: disagrees with the numpy reference"
            except ValueError as err:
                statuses[(name, backend)] = "n/a" if "not available here" in str(err) else f"error: {err}"
            except Exception as err:  # a kernel not built yet, a driver problem: shown, not raised
                statuses[(name, backend)] = f"error: {type(err).__name__}: {err}"
    return statuses


def _host(x):
    return x


def _gpu(x):
    import torch
    return torch.as_tensor(x, device="cuda")


def _gpu_tree(tree: Tree, place) -> Tree:
    return Tree(**{k: (v if k == "max_depth" else place(v)) for k, v in vars(tree).items()})


def _tiny_tree():
    logits = np.random.default_rng(0).standard_normal((2, 3, 11)).astype(np.float32)
    return logits, build_tree(draft_topk(logits, 3, backend="numpy"), 6, backend="numpy")


def _case_draft_topk(backend, place):
    draft = draft_topk(place(_tiny_tree()[0]), 3, backend=backend)
    return draft.logp, draft.ids


def _case_build_tree(backend, place):
    reference = draft_topk(_tiny_tree()[0], 3, backend="numpy")
    draft = type(reference)(logp=place(reference.logp), ids=place(reference.ids))
    tree = build_tree(draft, 6, backend=backend)
    return tree.tokens, tree.parents, tree.mask


def _case_accept(backend, place):
    tree = _tiny_tree()[1]
    posterior = np.where(np.arange(tree.capacity) % 2 == 0, tree.tokens[:, [1]], 5).astype(np.int32)
    result = accept(_gpu_tree(tree, place), place(posterior), backend=backend)
    return result.path, result.n_accepted, result.bonus


def _case_compact_cache(backend, place):
    tree = _tiny_tree()[1]
    result = accept(tree, tree.tokens[:, [1, 2, 3, 4, 5, 6, 0]], backend="numpy")
    cache = place(np.arange(2 * 12 * 4, dtype=np.float32).reshape(2, 12, 4))
    lengths = place(np.array([3, 4], np.int32))
    device_result = type(result)(**{k: place(v) for k, v in vars(result).items()})
    new_lengths = compact_cache([cache], lengths, device_result, backend=backend)
    return cache, new_lengths


def _case_verify_attention(backend, place):
    import torch

    problem = mla_problem(_tiny_tree()[1], heads=2, committed=5, d_nope=16, d_v=16)
    dtype = torch.bfloat16 if place is _gpu else torch.float32
    out, lse = verify_attention(*(place(x.to(dtype)) for x in (problem.q_latent, problem.q_rope, problem.cache)),
                                place(problem.lengths), _gpu_tree(problem.tree, place), backend=backend)
    return out, lse


_ENTRY_POINT_CASES = {"draft_topk": _case_draft_topk, "build_tree": _case_build_tree, "accept": _case_accept,
                      "compact_cache": _case_compact_cache, "verify_attention": _case_verify_attention}
