"""Acceptance-vs-budget sweeps from an offline oracle, and the live runs that check it.

At T=0 a DDTree round that starts with committed context y[:t+1] (root y[t]) accepts the longest
prefix of the target's greedy continuation y[t+1:] that is a path of the tree, plus the root. The
tree depends only on the drafter's top-k for that context, and decoding is lossless, so the
contexts a live decode visits are prefixes of the target's greedy sequence. Record once per
prompt the greedy sequence and the drafter's top-k at every position (`record_oracle`); then, for
any budget, depth or top-k, build the trees of all positions in one batched call, read off the
accepted length at each position, and chase the rounds: t -> t + accepted(t). That equals the live
decode's acceptance exactly (tests/test_sweep_live.py runs both) and costs milliseconds on the GPU
kernels. It is exact for budgets up to the recorded top-k (a tree of b nodes never uses a rank
>= b), so record k_max = the largest budget swept (or the vocabulary). Exact means: the same
arithmetic up to rounding. In fp32 the recording's one-node verifies and a live decode's tree
verifies agree to the last bits that matter; in bf16 they round differently, and a drafter
near-tie may then order a tree differently at a rare position.

At T>0 the accepted length is random. `record_sampled` follows one trajectory sampled from the
target and stores, at every position, the tree of the largest budget and the target's probability
of each node's token given its parent's path; a smaller budget's tree is a prefix of it (pop
order). `monte_carlo_acceptance` then samples the walk at any budget <= that and chases rounds
along the recorded trajectory. Its one approximation: a replayed round continues from the recorded
context, where a live round continues from the tokens it sampled itself (both are samples of the
target), so it is compared with live runs (`live_rows`) rather than assumed.

The oracle records also say where a tree's extra tokens come from: `depth_structure` splits each accepted
path into the drafter's rank-0 nodes and their siblings, per depth (`depth_rows` -> acceptance_depth.csv;
the box kit writes the real pair's to box_acceptance_depth.csv).

Rows (`oracle_rows`, `live_rows`, `monte_carlo_rows`) go to data/results/acceptance.csv:
    python -m kdtree_lib.acceptance --block-sizes 8 16 --prompts-per-package 8 --new-tokens 256   # on a GPU
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import cli, results
from .checks import check_array, check_positive_int, framework, to_numpy
from .decode import Decoder, check_pair, decoder_capacity, generate, prompt_list, resolve_backend
from .pairs import pair_with_prompts, stand_in_paths
from .tree_accept import accept
from .contracts import DraftTopK, tree_nodes
from .tree_build import build_tree

TOPIC = "acceptance"
BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class OracleRecord:
    """One prompt's recording: the drafter's top-k at each position and the target's greedy tokens.

    draft: DraftTopK [T, D, K] where row t is the draft made with root tokens[t];
    tokens: int32 [T + D + 1] the target's greedy sequence from the first root on (tokens[0] is the
    last prompt token), so the continuation of position t is tokens[t+1 : t+1+D].
    """
    draft: DraftTopK
    tokens: np.ndarray

    def to_torch(self, device) -> "OracleRecord":
        """The record as torch tensors on `device` (on a GPU the replay runs on the kernels)."""
        import torch
        return OracleRecord(DraftTopK(*(torch.as_tensor(to_numpy(x), device=device) for x in (self.draft.logp,
                                                                                             self.draft.ids))),
                            torch.as_tensor(to_numpy(self.tokens), device=device))


def accepted_at_every_position(record: OracleRecord, budget: int, *, depth: int | None = None,
                               topk: int | None = None, mode: str = "tree",
                               backend: str = "auto") -> np.ndarray:
    """int32 [T]: the number of nodes (root included) a round starting at position t accepts."""
    logp, ids, tokens = _sliced(record, depth, topk)
    positions, depth_limit, _ = logp.shape
    tree = build_tree(DraftTopK(logp, ids), budget, root=tokens[:positions], mode=mode, backend=backend)
    # The greedy target's token at a node of depth d on the greedy path is tokens[t + d + 1]; nodes
    # off that path are never reached by the walk, so their posterior does not matter.
    if framework(tree.depths) == "torch":  # a record on the GPU: trees, posterior and walk stay there
        continuation = tokens[1:].unfold(0, depth_limit + 1, 1)[:positions]                   # (T, D+1)
        posterior = continuation.gather(1, tree.depths.long())
    else:
        tokens = to_numpy(tokens)
        continuation = np.lib.stride_tricks.sliding_window_view(tokens[1:], depth_limit + 1)[:positions]
        posterior = np.take_along_axis(continuation, to_numpy(tree.depths).astype(np.int64), axis=1)
    return to_numpy(accept(tree, posterior, backend=backend).n_accepted).astype(np.int32)


def round_lengths(accepted: np.ndarray, n_new_tokens: int | None = None) -> list[int]:
    """Chase the rounds from position 0: the accepted length of each round a live decode makes.

    Each round commits `accepted[t]` tokens (the root and the accepted drafts) and moves the root
    to t + accepted[t]; it stops when the record runs out or `n_new_tokens` are generated.
    """
    limit = len(accepted) if n_new_tokens is None else min(len(accepted), n_new_tokens)
    lengths, t = [], 0
    while t < limit:
        lengths.append(int(accepted[t]))
        t += int(accepted[t])
    return lengths


def mean_acceptance(records: list[OracleRecord], budget: int, **options) -> float:
    """Mean tokens per round over all rounds of all recorded prompts."""
    rounds = [n for record in records
              for n in round_lengths(accepted_at_every_position(record, budget, **options))]
    if not rounds:
        raise ValueError("records: no positions recorded")
    return float(np.mean(rounds))


def _sliced(record: OracleRecord, depth, topk):
    if not isinstance(record, OracleRecord):
        raise ValueError(f"record: expected an OracleRecord, got {type(record).__name__}")
    logp = check_array("record.draft.logp", record.draft.logp, dtypes="float32", ndim=3)
    positions, depth_limit, k = logp.shape
    check_array("record.draft.ids", record.draft.ids, dtypes="int32", shape=(positions, depth_limit, k))
    check_array("record.tokens", record.tokens, dtypes=("int32", "int64"), shape=(positions + depth_limit + 1,))
    depth = depth_limit if depth is None else check_positive_int("depth", depth)
    topk = k if topk is None else check_positive_int("topk", topk)
    if depth > depth_limit:
        raise ValueError(f"depth: at most the recorded depth {depth_limit}, got {depth}")
    if topk > k:
        raise ValueError(f"topk: at most the recorded top-k {k}, got {topk}")
    return (_contiguous(logp[:, :depth, :topk]), _contiguous(record.draft.ids[:, :depth, :topk]),
            _contiguous(record.tokens[: positions + depth + 1]))


def _contiguous(x):
    return x.contiguous() if framework(x) == "torch" else np.ascontiguousarray(x)


# ----------------------------------------------------------------------------------------------
# recording from the live models

def record_oracle(target, drafter, prompt_ids, n_tokens: int, k_max: int, *, backend: str = "auto") -> list[OracleRecord]:
    """One OracleRecord per prompt: n_tokens positions of the target's greedy run, the drafter's
    top-k_max at each (the run goes D tokens further, for the continuations).

    The run is the decode loop itself (kdtree_lib.decode.Decoder) with a one-node tree per round and
    the drafter called every round, so the features and drafts are computed as a live decode does.
    """
    n_tokens, k_max = check_positive_int("n_tokens", n_tokens), check_positive_int("k_max", k_max)
    depth = drafter.config.draft_depth
    decoder, prompts = _recorder(target, drafter, prompt_ids, n_tokens + depth, method="ar", budget=1,
                                 topk=min(k_max, target.config.vocab_size), temperature=0.0, backend=backend)
    logp, ids = [], []
    for position in range(n_tokens + depth):
        draft = decoder.step().draft
        if position < n_tokens:  # copies: a prepared step's outputs are its buffers, refilled next round
            logp.append(draft.logp.clone() if framework(draft.logp) == "torch" else draft.logp.copy())
            ids.append(draft.ids.clone() if framework(draft.ids) == "torch" else draft.ids.copy())
    logp, ids = to_numpy(_stack(logp)), to_numpy(_stack(ids))                               # (B, T, D, K)
    tokens = decoder.out[:, :n_tokens + depth].cpu().numpy()
    return [OracleRecord(DraftTopK(np.ascontiguousarray(logp[b]), np.ascontiguousarray(ids[b])),
                         np.concatenate([[prompt[-1]], tokens[b]]).astype(np.int32))
            for b, prompt in enumerate(prompts)]


def record_oracle_tp(target_path, drafter_path, prompt_ids, n_tokens: int, k_max: int, *, tp: int = 2,
                     device: str = "cpu", dtype: torch.dtype = torch.float32, yarn_attention: str = "transformers",
                     drafter_placement: str = "sharded") -> list[OracleRecord]:
    """record_oracle over the checkpoint pair by path, the target sharded on `tp` spawned ranks (gloo on
    CPUs; "cuda": rank r on cuda:r, NCCL) and the drafter placed as decode_tp.generate_tp places it. Every
    rank records in lockstep (the collectives hand every rank the same logits, so the same greedy tokens
    and drafts); the ranks' tokens are compared once at the end, and rank 0's records are returned."""
    from .decode_tp import check_paths
    from .model import TensorParallel, launch
    tp = check_positive_int("tp", tp)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    check_paths(target_path, drafter_path)
    if drafter_path is None:
        raise ValueError("drafter_path: the oracle records the drafter's top-k; expected its folder")
    args = (str(target_path), str(drafter_path), prompt_ids, n_tokens, k_max, device, dtype, yarn_attention,
            drafter_placement)
    if tp == 1:
        return oracle_rank(TensorParallel(), *args)
    return launch(oracle_rank, tp, *args, backend="nccl" if device == "cuda" else "gloo")


def oracle_rank(tp, target_path: str, drafter_path: str, prompt_ids, n_tokens: int, k_max: int, device: str,
                dtype: torch.dtype, yarn_attention: str, drafter_placement: str) -> list[OracleRecord]:
    """One rank of record_oracle_tp: load its shard and the drafter, record, check the ranks agree."""
    from .dflash import load_drafter
    from .model import load_target
    on_gpu = device == "cuda"
    where = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if not on_gpu and tp.size > 1:  # gloo ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // tp.size))
    target = load_target(target_path, device=where, dtype=dtype, tp_group=tp.group)
    drafter = load_drafter(drafter_path, target, yarn_attention=yarn_attention,
                           placement=drafter_placement if tp.size > 1 else "replicated")
    with torch.no_grad():
        records = record_oracle(target, drafter, prompt_ids, n_tokens, k_max)
    if tp.size > 1:
        import torch.distributed as dist
        everyone = [None] * tp.size
        dist.all_gather_object(everyone, [r.tokens.tolist() for r in records], group=tp.group)
        parted = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
        if parted:
            raise RuntimeError(f"ranks {parted} recorded other tokens than rank 0: the ranks left lockstep")
    return records


@dataclass
class SampledRecord:
    """One prompt at T > 0: along a trajectory sampled from the target, the tree of `budget` nodes
    built at each position and the target's probability of each node's token given its parent's path.

    parents, tokens int32 [T, N] (N = budget + 1, pop order; parent -1 for the root and padding);
    node_probs float32 [T, N]: p_T(token of node i | path to its parent), 1 at the root, 0 for padding.
    """
    parents: np.ndarray
    tokens: np.ndarray
    node_probs: np.ndarray
    temperature: float

    @property
    def budget(self) -> int:
        return int(self.parents.shape[1]) - 1


def record_sampled(target, drafter, prompt_ids, n_tokens: int, *, budget: int, temperature: float, seed: int = 0,
                   backend: str = "auto") -> list[SampledRecord]:
    """One SampledRecord per prompt: n_tokens positions of a trajectory sampled at `temperature`."""
    n_tokens = check_positive_int("n_tokens", n_tokens)
    if not temperature > 0:
        raise ValueError(f"temperature: expected a number > 0 (use record_oracle at T = 0), got {temperature!r}")
    decoder, prompts = _recorder(target, drafter, prompt_ids, n_tokens, method="ddtree", budget=budget,
                                 temperature=float(temperature), backend=backend, walk=False, seed=seed)
    parents, tokens, probs = [], [], []
    for _ in range(n_tokens):
        step = decoder.step()
        device = step.logits.device
        node_parents = torch.as_tensor(step.tree.parents, device=device).long()            # (B, N)
        node_tokens = torch.as_tensor(step.tree.tokens, device=device).long()
        vocab = step.logits.shape[-1]
        p = torch.softmax(step.logits / temperature, dim=-1).flatten(1)                    # (B, N*V)
        node_p = p.gather(1, node_parents.clamp(min=0) * vocab + node_tokens)
        node_p = torch.where(node_parents >= 0, node_p, 0.0)
        node_p[:, 0] = 1.0
        parents.append(node_parents)
        tokens.append(node_tokens)
        probs.append(node_p)
    parents, tokens = (torch.stack(x, dim=1).int().cpu().numpy() for x in (parents, tokens))   # (B, T, N)
    probs = torch.stack(probs, dim=1).float().cpu().numpy()
    return [SampledRecord(parents[b], tokens[b], probs[b], float(temperature)) for b in range(len(prompts))]


def _recorder(target, drafter, prompt_ids, steps: int, *, backend: str, seed: int = 0, **settings):
    """A Decoder that drafts every round, reset to the prompts for `steps` rounds."""
    check_pair(target, drafter)
    prompts = prompt_list(prompt_ids, target.config.vocab_size)
    depth = drafter.config.draft_depth
    nodes = 1 if settings["method"] == "ar" else settings["budget"] + 1
    decoder = Decoder(target, drafter, batch=len(prompts), capacity=decoder_capacity(prompts, steps, nodes, depth),
                      backend=resolve_backend(backend, target), draft=True, **settings)
    decoder.reset(prompts, max_new_tokens=steps, seed=seed)
    return decoder, prompts


def _stack(items):
    return torch.stack(items, dim=1) if framework(items[0]) == "torch" else np.stack(items, axis=1)


# ----------------------------------------------------------------------------------------------
# Monte-Carlo replay at T > 0

def sampled_accepted(record: SampledRecord, budget: int, n_samples: int, rng: np.random.Generator) -> np.ndarray:
    """int32 [T, S]: sampled accepted lengths (root included) of a round at each position, budget <= record's.

    The walk at node v picks child c with probability node_probs[c] (children of v in the budget's
    tree, disjoint events since their tokens differ) and stops otherwise.
    """
    budget = check_positive_int("budget", budget)
    if budget > record.budget:
        raise ValueError(f"budget: at most the recorded budget {record.budget}, got {budget}")
    nodes = tree_nodes(budget)
    parents = record.parents[:, :nodes].astype(np.int64)                                       # (T, N)
    probs = record.node_probs[:, :nodes].astype(np.float64)
    high = _cumulative_within_siblings(parents, probs)                                        # (T, N)
    low = high - probs
    positions, nodes = parents.shape
    node = np.zeros((positions, n_samples), np.int64)
    length = np.ones((positions, n_samples), np.int32)
    walking = np.ones((positions, n_samples), bool)
    while walking.any():
        u = rng.random((positions, n_samples))[..., None]
        hit = ((parents[:, None, :] == node[..., None]) & (low[:, None, :] <= u) & (u < high[:, None, :])
               & walking[..., None])                                                           # (T, S, N)
        found = hit.any(axis=-1)
        node = np.where(found, hit.argmax(axis=-1), node)
        length += found
        walking &= found
    return length


def _cumulative_within_siblings(parents: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """For each node, the sum of its own and its earlier siblings' probabilities (pop order)."""
    order = np.argsort(parents, axis=1, kind="stable")                 # siblings grouped, pop order inside
    sorted_parents = np.take_along_axis(parents, order, axis=1)
    sorted_probs = np.take_along_axis(probs, order, axis=1)
    running = np.cumsum(sorted_probs, axis=1)
    starts = np.ones(sorted_parents.shape, bool)
    starts[:, 1:] = sorted_parents[:, 1:] != sorted_parents[:, :-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(parents.shape[1]), 0), axis=1)
    before_group = np.take_along_axis(running - sorted_probs, first, axis=1)
    result = np.empty_like(probs)
    np.put_along_axis(result, order, running - before_group, axis=1)
    return result


