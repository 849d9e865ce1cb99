"""DDTree decoding end to end, lossless: draft → top-k → tree build → verify → posterior → accept.

One round (a *step*) advances every request of a batch, at shapes fixed by (batch, budget):

    draft      drafter.draft: the DFlash block after each root, from the target features of the
               tokens committed last round; then draft_topk               DraftTopK [B, D, K]
    tree       build_tree: DDTree's best-first tree of `budget` nodes, DFlash's chain, or (method
               "ar") the root alone                                         Tree [B, N]
    verify     target.verify: every node attends to its request's cache and to its ancestors
               (absorbed MLA), then the posterior: the target's token at every node (argmax at
               T = 0, a sample of softmax(logits / T) at T > 0)             logits [B, N, V]
    accept     tree_accept.accept walks the tree with the posterior; compact_cache keeps the
               accepted nodes' KV entries; the commit appends the emitted tokens (the accepted
               drafts, then the bonus), logs the acceptance length, checks stop tokens and
               max_new_tokens, and hands the accepted nodes' features and the bonus (the next
               root) to the drafter

Every emitted token is the target's own token at its context, so greedy DDTree and chain output
equals greedy autoregressive output (exactly in fp32; in bf16 a tree step and a one-node step round
the logits differently, so the two may part where the target's top two tokens nearly tie), and at
T > 0 the output has the target's sampling distribution (tests/test_decode.py checks both). The prompt's last token is the first root: the
prefill commits prompt[:-1], and a round commits n_accepted tokens (its root and the accepted
drafts) to both caches.

Backends (`backend`, the tree ops'): "numpy" runs the reference tree ops on the host (any device,
eager only); "torch" too (the tree ops have no torch implementation of their own: their reference is
it); "cupy" runs the kernels (draft top-k, tree build, accept, compaction) on the GPU, where a step
has no host synchronisation at all; "auto" picks "cupy" when the target is on a GPU CuPy can use.
The verify attention is the target's own: `load_target(..., attention="absorbed",
attention_backend="auto")` runs the verify kernel for a bf16 or fp16 target on a GPU and the torch
attention for fp32 (the kernel takes 16-bit inputs only) or on a CPU.

CUDA graphs: a Decoder preallocates everything a step touches (both caches at a fixed capacity,
roots, features, output and acceptance buffers) and updates it in place, so the whole step, from
the drafter forward to the compaction, is captured once per (batch, budget, capacity) and replayed;
the host only reads `active.any()` every `sync_every` steps. The eager path runs the very same step
function. Finished requests keep running in lockstep and change nothing.

Tensor parallel (the end of this file): generate_tp spawns the ranks of a sharded target, each runs
generate in lockstep with the others (no per-step broadcast); `python -m kdtree_lib.decode` is the
launcher, alone or under torchrun; checkpoint_pair gives the notebooks a pair by path.
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import backend as _backend, cli
from .checks import check_positive_int, check_temperature, dtype_name, to_numpy
from .dflash import DFlashDrafter
from .tree_accept import accept, compact_cache
from .verify_attn import KERNEL_DTYPES
from .contracts import MAX_BUDGET, DraftTopK, Tree, tree_from_parents, tree_nodes
from .draft_topk import draft_topk
from .model.model import PREFILL_CHUNK
from .model.tp import TensorParallel, launch
from .tree_build import build_tree

METHODS = ("ar", "chain", "ddtree")
STAGES = ("draft", "tree", "verify", "accept")
TREE_MODES = {"ar": "root", "chain": "chain", "ddtree": "tree"}
MAX_STOP_TOKENS = 16
CAPACITY_ROUND = 64     # cache capacities are rounded up so prompts of similar length share a graph
WARMUP_STEPS = 2        # eager steps before a capture (kernel compilation, lazy library init)
CACHED_DECODERS = 4     # decoders (and their graphs) kept for reuse across generate calls


@dataclass
class DecodeResult:
    """What generate returns: tokens and acceptance per request, and where the time went."""
    tokens: list[np.ndarray]        # per request: the new tokens (through the first stop token, at most max_new_tokens)
    acceptance: list[np.ndarray]    # per request: tokens committed per round (root + accepted drafts), in order
    method: str
    budget: int
    batch: int
    backend: str
    cuda_graph: bool
    rounds: int                     # steps run (the batch moves in lockstep)
    prefill_seconds: float
    decode_seconds: float           # the rounds' wall clock (capture excluded)
    capture_seconds: float = 0.0    # a CUDA graph's capture, when this call made one
    stage_seconds: dict[str, float] = field(default_factory=dict)  # per stage, summed (profile_stages=True)

    @property
    def new_tokens(self) -> int:
        return int(sum(len(t) for t in self.tokens))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def mean_acceptance(self) -> float:
        """Mean tokens per round over every request's rounds (1 for autoregressive decoding)."""
        rounds = np.concatenate(self.acceptance) if self.acceptance else np.zeros(0)
        return float(rounds.mean()) if rounds.size else float("nan")


@dataclass
class StepOutputs:
    """A step's intermediate results (what the offline oracle records)."""
    draft: DraftTopK | None
    tree: Tree
    logits: torch.Tensor      # float32 [B, N, V]
    posterior: torch.Tensor   # int64 [B, N]


# ----------------------------------------------------------------------------------------------
# the entry point