def monte_carlo_acceptance(records: list[SampledRecord], budget: int, *, n_samples: int = 64,
                           seed: int = 0) -> tuple[float, float, list[int]]:
    """(mean tokens per round, its standard error over the samples, every sampled round's length)."""
    rng = np.random.default_rng(seed)
    per_sample = [[] for _ in range(n_samples)]
    for record in records:
        accepted = sampled_accepted(record, budget, n_samples, rng)
        for s in range(n_samples):
            per_sample[s] += round_lengths(accepted[:, s])
    means = np.array([np.mean(r) for r in per_sample])
    return float(means.mean()), float(means.std(ddof=1) / np.sqrt(n_samples)), [n for r in per_sample for n in r]


# ----------------------------------------------------------------------------------------------
# where a tree's extra tokens come from: the drafter's rank-0 nodes against their siblings, per depth

DEPTH_TOPIC = "acceptance_depth"
DEPTH_BUDGETS = (4, 8, 16, 32, 64)  # budgets whose accepted paths are split by default (the box's likely choices)
DEPTH_COUNTS = ("reached", "rank0", "sibling", "after_rank0_reached", "after_rank0_accepted", "after_sibling_reached",
                "after_sibling_accepted")  # per-depth counts, a JSON list each in a depth row (depth 1 first)
DEPTH_TOTALS = ("rounds", "tokens", "prefix_tokens", "sibling_tokens", "chain_rounds", "chain_tokens")


@dataclass(frozen=True)
class DepthStructure:
    """What the accepted paths of oracle records show at one budget, per depth d = 1..D, as counts (so
    the structures of several packages add up: `combine`).

    reached[d]: rounds whose accepted path got to depth d − 1 (so could accept a node at depth d);
    rank0[d] / sibling[d]: rounds accepting, at depth d, the drafter's top-1 token of that depth or
    another of its top-k (a sibling); after_rank0[d] / after_sibling[d]: (rounds that accepted a
    rank-0 / sibling node at depth d − 1, how many of them accepted a node at depth d).
    tokens = rounds + prefix_tokens + sibling_tokens: tokens committed (root included), split into the
    nodes of each path's all-rank-0 prefix and the nodes at or after its first sibling; chain_tokens
    over chain_rounds: the DFlash chain's (the top-1 path of `chain_depth` drafts) on the same records."""
    budget: int
    chain_depth: int
    rounds: int
    reached: dict[int, int]
    rank0: dict[int, int]
    sibling: dict[int, int]
    after_rank0: dict[int, tuple[int, int]]
    after_sibling: dict[int, tuple[int, int]]
    tokens: int
    prefix_tokens: int
    sibling_tokens: int
    chain_rounds: int
    chain_tokens: int

    @property
    def tree_mean(self) -> float:
        """Tokens per round (root included)."""
        return self.tokens / self.rounds

    @property
    def prefix_mean(self) -> float:
        return self.prefix_tokens / self.rounds

    @property
    def sibling_mean(self) -> float:
        return self.sibling_tokens / self.rounds

    @property
    def chain_mean(self) -> float:
        return self.chain_tokens / self.chain_rounds

    @property
    def gain_over_chain(self) -> float:
        """The tree's tokens per round over the chain's (tree_mean − chain_mean)."""
        return self.tree_mean - self.chain_mean

    @property
    def sibling_share_of_gain(self) -> float:
        """sibling_mean over the tree's gain over the chain: above 1 when the tree's rank-0 prefix accepts
        less than the chain does (nodes spent on siblings that the chain spends on deeper rank-0 drafts,
        as the stand-in shows at budgets 8 to 64)."""
        gain = self.gain_over_chain
        return self.sibling_mean / gain if gain > 0 else float("nan")

    def gain_line(self) -> str:
        """One line: the tree's tokens per round split, the chain's, and the siblings' share of the gain."""
        gain = self.gain_over_chain
        return (f"budget {self.budget}, {self.rounds} rounds: tokens per round {self.tree_mean:.3f} = 1 (root) + "
                f"{self.prefix_mean:.3f} (all-rank-0 prefix) + {self.sibling_mean:.3f} (at or after the first sibling); "
                f"chain of {self.chain_depth}: {self.chain_mean:.3f}; siblings give "
                + (f"{self.sibling_share_of_gain:.0%} of the tree's gain over the chain ({gain:+.3f} tokens per round)"
                   if gain > 0 else f"{self.sibling_mean:.3f} tokens, and the tree accepts no more per round than the chain "
                                    f"here ({gain:+.3f})"))

    def lines(self) -> list[str]:
        """Printable: gain_line, then per depth the acceptance of rank-0 nodes and siblings, and after each."""
        out = [self.gain_line()]
        for d in sorted(self.reached):
            if not self.reached[d]:
                continue
            def rate(pair):
                return f"{pair[1] / pair[0]:.0%} of {pair[0]}" if pair[0] else "none"
            after = (f"; after a rank-0 node at depth {d - 1}: {rate(self.after_rank0[d])}, "
                     f"after a sibling: {rate(self.after_sibling[d])}") if d > 1 else ""
            out.append(f"  depth {d}: of {self.reached[d]} rounds reaching it, rank 0 accepted "
                       f"{self.rank0[d] / self.reached[d]:.0%}, a sibling {self.sibling[d] / self.reached[d]:.0%}{after}")
        return out

    def counts(self) -> dict:
        """The row's cells: totals, and each per-depth count as a JSON list (depth 1 first)."""
        depths = sorted(self.reached)
        lists = {"reached": self.reached, "rank0": self.rank0, "sibling": self.sibling,
                 "after_rank0_reached": {d: v[0] for d, v in self.after_rank0.items()},
                 "after_rank0_accepted": {d: v[1] for d, v in self.after_rank0.items()},
                 "after_sibling_reached": {d: v[0] for d, v in self.after_sibling.items()},
                 "after_sibling_accepted": {d: v[1] for d, v in self.after_sibling.items()}}
        return {"budget": self.budget, "chain_depth": self.chain_depth, "depths": len(depths),
                **{name: getattr(self, name) for name in DEPTH_TOTALS},
                **{name: json.dumps([int(lists[name][d]) for d in depths]) for name in DEPTH_COUNTS}}

    @classmethod
    def from_row(cls, row: dict) -> "DepthStructure":
        """The structure a depth row holds (DepthStructure.counts' cells); a ValueError names a missing cell."""
        missing = [name for name in ("budget", "chain_depth", *DEPTH_TOTALS, *DEPTH_COUNTS) if row.get(name) in (None, "")]
        if missing:
            raise ValueError(f"rows: a depth row lacks {missing} (a row of acceptance.depth_rows expected)")
        lists = {name: json.loads(row[name]) for name in DEPTH_COUNTS}
        depths = range(1, len(lists["reached"]) + 1)
        per_depth = {name: dict(zip(depths, map(int, values))) for name, values in lists.items()}
        return cls(int(float(row["budget"])), int(float(row["chain_depth"])), int(float(row["rounds"])),
                   per_depth["reached"], per_depth["rank0"], per_depth["sibling"],
                   {d: (per_depth["after_rank0_reached"][d], per_depth["after_rank0_accepted"][d]) for d in depths},
                   {d: (per_depth["after_sibling_reached"][d], per_depth["after_sibling_accepted"][d]) for d in depths},
                   *(int(float(row[name])) for name in DEPTH_TOTALS[1:]))

    @staticmethod
    def combine(structures: list["DepthStructure"]) -> "DepthStructure":
        """The structure of several record sets at one budget and chain depth (e.g. the packages): counts add."""
        first = structures[0]
        if any((s.budget, s.chain_depth, sorted(s.reached)) != (first.budget, first.chain_depth, sorted(first.reached))
               for s in structures):
            raise ValueError("structures: expected one budget, chain depth and draft depth")
        def add(name):
            return {d: sum(getattr(s, name)[d] for s in structures) for d in first.reached}
        def add_pairs(name):
            return {d: tuple(sum(getattr(s, name)[d][i] for s in structures) for i in (0, 1)) for d in first.reached}
        return DepthStructure(first.budget, first.chain_depth, sum(s.rounds for s in structures), add("reached"),
                              add("rank0"), add("sibling"), add_pairs("after_rank0"), add_pairs("after_sibling"),
                              *(sum(getattr(s, name) for s in structures) for name in DEPTH_TOTALS[1:]))