def generate(target, drafter, prompt_ids, *, method: str = "ddtree", budget: int = 32, temperature: float = 0.0,
             max_new_tokens: int = 64, stop_tokens=(), backend: str = "auto", cuda_graph="auto", seed: int = 0,
             profile_stages: bool = False, sync_every: int = 4, prefill_chunk: int = PREFILL_CHUNK) -> DecodeResult:
    """Decode every prompt with the target (and the drafter for "chain"/"ddtree"); lossless.

    prompt_ids: one sequence of ids, a list of sequences (lengths may differ), or an int array
    [B, P]. budget: draft nodes per tree (the chain drafts min(budget, D)). cuda_graph: "auto"
    captures the step where the kernels run (backend "cupy"), True insists, False runs eagerly.
    profile_stages: CUDA-event (or host-clock) times per stage, eager only ("auto" then runs
    eagerly). sync_every: steps
    between the host's stop checks (its only synchronisation). prefill_chunk: prompt tokens per
    prefill forward. A tensor-parallel target (load_target(..., tp_group=...)) runs the same call
    on every rank of its group, in lockstep (generate_tp, main).
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    budget = check_positive_int("budget", budget)
    if budget > MAX_BUDGET:
        raise ValueError(f"budget: at most {MAX_BUDGET} draft nodes, got {budget}")
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    sync_every = check_positive_int("sync_every", sync_every)
    temperature = check_temperature(temperature)
    if method != "ar":
        check_pair(target, drafter)
    prompts = prompt_list(prompt_ids, target.config.vocab_size)
    _check_positions(prompts, max_new_tokens, target.config.max_position_embeddings)
    stops = _stop_list(stop_tokens, target.config.vocab_size)
    chosen = resolve_backend(backend, target)
    graph = False if profile_stages and cuda_graph == "auto" else _resolve_graph(cuda_graph, chosen, target)
    if profile_stages and graph:
        raise ValueError("profile_stages: stage times need cuda_graph=False (a graph replays the step as a whole)")
    depth = drafter.config.draft_depth if method != "ar" else 0
    budget, nodes = step_shape(method, budget, depth)  # one decoder per distinct step
    capacity = decoder_capacity(prompts, max_new_tokens, nodes, depth)
    decoder = _cached_decoder(target, drafter if method != "ar" else None, method=method, budget=budget,
                              batch=len(prompts), capacity=capacity, temperature=float(temperature), backend=chosen,
                              prefill_chunk=check_positive_int("prefill_chunk", prefill_chunk))
    return decoder.run(prompts, max_new_tokens=max_new_tokens, stop_tokens=stops, seed=seed, cuda_graph=graph,
                       profile_stages=profile_stages, sync_every=sync_every)


def step_shape(method: str, budget: int, depth: int) -> tuple[int, int]:
    """(draft nodes, tree capacity N) of one step: AR verifies the root alone, the chain drafts at most
    its depth D, DDTree `budget` nodes."""
    if method == "ar":
        return 1, 1
    step_budget = min(budget, depth) if method == "chain" else budget
    return step_budget, tree_nodes(step_budget)


def resolve_backend(backend: str, target) -> str:
    """The tree ops' backend: "numpy" or "cupy" ("auto": the kernels when the target is on a GPU;
    "torch": the references, which are the tree ops' torch path)."""
    if backend not in _backend.BACKENDS:
        raise ValueError(f"backend: expected one of {_backend.BACKENDS}, got {backend!r}")
    on_gpu = target.device.type == "cuda"
    if backend == "auto":
        return "cupy" if on_gpu and _backend.cuda_available() else "numpy"
    if backend == "torch":
        return "numpy"
    if backend == "cupy" and not (on_gpu and _backend.cuda_available()):
        raise ValueError("backend: 'cupy' needs the target on a CUDA device and CuPy")
    return backend


def _resolve_graph(cuda_graph, backend: str, target) -> bool:
    """A step can be captured when nothing in it synchronises: the tree kernels, and the target's
    absorbed attention on the verify kernel (its naive path and torch reference build the mask on
    the host; "auto" runs the kernel only for the dtypes it takes)."""
    kernel_attention = target.attention_backend == "cupy" or (
        target.attention_backend == "auto" and dtype_name(target.embed_tokens.weight) in KERNEL_DTYPES)
    capturable = backend == "cupy" and target.attention == "absorbed" and kernel_attention
    if cuda_graph == "auto":
        return capturable
    if cuda_graph not in (True, False):
        raise ValueError(f"cuda_graph: expected 'auto', True or False, got {cuda_graph!r}")
    if cuda_graph and not capturable:
        raise ValueError("cuda_graph: a captured step needs the target on a GPU, backend 'cupy' and the target's "
                         "absorbed attention on the verify kernel (the reference paths synchronise with the host)")
    return cuda_graph