def depth_structure(records: list[OracleRecord], budget: int, *, chain_depth: int,
                    backend: str = "numpy") -> DepthStructure:
    """The DepthStructure of oracle records (record_oracle, T = 0) at `budget`, over the rounds a live
    decode makes (round_lengths chased from position 0 of each record); a node's rank is the place of
    its token in the drafter's top-k at its depth (DFlash drafts every depth at once)."""
    if not records:
        raise ValueError("records: expected at least one oracle record")
    depth_limit = int(records[0].draft.logp.shape[1])
    zero = {d: 0 for d in range(1, depth_limit + 1)}
    reached, rank0, sibling = dict(zero), dict(zero), dict(zero)
    after = {"rank0": {d: [0, 0] for d in zero}, "sibling": {d: [0, 0] for d in zero}}
    tokens_total = prefix_total = sibling_total = chain_rounds = chain_tokens = rounds = 0
    for record in records:
        logp, ids, tokens = (to_numpy(x) for x in (record.draft.logp, record.draft.ids, record.tokens))
        positions = logp.shape[0]
        tree = build_tree(DraftTopK(logp, ids), budget, root=tokens[:positions], backend=backend)
        depths, node_tokens = to_numpy(tree.depths).astype(np.int64), to_numpy(tree.tokens)
        continuation = np.lib.stride_tricks.sliding_window_view(tokens[1:], depth_limit + 1)[:positions]
        result = accept(tree, np.take_along_axis(continuation, depths, axis=1).astype(np.int32), backend=backend)
        path, n_accepted = to_numpy(result.path), to_numpy(result.n_accepted)
        chain = round_lengths(accepted_at_every_position(record, min(chain_depth, depth_limit), mode="chain",
                                                         backend=backend))
        chain_rounds, chain_tokens = chain_rounds + len(chain), chain_tokens + sum(chain)
        t = 0
        for length in round_lengths(n_accepted):
            kinds = []  # per accepted depth 1..length-1: "rank0" or "sibling"
            for d in range(1, length):
                token = node_tokens[t, path[t, d]]
                kinds.append("rank0" if token == ids[t, d - 1, 0] else "sibling")
            for d in range(1, depth_limit + 1):
                if d - 1 >= length:  # the path stopped before depth d − 1
                    break
                reached[d] += 1
                accepted_here = d < length
                if accepted_here:
                    (rank0 if kinds[d - 1] == "rank0" else sibling)[d] += 1
                if d >= 2:
                    counter = after[kinds[d - 2]][d]
                    counter[0] += 1
                    counter[1] += int(accepted_here)
            first_sibling = kinds.index("sibling") if "sibling" in kinds else len(kinds)
            rounds += 1
            tokens_total += length
            prefix_total += first_sibling
            sibling_total += len(kinds) - first_sibling
            t += length
    return DepthStructure(budget, chain_depth, rounds, reached, rank0, sibling,
                          {d: tuple(v) for d, v in after["rank0"].items()},
                          {d: tuple(v) for d, v in after["sibling"].items()},
                          tokens_total, prefix_total, sibling_total, chain_rounds, chain_tokens)


def depth_rows(records: list[OracleRecord], budgets=DEPTH_BUDGETS, *, package: str, block_size: int,
               pair: str = "", n_new_tokens: int | None = None, progress: bool = True) -> list[dict]:
    """One row per budget (at most the recorded top-k): the depth structure of one package's records as
    counts (DepthStructure.counts), beside its means; the columns acceptance rows are selected by
    (source "oracle", mode "tree", T = 0, prompts, new_tokens), so largest_measurement picks them the same way."""
    k = int(records[0].draft.logp.shape[-1]) if records else 0
    rows = []
    for budget in _progress([b for b in budgets if b <= k], f"depth {package} b{block_size}", progress):
        s = depth_structure(records, budget, chain_depth=block_size - 1)
        rows.append({"source": "oracle", "mode": "tree", "temperature": 0.0, "package": package,
                     "block_size": block_size, "pair": pair, "prompts": len(records), "new_tokens": n_new_tokens or "",
                     **s.counts(), "tree_mean": s.tree_mean, "prefix_mean": s.prefix_mean,
                     "sibling_mean": s.sibling_mean, "chain_mean": s.chain_mean,
                     "sibling_share_of_gain": s.sibling_share_of_gain})
    return rows


def depth_structures(rows: list[dict], **criteria) -> dict[int, DepthStructure]:
    """{budget: DepthStructure} of the biggest measurement among depth rows (largest_measurement) matching
    criteria, its packages combined; {} without rows."""
    picked = largest_measurement(rows, source="oracle", mode="tree", temperature=0, **criteria)
    by_budget: dict[int, list[DepthStructure]] = {}
    for row in picked:
        s = DepthStructure.from_row(row)
        by_budget.setdefault(s.budget, []).append(s)
    return {budget: DepthStructure.combine(found) for budget, found in sorted(by_budget.items())}