def check_pair(target, drafter) -> None:
    """The drafter fits the target: bound, same vocabulary and hidden size, features it can read."""
    if not isinstance(drafter, DFlashDrafter):
        raise ValueError(f"drafter: methods 'chain' and 'ddtree' need a DFlashDrafter, got {type(drafter).__name__}")
    c = drafter.config
    if drafter.target is None:
        raise ValueError("drafter: not bound to a target (load_drafter(path, target) or drafter.bind(target))")
    if c.vocab_size != target.config.vocab_size or c.hidden_size != target.config.hidden_size:
        raise ValueError(f"drafter: vocabulary {c.vocab_size} / hidden size {c.hidden_size} differ from the "
                         f"target's {target.config.vocab_size} / {target.config.hidden_size}")
    if max(c.target_layer_ids) >= target.config.num_hidden_layers:
        raise ValueError(f"drafter: target_layer_ids {c.target_layer_ids} exceed the target's "
                         f"{target.config.num_hidden_layers} layers")


def prompt_list(prompt_ids, vocab: int) -> list[np.ndarray]:
    """One int64 array per request from a sequence, a list of sequences or an array [B, P]."""
    if isinstance(prompt_ids, (np.ndarray, torch.Tensor)):
        array = to_numpy(prompt_ids)
        if array.ndim not in (1, 2):
            raise ValueError(f"prompt_ids: expected 1 or 2 dimensions, got shape {tuple(array.shape)}")
        rows = [array] if array.ndim == 1 else list(array)
    elif isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(np.isscalar(t) for t in prompt_ids):
        rows = [np.asarray(prompt_ids)]
    elif isinstance(prompt_ids, (list, tuple)) and prompt_ids:
        rows = [np.asarray(to_numpy(p) if isinstance(p, torch.Tensor) else p) for p in prompt_ids]
    else:
        raise ValueError("prompt_ids: expected a non-empty sequence of token ids or of prompts")
    prompts = []
    for b, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt_ids[{b}]: expected a non-empty 1-D sequence of integer ids")
        if row.min() < 0 or row.max() >= vocab:
            raise ValueError(f"prompt_ids[{b}]: ids must lie in 0..{vocab - 1}")
        prompts.append(row.astype(np.int64))
    return prompts