# ----------------------------------------------------------------------------------------------
# rows for data/results/acceptance.csv

def oracle_rows(records: list[OracleRecord], budgets=BUDGETS, *, package: str, block_size: int, mode: str = "tree",
                depth: int | None = None, topk: int | None = None, n_new_tokens: int | None = None,
                backend: str = "auto", pair: str = "", progress: bool = True) -> list[dict]:
    """One row per budget: the oracle's mean acceptance over every round of every record."""
    rows = []
    for budget in _progress(budgets, f"oracle {package} b{block_size}", progress):
        rounds = [n for record in records
                  for n in round_lengths(accepted_at_every_position(record, budget, depth=depth, topk=topk,
                                                                    mode=mode, backend=backend), n_new_tokens)]
        rows.append(_row("oracle", rounds, package=package, block_size=block_size, mode=mode, budget=budget,
                         depth=depth or block_size - 1, topk=topk or int(records[0].draft.logp.shape[-1]),
                         temperature=0.0, prompts=len(records), backend=backend, pair=pair))
    return rows


def live_rows(target, drafter, prompts, budgets=BUDGETS, *, package: str, max_new_tokens: int,
              method: str = "ddtree", temperature: float = 0.0, seeds=(0,), backend: str = "auto", pair: str = "",
              progress: bool = True, **options) -> list[dict]:
    """One row per budget: generate's acceptance (one batch of all prompts per seed)."""
    return [live_row([generate(target, drafter, prompts, method=method, budget=budget, temperature=temperature,
                               max_new_tokens=max_new_tokens, backend=backend, seed=seed, **options) for seed in seeds],
                     drafter, package=package, temperature=temperature, pair=pair)
            for budget in _progress(budgets, f"live {package} {method}", progress)]


def live_row(runs, drafter, *, package: str, temperature: float = 0.0, pair: str = "") -> dict:
    """The row of one or more generate results of the same settings (seeds); at T > 0 the standard
    error is over the runs' means."""
    rounds = [int(n) for run in runs for a in run.acceptance for n in a]
    means = [run.mean_acceptance for run in runs]
    stderr = float(np.std(means, ddof=1) / np.sqrt(len(means))) if len(means) > 1 else float("nan")
    first = runs[0]
    return _row("live", rounds, package=package, block_size=drafter.config.block_size,
                mode="chain" if first.method == "chain" else "tree", budget=first.budget,
                depth=drafter.config.draft_depth, topk=min(first.budget, drafter.config.vocab_size),
                temperature=float(temperature), prompts=first.batch, backend=first.backend, pair=pair,
                stderr=stderr, seeds=len(runs))


def monte_carlo_rows(records: list[SampledRecord], budgets, *, package: str, block_size: int, n_samples: int = 64,
                     seed: int = 0, pair: str = "", progress: bool = True) -> list[dict]:
    """One row per budget: the Monte-Carlo replay's mean acceptance and standard error at T > 0."""
    rows = []
    for budget in _progress(budgets, f"monte carlo {package} b{block_size}", progress):
        mean, stderr, rounds = monte_carlo_acceptance(records, budget, n_samples=n_samples, seed=seed)
        rows.append(_row("monte_carlo", rounds, package=package, block_size=block_size, mode="tree", budget=budget,
                         depth=block_size - 1, topk=budget, temperature=records[0].temperature,
                         prompts=len(records), backend="numpy", pair=pair, stderr=stderr, seeds=n_samples))
    return rows


def _row(source: str, rounds, *, stderr: float = float("nan"), **columns) -> dict:
    counts = np.bincount(np.asarray(rounds, np.int64), minlength=2)[1:] if len(rounds) else np.zeros(0, np.int64)
    return {"source": source, **columns, "rounds": len(rounds),
            "mean_acceptance": float(np.mean(rounds)) if len(rounds) else float("nan"), "stderr": stderr,
            "histogram": json.dumps(counts.tolist())}


def _progress(items, description: str, enabled: bool):
    from tqdm.auto import tqdm
    # disabled only when asked: an explicit disable=False would override the headless TQDM_DISABLE (notebooks.py)
    return tqdm(list(items), desc=description, unit="budget", file=sys.stderr, **({} if enabled else {"disable": True}))


# ----------------------------------------------------------------------------------------------
# reading rows back

LATEST_KEYS = ("source", "package", "block_size", "mode", "budget", "temperature", "pair")


def latest(rows: list[dict], **criteria) -> list[dict]:
    """Rows matching `criteria`, the newest row per (source, package, block, mode, budget,
    temperature, pair), oldest first."""
    return results.newest_per(rows, LATEST_KEYS, **criteria)


def largest_measurement(rows: list[dict], **criteria) -> list[dict]:
    """The rows matching `criteria` of the biggest measurement (its size: prompts x new tokens summed
    over its packages), newest per key: what to report, whatever smaller (CPU-sized) runs came since."""
    def size(run_rows) -> int:
        per_package = {}
        for row in run_rows:
            tokens = int(float(row.get("prompts") or 0)) * int(float(row.get("new_tokens") or 0))
            per_package[row.get("package")] = max(per_package.get(row.get("package"), 0), tokens)
        return sum(per_package.values())
    return latest(results.largest_run(rows, size, **criteria))