def decoder_capacity(prompts, max_new_tokens: int, nodes: int, depth: int) -> int:
    """Cache slots for the longest prompt, the new tokens, one tree of `nodes` and the drafter's
    D + 1 context rows, rounded up to CAPACITY_ROUND."""
    needed = max(len(p) for p in prompts) - 1 + max_new_tokens + nodes + depth + 1
    return -(-needed // CAPACITY_ROUND) * CAPACITY_ROUND


def committed_tokens(out: np.ndarray, out_len: np.ndarray, max_new_tokens: int, stop_tokens) -> list[np.ndarray]:
    """Each request's new tokens as generate returns them, from a Decoder's `out` [B, W] and `out_len`
    [B] on the host: at most max_new_tokens, through the first stop token (a round commits its whole
    accepted run, which may go on past a stop; the serving engine cuts its streamed rounds here too)."""
    tokens = []
    for row, length in zip(out, out_len):
        new = row[:min(int(length), max_new_tokens)]
        hits = np.flatnonzero(np.isin(new, stop_tokens)) if len(stop_tokens) else []
        tokens.append(new[:hits[0] + 1] if len(hits) else new)
    return tokens


def _check_positions(prompts: list[np.ndarray], max_new_tokens: int, limit: int) -> None:
    """Every position decoded lies inside the target's max_position_embeddings."""
    longest = max(len(p) for p in prompts)
    if longest > limit:
        b = next(b for b, p in enumerate(prompts) if len(p) == longest)
        raise ValueError(f"prompt_ids[{b}]: {longest} tokens, longer than the target's max_position_embeddings={limit}")
    if longest + max_new_tokens > limit:
        raise ValueError(f"max_new_tokens: {longest} prompt tokens + {max_new_tokens} new tokens pass the target's "
                         f"max_position_embeddings={limit}")


def _stop_list(stop_tokens, vocab: int) -> tuple[int, ...]:
    """stop_tokens as ids: a list, tuple or 1-D array of integers (a string is no list of ids: "42" would
    stop on 4 and 2; nor is a float or a bool an id)."""
    if isinstance(stop_tokens, (np.ndarray, torch.Tensor)):
        stop_tokens = to_numpy(stop_tokens).tolist() if stop_tokens.ndim == 1 else stop_tokens
    if not isinstance(stop_tokens, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in stop_tokens):
        raise ValueError(f"stop_tokens: expected a list of integer token ids, got {stop_tokens!r}")
    stops = tuple(int(t) for t in stop_tokens)
    if len(stops) > MAX_STOP_TOKENS:
        raise ValueError(f"stop_tokens: at most {MAX_STOP_TOKENS}, got {len(stops)}")
    if any(not 0 <= t < vocab for t in stops):
        raise ValueError(f"stop_tokens: ids must lie in 0..{vocab - 1}, got {stops}")
    return stops


# ----------------------------------------------------------------------------------------------
# the decoder: preallocated state, the step, the loop

_DECODERS: OrderedDict = OrderedDict()


def _cached_decoder(target, drafter, **settings) -> "Decoder":
    """The Decoder for these settings, reused (with its CUDA graph) while it stays in a small LRU.
    The key holds the target's embedding address: a model moved or cast since gets a new decoder
    (a captured graph reads the old weights' memory)."""
    weights = target.embed_tokens.weight
    key = (id(target), id(drafter), weights.data_ptr(), str(weights.dtype), tuple(sorted(settings.items())))
    if key in _DECODERS:
        _DECODERS.move_to_end(key)
        return _DECODERS[key]
    decoder = Decoder(target, drafter, **settings)
    _DECODERS[key] = decoder
    while len(_DECODERS) > CACHED_DECODERS:
        _DECODERS.popitem(last=False)
    return decoder


def clear_decoders() -> None:
    """Forget the cached decoders (their caches and graphs); frees their memory."""
    _DECODERS.clear()


class Decoder:
    """Everything one (target, drafter, method, budget, batch, capacity) step touches, preallocated.

    method "ar" | "chain" | "ddtree" as in generate; `topk` overrides K (the oracle recorder keeps
    a wider top-k than the tree needs); walk=False commits only the root each round (the root's
    posterior is the bonus), which is how the oracle records a plain autoregressive trajectory
    while drafting at every position. prefill_chunk: prompt tokens per prefill forward.
    """

    def __init__(self, target, drafter, *, method: str, budget: int, batch: int, capacity: int,
                 temperature: float, backend: str, topk: int | None = None, walk: bool = True,
                 draft: bool | None = None, prefill_chunk: int = PREFILL_CHUNK):
        self.target, self.drafter = target, drafter
        self.prefill_chunk = check_positive_int("prefill_chunk", prefill_chunk)
        self.method, self.budget, self.batch, self.capacity = method, budget, batch, capacity
        self.temperature, self.backend, self.walk = temperature, backend, walk
        self.tree_mode = TREE_MODES[method]
        self.drafting = method != "ar" if draft is None else draft
        vocab = target.config.vocab_size
        self.depth = drafter.config.draft_depth if self.drafting else 0
        self.topk = topk or (1 if method == "chain" else min(budget, vocab))
        self.nodes = 1 if self.tree_mode == "root" else tree_nodes(budget, mode=self.tree_mode, depth=self.depth)
        self.feature_layers = tuple(drafter.config.target_layer_ids) if self.drafting else ()
        device = self.device = target.device
        long = dict(dtype=torch.long, device=device)

        self.cache = target.new_cache(batch, capacity)                         # kv [B, L, 576], lengths int32 [B]
        self.draft_cache = drafter.new_cache(batch, capacity) if self.drafting else None
        width = self.depth + 1
        self.root = torch.zeros(batch, **long)                                 # the next round's root token
        self.features = (torch.zeros(batch, width, drafter.config.feature_size, dtype=target.embed_tokens.weight.dtype,
                                     device=device) if self.drafting else None)  # (B, D+1, F)
        self.n_features = torch.zeros(batch, **long)                           # new rows of `features`
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out = torch.zeros(batch, capacity + width + 1, **long)            # last column: discard slot
        self.out_len = torch.zeros(batch, **long)
        self.max_new = torch.zeros(batch, **long)
        self.stop_table = torch.full((MAX_STOP_TOKENS,), -1, **long)
        self.accepted = torch.zeros(batch, capacity + 64, **long)              # per round; last column: overflow
        self.round = torch.zeros((), **long)
        self.columns = torch.arange(width, **long)                             # (D+1,)
        self.root_path = torch.full((batch, width), -1, **long)
        self.root_path[:, 0] = 0
        self.generator = torch.Generator(device=device)
        self.root_tree = self._root_tree() if self.tree_mode == "root" else None
        self.graph = None

    # ------------------------------------------------------------------------------------------
    # the step (fixed shapes; no host synchronisation on the "cupy" backend)

    def step(self, timer=None) -> StepOutputs:
        """One round for every request; finished requests run too and change nothing."""
        timer = timer or _no_timer
        with timer("draft"):
            draft = self._draft() if self.drafting else None
        with timer("tree"):
            tree = self._tree(draft)
        with timer("verify"):
            out = self.target.verify(tree, self.cache, feature_layers=self.feature_layers, static=True)
            posterior = sample_posterior(out.logits, self.temperature, self.generator)   # (B, N)
        with timer("accept"):
            if self.walk and self.tree_mode != "root":
                result = accept(tree, self._tree_input(posterior), backend=self.backend)
                new_lengths = compact_cache(self.cache.kv, self.cache.lengths, result, backend=self.backend)
                path, n_accepted, bonus = (self._on_device(x) for x in (result.path, result.n_accepted, result.bonus))
            else:  # the root alone: its entry is already in place
                new_lengths = self.cache.lengths + 1
                path, n_accepted, bonus = self.root_path, torch.ones_like(self.root), posterior[:, 0]
            self._commit(self._on_device(tree.tokens), out.features, path, n_accepted, bonus, new_lengths)
        return StepOutputs(draft=draft, tree=tree, logits=out.logits, posterior=posterior)

    def _draft(self) -> DraftTopK:
        lengths = self.draft_cache.lengths  # draft() rebinds lengths; a replayed graph needs the same buffer
        logits = self.drafter.draft(self.draft_cache, self.features, self.root, self.n_features, static=True)
        lengths.copy_(self.draft_cache.lengths)
        self.draft_cache.lengths = lengths
        return draft_topk(logits, self.topk, backend=self.backend)                     # (B, D, K)

    def _tree(self, draft: DraftTopK | None) -> Tree:
        if self.tree_mode == "root":
            if self.backend == "cupy":
                self.root_tree.tokens.copy_(self.root[:, None])
            else:
                self.root_tree.tokens[:, 0] = to_numpy(self.root)
            return self.root_tree
        root = self._tree_input(self.root)
        return build_tree(draft, self.budget, root=root, mode=self.tree_mode, backend=self.backend)

    def _root_tree(self) -> Tree:
        tree = tree_from_parents(np.full((self.batch, 1), -1, np.int32), np.zeros((self.batch, 1), np.int32))
        return tree.to_torch(self.device) if self.backend == "cupy" else tree

    def _tree_input(self, x):
        """Tensors the tree ops read: on the device for the kernels, on the host for the reference."""
        return x if self.backend == "cupy" else to_numpy(x)

    def _on_device(self, x) -> torch.Tensor:
        return torch.as_tensor(x, device=self.device).long()

    def _commit(self, tree_tokens, features, path, n_accepted, bonus, new_lengths) -> None:
        """Emit the accepted drafts and the bonus, log the round, stop, and feed the drafter."""
        live = self.active.clone()                                                       # (B,)
        drafts = tree_tokens.gather(1, path[:, 1:].clamp(min=0))                         # (B, D) junk past n_acc-1
        emitted = torch.cat([drafts, bonus[:, None]], dim=1)                             # (B, D+1)
        emitted.scatter_(1, (n_accepted - 1)[:, None], bonus[:, None])                   # the bonus ends the run
        valid = live[:, None] & (self.columns < n_accepted[:, None])                     # (B, D+1)
        discard = self.out.shape[1] - 1
        self.out.scatter_(1, torch.where(valid, self.out_len[:, None] + self.columns, discard), emitted)
        committed = torch.where(live, n_accepted, 0)
        column = self.round.clamp(max=self.accepted.shape[1] - 1).view(1)
        self.accepted.index_copy_(1, column, committed[:, None])
        self.round += 1
        stopped = (valid[..., None] & (emitted[..., None] == self.stop_table)).flatten(1).any(dim=1)
        self.out_len += committed
        self.cache.lengths.copy_(torch.where(live, new_lengths, self.cache.lengths))
        if self.drafting:
            rows = path.clamp(min=0)[..., None].expand(-1, -1, features.shape[-1])     # (B, D+1, F)
            self.features.copy_(features.gather(1, rows))
            self.n_features.copy_(committed)
        self.root.copy_(torch.where(live, bonus, self.root))
        self.active &= ~stopped & (self.out_len < self.max_new)

    # ------------------------------------------------------------------------------------------
    # a request batch: prefill, then rounds

    @torch.no_grad()
    def reset(self, prompts: list[np.ndarray], *, max_new_tokens: int, stop_tokens=(), seed: int = 0) -> None:
        """Prefill prompt[:-1] into the target's cache and the drafter's context; roots = last tokens."""
        if len(prompts) != self.batch:
            raise ValueError(f"prompts: this decoder holds {self.batch} requests, got {len(prompts)}")
        device = self.device
        committed = torch.tensor([len(p) - 1 for p in prompts], device=device)
        if int(committed.max()) + max_new_tokens + self.capacity_margin > self.capacity:
            raise ValueError(f"prompts: {int(committed.max())} prompt tokens + {max_new_tokens} new tokens do not "
                             f"fit this decoder's capacity {self.capacity}")
        self._prefill(prompts, committed)
        self.root.copy_(torch.tensor([int(p[-1]) for p in prompts], device=device))
        if self.drafting:
            self.features.zero_()
        self.n_features.zero_()
        self.active.fill_(True)
        self.out.zero_()
        self.out_len.zero_()
        self.max_new.fill_(max_new_tokens)
        self.stop_table.fill_(-1)
        if stop_tokens:
            self.stop_table[:len(stop_tokens)] = torch.tensor(stop_tokens, device=device)
        self.accepted.zero_()
        self.round.zero_()
        self.generator.manual_seed(seed)

    def _prefill(self, prompts: list[np.ndarray], committed: torch.Tensor) -> None:
        """Commit prompt[:-1] to the target's cache in chunks (no logits: the last prompt token is
        the first root) and each chunk's features to the drafter's context; both caches' length
        buffers stay the decoder's own (a captured graph reads them)."""
        lengths = self.cache.lengths
        lengths.zero_()
        draft_lengths = self.draft_cache.lengths if self.drafting else None
        if self.drafting:
            draft_lengths.zero_()
        width = int(committed.max())
        tokens = torch.zeros(self.batch, width, dtype=torch.long)
        for b, prompt in enumerate(prompts):
            tokens[b, :len(prompt) - 1] = torch.from_numpy(prompt[:-1])
        for chunk in self.target.prefill_chunks(tokens, self.cache, n_valid=committed.to(torch.int32),
                                                feature_layers=self.feature_layers, chunk=self.prefill_chunk):
            if self.drafting:
                self.drafter.extend(self.draft_cache, chunk.features, chunk.committed)
        lengths.copy_(self.cache.lengths)
        self.cache.lengths = lengths
        if self.drafting:
            draft_lengths.copy_(self.draft_cache.lengths)
            self.draft_cache.lengths = draft_lengths

    @property
    def capacity_margin(self) -> int:
        """Slots past committed + new tokens a step may write: the tree, and the drafter's D + 1 rows."""
        return self.nodes + self.depth + 1

    @torch.no_grad()
    def run(self, prompts, *, max_new_tokens: int, stop_tokens=(), seed: int = 0, cuda_graph: bool = False,
            profile_stages: bool = False, sync_every: int = 4) -> DecodeResult:
        start = _now(self.device)
        self.reset(prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, seed=seed)
        prefill_end = _now(self.device)
        timer = StageTimer(self.device) if profile_stages else None
        rounds, capture_seconds, limit = 0, 0.0, max_new_tokens + sync_every
        if cuda_graph and self.graph is None:
            rounds += self._warm_up()
            capture_seconds = self._capture()
        while rounds < limit:
            for _ in range(sync_every):
                if cuda_graph:
                    self.graph.replay()
                else:
                    self.step(timer)
            rounds += sync_every
            if not bool(self.active.any()):  # the loop's one synchronisation
                break
        end = _now(self.device)
        return self._result(prompts, stop_tokens, max_new_tokens, rounds, cuda_graph,
                            prefill_seconds=prefill_end - start,
                            decode_seconds=end - prefill_end - capture_seconds, capture_seconds=capture_seconds,
                            stage_seconds=timer.totals() if timer else {})

    def _warm_up(self) -> int:
        """Eager steps on a side stream before the first capture (they are real rounds)."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return WARMUP_STEPS

    def _capture(self) -> float:
        """Capture one step into a CUDA graph (nothing runs); returns the seconds it took."""
        start = _now(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.temperature > 0:  # the sampler's generator advances on every replay
            if not hasattr(graph, "register_generator_state"):
                raise ValueError("cuda_graph: sampling (temperature > 0) in a graph needs torch >= 2.5; "
                                 "pass cuda_graph=False")
            graph.register_generator_state(self.generator)
        # "relaxed": the verify kernel's launcher views torch tensors through CuPy (a pointer
        # query) inside the step; tests/test_decode.py checks graph == eager, token for token
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            self.step()
        self.graph = graph
        return _now(self.device) - start

    def _result(self, prompts, stop_tokens, max_new_tokens, rounds, cuda_graph, **times) -> DecodeResult:
        # copies: on a CPU, .cpu() returns the decoder's own buffers, which the next call overwrites
        out, out_len = self.out.cpu().numpy().copy(), self.out_len.cpu().numpy().copy()
        per_round = self.accepted[:, :min(rounds, self.accepted.shape[1])].cpu().numpy().copy()
        tokens = committed_tokens(out, out_len, max_new_tokens, stop_tokens)
        acceptance = [rounds_of[rounds_of > 0] for rounds_of in per_round]
        return DecodeResult(tokens=tokens, acceptance=acceptance, method=self.method, budget=self.budget,
                            batch=self.batch, backend=self.backend, cuda_graph=cuda_graph, rounds=rounds, **times)


def sample_posterior(logits, temperature: float, generator=None) -> torch.Tensor:
    """The target's token at every node, int64 [B, N]: argmax at T = 0; at T > 0 a sample of
    softmax(logits / T) by the exponential race argmax(p / E), E ~ Exp(1) (no host synchronisation,
    unlike torch.multinomial)."""
    if logits.device.type == "cpu" and bool(torch.isnan(logits).any()):  # host values: no synchronisation
        raise ValueError("logits: the target's logits contain NaN (an argmax would return a NaN's index as a token)")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)


# ----------------------------------------------------------------------------------------------
# stage times

class StageTimer:
    """Per-stage times: CUDA events on a GPU (read once, at the end), the host clock on a CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.events: list[tuple[str, object, object]] = []
        self.seconds = dict.fromkeys(STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((stage, start, end))
        else:
            begin = time.perf_counter()
            yield
            self.seconds[stage] += time.perf_counter() - begin

    def totals(self) -> dict[str, float]:
        if self.events:
            self.events[-1][2].synchronize()
            for stage, start, end in self.events:
                self.seconds[stage] += start.elapsed_time(end) / 1e3
            self.events.clear()
        return dict(self.seconds)


@contextlib.contextmanager
def _no_timer(stage: str):
    yield


def _now(device) -> float:
    """Wall clock after the device's queued work (a synchronisation outside the rounds)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ----------------------------------------------------------------------------------------------
# tensor-parallel decode: every rank runs generate over its shard, in lockstep (DESIGN.md §9)
#
# The target's layers end in all-reduces and its LM head in an all-gather, so every rank holds the
# same hidden states, features and logits (bitwise: a collective hands every rank the same
# result). The drafter is replicated and its inputs are those, so the draft, the tree, the accept
# and the commit are computed identically on every rank without a broadcast; at T > 0 each rank's
# sampler is seeded alike. check_lockstep compares the ranks' tokens once, at the end.

def generate_tp(target_path, drafter_path, prompt_ids, *, tp: int = 2, device: str = "cpu",
                dtype: torch.dtype = torch.float32, runs=None, yarn_attention: str = "transformers",
                drafter_placement: str = "sharded", gpu_bytes: int | None = None, **options):
    """generate over the checkpoint at target_path sharded on `tp` spawned ranks (gloo on CPUs;
    device "cuda": rank r on cuda:r over NCCL), the drafter at drafter_path on each:
    whole ("replicated") or its layers split over the ranks ("sharded").

    options: generate's keywords; runs: a list of such dicts, all decoded by the same ranks (one
    load), returning a list of DecodeResults (else one DecodeResult). tp=1 runs in this process.
    Before loading, every rank plans its memory (model.memory.plan, printed by rank 0) and on a GPU
    refuses to load what does not fit in gpu_bytes (default: the GPU's free memory).
    """
    tp = check_positive_int("tp", tp)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    args = (str(target_path), None if drafter_path is None else str(drafter_path), prompt_ids,
            [options] if runs is None else list(runs), device, dtype, yarn_attention, drafter_placement, gpu_bytes)
    _check_paths(*args[:2])
    results = (decode_rank(TensorParallel(), *args) if tp == 1 else
               launch(decode_rank, tp, *args, backend="nccl" if device == "cuda" else "gloo"))
    return results[0] if runs is None else results


def decode_rank(tp: TensorParallel, target_path: str, drafter_path: str | None, prompt_ids, runs: list[dict],
                device: str, dtype: torch.dtype, yarn_attention: str, drafter_placement: str,
                gpu_bytes: int | None) -> list[DecodeResult]:
    """One rank's work: plan memory, load its shard of the target and the drafter (whole or its
    shard), run each of `runs` through generate, check the ranks stayed in lockstep."""
    from .dflash import DFlashConfig, load_drafter
    from .model import load_config, load_target
    from .model.memory import plan
    _check_paths(target_path, drafter_path)
    on_gpu = device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    config = load_config(target_path)
    drafter_config = DFlashConfig.load(drafter_path, yarn_attention=yarn_attention) if drafter_path else None
    prompts = prompt_list(prompt_ids, config.vocab_size)
    defaults = generate.__kwdefaults__
    longest = max(len(p) for p in prompts) + max(run.get("max_new_tokens", defaults["max_new_tokens"]) for run in runs)
    budget = max(run.get("budget", defaults["budget"]) for run in runs)
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else None
    memory = plan(config, tp.size, len(prompts), longest, budget, drafter_config, drafter_placement=drafter_placement,
                  **({"gpu_bytes": gpu_bytes or free} if on_gpu or gpu_bytes else {}))
    if tp.rank == 0:
        print(memory.table(), flush=True)
    if on_gpu or gpu_bytes:
        memory.check()
    if not on_gpu:  # gloo ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // tp.size))
    target = load_target(target_path, device=device, dtype=dtype, tp_group=tp.group)
    drafter = (load_drafter(drafter_path, target, yarn_attention=yarn_attention, placement=drafter_placement)
               if drafter_path else None)
    results = [generate(target, drafter, prompts, **run) for run in runs]
    for result in results:
        check_lockstep(tp, result)
    clear_decoders()  # they hold this rank's shard, and through it the process group
    return results


def check_lockstep(tp: TensorParallel, result: DecodeResult) -> None:
    """Every rank emitted the same tokens and acceptance lengths (one all-gather, after the run)."""
    if tp.size == 1:
        return
    import torch.distributed as dist
    mine = [[t.tolist() for t in result.tokens], [a.tolist() for a in result.acceptance]]
    everyone = [None] * tp.size
    dist.all_gather_object(everyone, mine, group=tp.group)
    parted = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if parted:
        raise RuntimeError(f"ranks {parted} decoded other tokens than rank 0: the ranks left lockstep")


def checkpoint_pair(target_path, drafter_path, *, tokenizer_path=None, tp: int = 1, prompts_per_package: int = 1,
                    prompt_tokens: int = 32, device=None, dtype=None, yarn_attention: str = "transformers"):
    """The real pair (or any pair in its formats) by path, for the notebooks: (PairWithPrompts with
    the committed held-out prompts encoded by its tokenizer, the generate to call on it).

    tp == 1: both models in this process (a GPU in bf16 when there is one, else the CPU in float32);
    the returned generate is generate. tp > 1: `target` and `drafter` hold only their configs and
    the returned generate(target, drafter, prompts, **options) decodes on tp spawned ranks
    (generate_tp; the ranks load the pair on each call). A path without a checkpoint, or a
    tokenizer folder without a tokenizer, is a ValueError: there is no fallback to another pair.
    """
    import json
    from types import SimpleNamespace
    from .corpus import PROMPTS_PATH
    from .dflash import DFlashConfig, load_drafter
    from .model import load_config, load_target
    from .pairs import PairWithPrompts
    from .tokenizer import load_text_tokenizer
    tp = check_positive_int("tp", tp)
    _check_paths(target_path, drafter_path)
    tokenizer = load_text_tokenizer(tokenizer_path or target_path)
    gpu = torch.cuda.is_available()
    device = device or ("cuda" if gpu else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    packages: dict[str, list[np.ndarray]] = {}
    for line in Path(PROMPTS_PATH).read_text().splitlines():
        document = json.loads(line)
        chosen = packages.setdefault(document["package"], [])
        if len(chosen) < prompts_per_package:
            chosen.append(np.asarray(tokenizer.encode(document["text"])[:prompt_tokens], np.int64))
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
    name = f"{Path(target_path).name}+{Path(drafter_path).name}"
    description = f"checkpoint pair {target_path} + {drafter_path} (TP={tp}, {device}, {str(dtype).removeprefix('torch.')})"
    return PairWithPrompts(target, drafter, description, name, True, packages), run


def _check_paths(target_path, drafter_path, names=("target_path", "drafter_path")) -> None:
    for name, path in zip(names, (target_path, drafter_path)):
        if path is not None and not (Path(path) / "config.json").is_file():
            raise ValueError(f"{name}: no checkpoint at {path} (its config.json is missing)")


@cli.command
def main(argv=None) -> int:
    """python -m kdtree_lib.decode: decode prompts with a checkpoint pair, under torchrun or alone.

    torchrun --nproc-per-node N -m kdtree_lib.decode --target PATH --drafter PATH --tp N ...
    (ranks in lockstep over NCCL on GPUs, gloo on CPUs); without torchrun, --tp N > 1 spawns N ranks.
    """
    import argparse
    import json
    import os
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.decode", description=main.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target's checkpoint folder")
    parser.add_argument("--drafter", type=Path, help="the DFlash drafter's folder (needed by chain and ddtree)")
    parser.add_argument("--tokenizer", type=Path, help="folder with tiktoken.model or tokenizer.json (default: --target)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt's text (repeat for a batch)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated ids")
    parser.add_argument("--method", choices=METHODS, default="ddtree")
    parser.add_argument("--budget", type=cli.positive_int, default=32, help=f"draft nodes per tree (at most {MAX_BUDGET})")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=64)
    parser.add_argument("--temperature", type=cli.nonnegative_float, default=0.0)
    parser.add_argument("--tp", type=cli.positive_int, default=1, help="tensor-parallel degree (torchrun's world size)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--yarn-attention", choices=("transformers", "legacy"), default="transformers")
    parser.add_argument("--drafter-placement", choices=("replicated", "sharded"), default="sharded",
                        help="the drafter whole on every rank, or its layers split over the ranks")
    parser.add_argument("--stop-at-eos", action="store_true", help="stop a request at the tokenizer's eos")
    args = parser.parse_args(argv)
    if args.budget > MAX_BUDGET:
        parser.error(f"argument --budget: at most {MAX_BUDGET} draft nodes, got {args.budget}")
    if args.method != "ar" and args.drafter is None:
        parser.error(f"argument --drafter: method {args.method} needs a drafter")
    if not args.prompt and not args.prompt_ids:
        parser.error("argument --prompt or --prompt-ids: nothing to decode")
    prompt_ids = []
    for ids in args.prompt_ids:
        try:
            prompt_ids.append([int(i) for i in ids.split(",")])
        except ValueError:
            parser.error(f"argument --prompt-ids: expected comma-separated integers, got {ids!r}")
    # the configs are read here, before any rank spawns: a bad checkpoint is refused in one line
    from .dflash import DFlashConfig
    from .model import load_config
    _check_paths(args.target, args.drafter if args.method != "ar" else None, names=("--target", "--drafter"))
    config = load_config(args.target)
    config.check_absorbable(str(args.target / "config.json"))  # decode_rank loads the absorbed attention
    vocab = config.vocab_size
    for ids in prompt_ids:
        if not ids or not all(0 <= i < vocab for i in ids):
            parser.error(f"argument --prompt-ids: expected ids in [0, {vocab}) (the target's vocabulary), got "
                         f"{','.join(map(str, ids))!r}")
    if args.device == "cuda":
        cli.require_cuda()
    if args.method != "ar":
        DFlashConfig.load(args.drafter, yarn_attention=args.yarn_attention)
    from .tokenizer import load_text_tokenizer
    tokenizer = load_text_tokenizer(args.tokenizer or args.target) if args.prompt or args.stop_at_eos else None
    prompts = [tokenizer.encode(text) for text in args.prompt] + prompt_ids
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    options = dict(method=args.method, budget=args.budget, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature,
                   stop_tokens=(tokenizer.eos_id,) if args.stop_at_eos and tokenizer.eos_id is not None else ())
    drafter = None if args.method == "ar" else args.drafter
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist
        if int(os.environ["WORLD_SIZE"]) != args.tp:
            parser.error(f"argument --tp: {args.tp}, but torchrun started {os.environ['WORLD_SIZE']} ranks")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            tp = TensorParallel.from_group(dist.group.WORLD)
            result = decode_rank(tp, str(args.target), drafter and str(drafter), prompts, [options], args.device,
                                 dtype, args.yarn_attention, args.drafter_placement, None)[0]
            dist.barrier()  # no rank tears its group down while another still talks to it
        finally:
            dist.destroy_process_group()
        if tp.rank != 0:
            return 0
    else:
        result = generate_tp(args.target, drafter, prompts, tp=args.tp, device=args.device, dtype=dtype,
                             yarn_attention=args.yarn_attention, drafter_placement=args.drafter_placement, **options)
    for b, tokens in enumerate(result.tokens):
        row = {"request": b, "new_tokens": len(tokens), "ids": tokens.tolist(),
               "mean_acceptance": float(result.acceptance[b].mean()) if result.acceptance[b].size else None}
        if tokenizer is not None:
            row["text"] = tokenizer.decode(tokens)
        print(json.dumps(row, ensure_ascii=False))
    print(json.dumps({"method": result.method, "budget": result.budget, "tp": args.tp, "rounds": result.rounds,
                      "mean_acceptance": result.mean_acceptance, "tokens_per_second": result.tokens_per_second}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