def live_vs_oracle(rows: list[dict]) -> list[dict]:
    """Per run (commit, device) holding both: the T = 0 live rows beside the oracle rows of the same block
    size, package, mode and budget: {"commit", "device", "block_size", "package", "mode", "budget", "live",
    "oracle", "live_rounds", "oracle_rounds"} (mean tokens per round, root included)."""
    zero = [r for r in rows if float(r.get("temperature") or 0) == 0]
    key = ("commit", "device", "block_size", "package", "mode", "budget")
    oracle = {tuple(str(r[k]) for k in key): r for r in latest(zero, source="oracle")}
    out = []
    for row in latest(zero, source="live"):
        twin = oracle.get(tuple(str(row[k]) for k in key))
        if twin is not None:
            out.append({**{k: row[k] for k in key}, "live": float(row["mean_acceptance"]),
                        "oracle": float(twin["mean_acceptance"]), "live_rounds": int(float(row["rounds"])),
                        "oracle_rounds": int(float(twin["rounds"]))})
    return out


def reported_acceptance(rows: list[dict], *, block_size: int, **criteria) -> tuple[list[dict], dict]:
    """The acceptance the project quotes for one block size at T = 0: the oracle rows of the biggest measurement
    (largest_measurement, over every package it covers) and {(mode, budget): mean tokens per round over its
    packages} (projection.acceptance_curve, the curve notebooks 11 and 13 and the projection read)."""
    from .projection import acceptance_curve
    shown = largest_measurement(rows, source="oracle", temperature=0, block_size=block_size, **criteria)
    table = {(mode, budget): value for mode in sorted({r["mode"] for r in shown})
             for budget, value in acceptance_curve(shown, mode=mode).items()}
    return shown, table


# ----------------------------------------------------------------------------------------------
# the command line

@cli.command
def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--block-sizes", type=cli.positive_int, nargs="+", default=[8, 16])
    parser.add_argument("--budgets", type=cli.positive_int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--live-budgets", type=cli.positive_int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--prompts-per-package", type=cli.positive_int, default=8)
    parser.add_argument("--prompt-tokens", type=cli.positive_int, default=128)
    parser.add_argument("--new-tokens", type=cli.positive_int, default=256)
    parser.add_argument("--temperature", type=cli.nonnegative_float, default=1.0,
                        help="the T > 0 comparison (0 skips it)")
    parser.add_argument("--mc-budget", type=cli.positive_int, default=64, help="largest budget of the T > 0 recording")
    parser.add_argument("--seeds", type=cli.positive_int, default=4, help="live runs per budget at T > 0")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    # every block size needs its trained pair: a sweep that would measure nothing is refused up front
    for block_size in args.block_sizes:
        missing = [path for path in stand_in_paths(block_size, args.models_dir) if not (path / "config.json").is_file()]
        if missing:
            parser.error(f"argument --block-sizes: no stand-in checkpoint for block size {block_size} "
                         f"({', '.join(map(str, missing))} has no config.json; see --models-dir)")
    results.check_writable(args.results_dir, topics=(TOPIC, DEPTH_TOPIC))  # before measuring, not after
    run = results.new_run_id()

    def keep(measured: list[dict], topic: str = TOPIC) -> list[dict]:
        """Append a measurement's rows as soon as it completes (a run stopped mid-way keeps them), with
        the run's size, which largest_measurement ranks runs by."""
        if measured:  # depth rows only at DEPTH_BUDGETS within the recorded top-k
            results.append_rows(topic, [{**row, "run": run, "prompt_tokens": args.prompt_tokens,
                                         "new_tokens": args.new_tokens} for row in measured], results_dir=args.results_dir)
        return measured

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for block_size in args.block_sizes:
        chosen = pair_with_prompts(block_size, prompts_per_package=args.prompts_per_package,
                                   prompt_tokens=args.prompt_tokens, models_dir=args.models_dir, device=device,
                                   dtype=dtype)
        target, drafter, pair, packages = chosen.target, chosen.drafter, chosen.name, chosen.packages
        k_max = min(max(args.budgets), target.config.vocab_size)
        for package, prompts in packages.items():
            records = record_oracle(target, drafter, prompts, args.new_tokens, k_max)
            if device == "cuda":
                records = [record.to_torch(device) for record in records]
            for mode in ("tree", "chain"):
                rows += keep(oracle_rows(records, args.budgets, package=package, block_size=block_size, mode=mode,
                                         n_new_tokens=args.new_tokens, pair=pair))
            keep(depth_rows(records, DEPTH_BUDGETS, package=package, block_size=block_size, pair=pair,
                            n_new_tokens=args.new_tokens), DEPTH_TOPIC)
            rows += keep(live_rows(target, drafter, prompts, args.live_budgets, package=package,
                                   max_new_tokens=args.new_tokens, pair=pair))
            if args.temperature > 0:
                sampled = record_sampled(target, drafter, prompts, args.new_tokens, budget=args.mc_budget,
                                         temperature=args.temperature)
                budgets = [b for b in args.live_budgets if b <= args.mc_budget]
                rows += keep(monte_carlo_rows(sampled, budgets, package=package, block_size=block_size, pair=pair))
                rows += keep(live_rows(target, drafter, prompts, budgets, package=package,
                                       max_new_tokens=args.new_tokens, temperature=args.temperature,
                                       seeds=range(args.seeds), pair=pair))
    if rows:
        print(f"{len(rows)} rows -> {results.topic_path(TOPIC, args.results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
