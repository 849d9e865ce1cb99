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

The step: a Decoder makes everything a step touches once, for its (batch, budget, capacity): both
caches at a fixed capacity, roots, features, posterior, output and acceptance buffers, and on the
kernels every launch (PreparedStep: draft top-k, tree build, per layer the verify attention and the
INT4 MoE, accept, compaction). A step only enqueues work and updates those buffers in place (the
caches' lengths too), with no host synchronisation, eagerly or captured once in a CUDA graph and
replayed. The loop (Decoder.rounds, what generate, the server and the benches drive) reads
`active` (and, streaming, the new tokens) back in one copy every `sync_every` steps. Finished
requests keep running in lockstep and change nothing, until Decoder.admit starts a new request in
their row between two rounds (the server's continuous batching). docs/DESIGN.md "The step as
built" lists what is prepared when and where the host is touched.

Tensor parallel: decode_tp.generate_tp spawns the ranks of a sharded target, each runs generate in
lockstep with the others (no per-step broadcast); `python -m kdtree_lib.decode` is the launcher,
alone or under torchrun. pairs.checkpoint_pair gives the notebooks a pair by path.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from . import backend as _backend, cli
from .checks import check_positive_int, check_temperature, dtype_name, to_numpy
from .dflash import DEFAULT_DRAFTER_PLACEMENT, DRAFTER_PLACEMENTS, DFlashDrafter
from .tree_accept import accept, compact_cache, prepare_accept_launch, prepare_compact_launch
from .verify_attn import KERNEL_DTYPES
from .contracts import MAX_BUDGET, DraftTopK, Tree, cache_capacity, capacity_margin, tree_from_parents, tree_nodes
from .draft_topk import draft_topk, prepare_draft_topk
from .model.model import PREFILL_CHUNK
from .model.tp import TensorParallel
from .tree_build import build_tree, prepare_build_launch

METHODS = ("ar", "chain", "ddtree")
STAGES = ("draft", "tree", "verify", "accept")
TREE_MODES = {"ar": "root", "chain": "chain", "ddtree": "tree"}
MAX_STOP_TOKENS = 16
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
    graph = False if profile_stages and cuda_graph == "auto" else resolve_graph(cuda_graph, chosen, target)
    if profile_stages and graph:
        raise ValueError("profile_stages: stage times need cuda_graph=False (a graph replays the step as a whole)")
    depth = drafter.config.draft_depth if method != "ar" else 0
    budget, nodes = step_shape(method, budget, depth)  # one decoder per distinct step
    capacity = decoder_capacity(prompts, max_new_tokens, nodes, depth)
    decoder = cached_decoder(target, drafter if method != "ar" else None, method=method, budget=budget,
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


def shape_decoder(target, drafter, prompts, *, method: str, budget: int, new_tokens: int, backend: str) -> "Decoder":
    """A Decoder of the step shape generate makes for (method, budget) and these prompts, reset with them
    (greedy): what a benchmark times or counts step by step."""
    depth = drafter.config.draft_depth if method != "ar" else 0
    step_budget, nodes = step_shape(method, budget, depth)
    decoder = Decoder(target, drafter if method != "ar" else None, method=method, budget=step_budget,
                      batch=len(prompts), capacity=decoder_capacity(prompts, new_tokens, nodes, depth),
                      temperature=0.0, backend=backend)
    decoder.reset(prompts, max_new_tokens=new_tokens)
    return decoder


def resolve_backend(backend: str, target) -> str:
    """The tree ops' backend: "numpy" or "cupy" ("auto": the kernels when the target is on a GPU;
    "torch": the references, which are the tree ops' torch path)."""
    return _backend.resolve(backend, ("numpy", "cupy"), target.embed_tokens.weight)


def resolve_graph(cuda_graph, backend: str, target) -> bool:
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
    """Cache slots for the longest prompt's committed tokens and the new tokens, and a step's margin
    (contracts.cache_capacity)."""
    return cache_capacity(max(len(p) for p in prompts) - 1 + max_new_tokens, nodes, depth)


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
_DECODERS_LOCK = threading.Lock()  # generate's caller and the server's worker thread may both look up


def cached_decoder(target, drafter, **settings) -> "Decoder":
    """The Decoder for these settings (Decoder's keyword arguments), reused (with its CUDA graph)
    while it stays in a small LRU: generate and the server's engine both take theirs here. The key
    holds the target's embedding address: a model moved or cast since gets a new decoder (a captured
    graph reads the old weights' memory). A Decoder holds one batch's state: one thread drives it
    at a time."""
    weights = target.embed_tokens.weight
    key = (id(target), id(drafter), weights.data_ptr(), str(weights.dtype), tuple(sorted(settings.items())))
    with _DECODERS_LOCK:
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
    with _DECODERS_LOCK:
        _DECODERS.clear()


class PrefillCancelled(Exception):
    """Decoder.reset's should_stop held between two prefill chunks: the batch was given up."""


class Decoder:
    """Everything one (target, drafter, method, budget, batch, capacity) step touches, made once.

    method "ar" | "chain" | "ddtree" as in generate; `topk` overrides K (the oracle recorder keeps
    a wider top-k than the tree needs); walk=False commits only the root each round (the root's
    posterior is the bonus), which is how the oracle records a plain autoregressive trajectory
    while drafting at every position. prefill_chunk: prompt tokens per prefill forward.

    On the kernels (backend "cupy") the constructor also prepares every launch of a step over these
    buffers (PreparedStep: draft top-k, tree build, per layer the verify attention and the INT4 MoE,
    accept, compaction), so `step` only enqueues work: no argument checks, no allocation of its own
    buffers, no host synchronisation. Its outputs (StepOutputs) are views of those buffers, valid
    until the next step.
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
        self.round = torch.zeros(batch, **long)                                # rounds each request took part in
        self.read_len = torch.zeros(batch, **long)                             # out_len at the loop's last read
        # set on the device when a step's target logits hold NaN (an argmax would return a NaN's index as
        # a token); read at the loop's synchronisation, so a step itself reads nothing back
        self.bad_logits = torch.zeros((), dtype=torch.bool, device=device)
        self.columns = torch.arange(width, **long)                             # (D+1,)
        self.root_path = torch.full((batch, width), -1, **long)
        self.root_path[:, 0] = 0
        self.ones = torch.ones(batch, **long)                                  # an AR round commits one token
        self.posterior = torch.zeros(batch, self.nodes, **long)                # the target's token at each node
        self.generator = torch.Generator(device=device)
        self.root_tree = self._root_tree() if self.tree_mode == "root" else None
        self.graph = None
        self.capture_seconds = 0.0                                             # the last capture's
        self.max_new_tokens, self.stop_tokens = 0, ()
        self.handed = np.zeros(batch, np.int64)                                # host: tokens streamed per request
        self.prepared = PreparedStep(self) if backend == "cupy" else None

    def check_shape(self, *, batch: int, budget: int | None = None, capacity: int | None = None) -> None:
        """Refuse a step shape this decoder was not built for, naming the argument (a decoder never
        re-prepares itself: make another one for another shape)."""
        for name, given, mine in (("batch", batch, self.batch), ("budget", budget, self.budget),
                                  ("capacity", capacity, self.capacity)):
            if given is not None and given != mine:
                raise ValueError(f"{name}: this decoder was built for {name} {mine}, got {given}")

    # ------------------------------------------------------------------------------------------
    # the step (fixed shapes; no host synchronisation on the "cupy" backend)

    def step(self, timer=None) -> StepOutputs:
        """One round for every request; finished requests run too and change nothing."""
        timer = timer or _no_timer
        if self.prepared is not None:
            return self.prepared.step(timer)
        with timer("draft"):
            draft = self._draft() if self.drafting else None
        with timer("tree"):
            tree = self._tree(draft)
        with timer("verify"):
            out = self.target.verify(tree, self.cache, feature_layers=self.feature_layers, static=True)
            posterior = sample_posterior(out.logits, self.temperature, self.generator, out=self.posterior)  # (B, N)
            self.bad_logits.logical_or_(torch.isnan(out.logits).any())
        with timer("accept"):
            if self.walk and self.tree_mode != "root":
                result = accept(tree, to_numpy(posterior), backend=self.backend)
                new_lengths = compact_cache(self.cache.kv, self.cache.lengths, result, backend=self.backend)
                path, n_accepted, bonus = (self._on_device(x) for x in (result.path, result.n_accepted, result.bonus))
            else:  # the root alone: its entry is already in place
                new_lengths = self.cache.lengths + 1
                path, n_accepted, bonus = self.root_path, self.ones, posterior[:, 0]
            self._commit(self._on_device(tree.tokens), out.features, path, n_accepted, bonus, new_lengths)
        return StepOutputs(draft=draft, tree=tree, logits=out.logits, posterior=posterior)

    def _draft(self) -> DraftTopK:
        logits = self.drafter.draft(self.draft_cache, self.features, self.root, self.n_features, static=True)
        return draft_topk(logits, self.topk, backend=self.backend)                     # (B, D, K)

    def _tree(self, draft: DraftTopK | None) -> Tree:
        if self.tree_mode == "root":
            self.root_tree.tokens.copy_(self.root[:, None])
            return self.root_tree
        return build_tree(draft, self.budget, root=to_numpy(self.root), mode=self.tree_mode, backend=self.backend)

    def _root_tree(self) -> Tree:
        """The one-node tree of AR rounds, on the target's device (its token refilled each round)."""
        tree = tree_from_parents(np.full((self.batch, 1), -1, np.int32), np.zeros((self.batch, 1), np.int32))
        return tree.to_torch(self.device)

    def _on_device(self, x) -> torch.Tensor:
        return torch.as_tensor(x, device=self.device).long()

    def _commit(self, tree_tokens, features, path, n_accepted, bonus, new_lengths) -> None:
        """Emit the accepted drafts and the bonus, log the round, stop, and feed the drafter. The
        decoder's buffers are written in place (`out=`), each temporary made once."""
        live = self.active  # (B,): updated in place only by the last two lines, after every read
        nodes = path.clamp(min=0)                                                        # (B, D+1) junk past n_acc
        drafts = tree_tokens.gather(1, nodes[:, 1:])                                     # (B, D) junk past n_acc-1
        emitted = torch.cat([drafts, bonus[:, None]], dim=1)                             # (B, D+1)
        emitted.scatter_(1, (n_accepted - 1)[:, None], bonus[:, None])                   # the bonus ends the run
        valid = live[:, None] & (self.columns < n_accepted[:, None])                     # (B, D+1)
        discard = self.out.shape[1] - 1
        self.out.scatter_(1, torch.where(valid, self.out_len[:, None] + self.columns, discard), emitted)
        # n_accepted where live, else 0; it is also the drafter's new feature rows, written there at once
        committed = torch.mul(n_accepted, live, out=self.n_features if self.drafting else None)
        # each request's own round count indexes its log, so a request admitted mid-flight logs from column 0
        column = self.round.clamp(max=self.accepted.shape[1] - 1)
        self.accepted.scatter_(1, column[:, None], committed[:, None])
        self.round += live
        stopped = (valid[..., None] & (emitted[..., None] == self.stop_table)).flatten(1).any(dim=1)
        self.out_len += committed
        torch.where(live, new_lengths, self.cache.lengths, out=self.cache.lengths)
        if self.drafting:
            torch.gather(features, 1, nodes[..., None].expand(-1, -1, features.shape[-1]), out=self.features)
        torch.where(live, bonus, self.root, out=self.root)
        self.active.masked_fill_(stopped, False)
        self.active &= self.out_len < self.max_new

    # ------------------------------------------------------------------------------------------
    # a request batch: prefill, then rounds

    @torch.no_grad()
    def reset(self, prompts: list[np.ndarray], *, max_new_tokens: int, stop_tokens=(), seed: int = 0,
              should_stop: Callable[[], bool] | None = None) -> None:
        """Prefill prompt[:-1] into the target's cache and the drafter's context; roots = last tokens;
        every per-batch buffer (roots, features, outputs, acceptance, round, flags, seed) set anew, so
        one Decoder serves batch after batch. should_stop (the server's "every client left") is asked
        before each prefill chunk; once it holds, PrefillCancelled is raised (the lengths were zeroed
        first, so a stopped prefill leaves nothing the next reset would read)."""
        if len(prompts) != self.batch:
            raise ValueError(f"prompts: this decoder holds {self.batch} requests, got {len(prompts)}")
        self.check_fits(max(len(p) for p in prompts), max_new_tokens)
        self.active.fill_(False)  # a stopped prefill leaves no request running
        self.max_new_tokens, self.stop_tokens = max_new_tokens, tuple(stop_tokens)
        self._prefill(prompts, self.cache, self.draft_cache, should_stop)
        self._start_rows(slice(None), torch.tensor([int(p[-1]) for p in prompts]))
        self.stop_table.fill_(-1)
        if stop_tokens:
            self.stop_table[:len(stop_tokens)] = torch.tensor(stop_tokens, device=self.device)
        self.bad_logits.zero_()
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def admit(self, row: int, prompt, *, should_stop: Callable[[], bool] | None = None) -> None:
        """Start a new request in `row` between two rounds (continuous batching), the other rows
        untouched: its prompt[:-1] is prefilled into that row of both caches alone (a batch-1 view of
        the row: its lengths restart at 0), its per-request buffers start as reset starts them, and
        it joins the next step. It shares the batch's max_new_tokens, stop tokens and temperature
        (set by reset). Nothing is re-prepared: the step's launches and a captured graph read the
        same buffers. Whatever the row held is dropped (a finished or cancelled request's).
        should_stop: as reset's, for this request; a stopped admission leaves the row idle."""
        if not self.max_new_tokens:
            raise ValueError("admit: reset the decoder with a batch first (it sets the max_new_tokens and stop "
                             "tokens an admitted request shares)")
        if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.batch:
            raise ValueError(f"row: expected a row index in 0..{self.batch - 1}, got {row!r}")
        [prompt] = prompt_list([prompt], self.target.config.vocab_size)
        _check_positions([prompt], self.max_new_tokens, self.target.config.max_position_embeddings)
        self.check_fits(len(prompt), self.max_new_tokens, "prompt")
        rows = slice(row, row + 1)
        self.active[rows] = False  # idle until its prefill is done
        cache = replace(self.cache, kv=[kv[rows] for kv in self.cache.kv], lengths=self.cache.lengths[rows])
        draft_cache = None
        if self.drafting:
            d = self.draft_cache
            draft_cache = replace(d, keys=[k[rows] for k in d.keys], values=[v[rows] for v in d.values],
                                  lengths=d.lengths[rows])
        self._prefill([prompt], cache, draft_cache, should_stop)
        self._start_rows(rows, torch.tensor([int(prompt[-1])]))

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """A request of this many prompt tokens and new tokens fits the caches (with a step's margin)."""
        return prompt_tokens - 1 + max_new_tokens + self.capacity_margin <= self.capacity

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, name: str = "prompts") -> None:
        """fits, or a ValueError naming the argument `name` (reset's prompts, admit's prompt)."""
        if not self.fits(prompt_tokens, max_new_tokens):
            raise ValueError(f"{name}: {prompt_tokens - 1} prompt tokens + {max_new_tokens} new tokens do not "
                             f"fit this decoder's capacity {self.capacity}")

    def _start_rows(self, rows: slice, roots: torch.Tensor) -> None:
        """The per-request buffers of `rows` as a new request finds them (reset: every row; admit: one):
        roots, no features yet, empty output and acceptance log, active."""
        self.root[rows] = roots.to(self.device)
        if self.drafting:
            self.features[rows] = 0
        for buffer in (self.n_features, self.out, self.out_len, self.accepted, self.round, self.read_len):
            buffer[rows] = 0
        self.max_new[rows] = self.max_new_tokens
        self.handed[rows] = 0
        self.active[rows] = True

    def _prefill(self, prompts: list[np.ndarray], cache, draft_cache, should_stop: Callable[[], bool] | None) -> None:
        """Commit prompt[:-1] to the target's cache in chunks (no logits: the last prompt token is
        the first root) and each chunk's features to the drafter's context; `cache`/`draft_cache`
        are the decoder's, or one row's view of them (admit). Both caches update their length
        buffers in place, so they stay the decoder's own (the prepared launches and a captured
        graph read them)."""
        cache.lengths.zero_()
        if self.drafting:
            draft_cache.lengths.zero_()
        committed = torch.tensor([len(p) - 1 for p in prompts])
        tokens = torch.zeros(len(prompts), max(len(p) for p in prompts) - 1, dtype=torch.long)
        for b, prompt in enumerate(prompts):
            tokens[b, :len(prompt) - 1] = torch.from_numpy(prompt[:-1])
        chunks = self.target.prefill_chunks(tokens, cache, n_valid=committed.to(torch.int32),
                                            feature_layers=self.feature_layers, chunk=self.prefill_chunk)
        with contextlib.closing(chunks):  # a stopped prefill ends the target's generator at once
            while should_stop is None or not should_stop():
                chunk = next(chunks, None)  # the chunk's forward runs here
                if chunk is None:
                    return
                if self.drafting:
                    self.drafter.extend(draft_cache, chunk.features, chunk.committed)
        raise PrefillCancelled("should_stop: the batch was given up during its prefill")

    @property
    def capacity_margin(self) -> int:
        """Slots past committed + new tokens a step may write (contracts.capacity_margin)."""
        return capacity_margin(self.nodes, self.depth)

    @torch.no_grad()
    def rounds(self, *, cuda_graph: bool = False, timer=None, sync_every: int = 4, max_rounds: int | None = None,
               stream: bool = False, overlap: bool = False):
        """The decode loop, after reset: run rounds (eager steps, or replays of the step's CUDA graph,
        captured on first use) and every `sync_every` rounds yield a RoundsUpdate; stop when no
        request is active or after max_rounds (default max_new_tokens + sync_every) rounds.

        Between yields nothing is read back; each update is one copy to the host (`_pack`, then
        `_unpack`, the loop's one synchronisation): `active`, and with stream=True each request's
        tokens committed since the last read (handed out cut as generate cuts them, emitted_tokens)
        and its round count. overlap=True enqueues the next sync_every rounds before waiting for
        that copy, so the host's work on an update (the server's) overlaps the device's next rounds;
        the loop then runs sync_every rounds past the last request's end, changing nothing. A
        consumer that stops early (cancelled requests) just stops iterating; one that admits
        requests between two yields (admit) calls rounds again once this loop has ended. With
        overlap the rounds already enqueued run before an admission, the admitted row idle in them.
        """
        sync_every = check_positive_int("sync_every", sync_every)
        limit = self.max_new_tokens + sync_every if max_rounds is None else check_positive_int("max_rounds", max_rounds)
        ran = unread = 0  # rounds run; of them, since the last pack
        self.capture_seconds = 0.0
        if cuda_graph and self.graph is None:
            ran = unread = WARMUP_STEPS
            self.capture()

        def advance():
            nonlocal ran, unread
            for _ in range(sync_every):
                if cuda_graph:
                    self.graph.replay()
                else:
                    self.step(timer)
            ran += sync_every
            unread += sync_every

        advance()
        while True:
            pending = self._pack(ran, unread if stream else 0)
            unread = 0
            if overlap and ran < limit:
                advance()  # enqueued ahead of the wait for `pending`
            update = self._unpack(pending)
            yield update
            if not update.active.any():
                break
            if not unread:
                if ran >= limit:
                    break
                advance()

    def _pack(self, done: int, unread: int) -> tuple:
        """Enqueue the loop's one read: `active` and the NaN flag, and (unread > 0: streaming) per
        request its out_len at the previous read and now, its round count, and the output columns
        after the previous read that `unread` rounds can have filled (D+1 tokens each at most), packed
        into one small tensor; on a GPU its copy to pinned host memory is enqueued too, with an event."""
        parts = [self.active.long(), self.bad_logits.long().view(1)]
        if unread:
            columns = self.read_len[:, None] + torch.arange(unread * self.columns.numel(), device=self.device)
            window = self.out.gather(1, columns.clamp(max=self.out.shape[1] - 1))
            parts += [self.read_len, self.out_len, self.round, window.flatten()]
        packed = torch.cat(parts)
        if unread:
            self.read_len.copy_(self.out_len)  # after the pack, in stream order
        if packed.device.type != "cuda":
            return done, unread, packed, None
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)  # on the decoder's device's current stream, after the rounds
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # that stream, whichever device this thread is on
        return done, unread, host, event

    def _unpack(self, pending: tuple) -> RoundsUpdate:
        """Wait for a pack's copy (not for rounds enqueued after it) and hand out what it holds."""
        done, unread, host, event = pending
        if event is not None:
            event.synchronize()
        values = np.array(host.tolist(), np.int64)  # the one copy to the host (on a CPU, the one read)
        batch = self.batch
        active = values[:batch].astype(bool)
        if values[batch]:
            raise ValueError("logits: the target's logits contain NaN (an argmax would return a NaN's index as a token)")
        if not unread:
            return RoundsUpdate(rounds=done, active=active, new_tokens=None)
        before, now, request_rounds, window = np.split(values[batch + 1:], [batch, 2 * batch, 3 * batch])
        window = window.reshape(batch, -1)
        new = []
        for b in range(batch):
            tokens = emitted_tokens(window[b], now[b] - before[b], self.max_new_tokens - self.handed[b],
                                    self.stop_tokens)
            self.handed[b] += len(tokens)
            new.append(tokens)
        return RoundsUpdate(rounds=done, active=active, new_tokens=new, request_rounds=request_rounds)

    def emitted(self) -> list[np.ndarray]:
        """Each request's new tokens so far, as generate returns them (a read of the output buffer)."""
        out, out_len = self.out.cpu().numpy(), self.out_len.cpu().numpy()
        return [emitted_tokens(row, length, self.max_new_tokens, self.stop_tokens) for row, length in zip(out, out_len)]

    @torch.no_grad()
    def run(self, prompts, *, max_new_tokens: int, stop_tokens=(), seed: int = 0, cuda_graph: bool = False,
            profile_stages: bool = False, sync_every: int = 4) -> DecodeResult:
        """reset, then the rounds to the end: a DecodeResult."""
        start = device_clock(self.device)
        self.reset(prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, seed=seed)
        prefill_end = device_clock(self.device)
        timer = StageTimer(self.device) if profile_stages else None
        rounds = 0
        for update in self.rounds(cuda_graph=cuda_graph, timer=timer, sync_every=sync_every):
            rounds = update.rounds
        end = device_clock(self.device)
        return self._result(rounds, cuda_graph, prefill_seconds=prefill_end - start,
                            decode_seconds=end - prefill_end - self.capture_seconds,
                            capture_seconds=self.capture_seconds, stage_seconds=timer.totals() if timer else {})

    def capture(self) -> float:
        """Capture the step into this decoder's CUDA graph (after WARMUP_STEPS eager steps on a side
        stream, which are real rounds); returns and keeps the capture's seconds. Once per decoder:
        the graph replays on the same buffers for every later batch."""
        if self.graph is None:
            self._warm_up()
            self.capture_seconds = self._capture()
        return self.capture_seconds

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
        start = device_clock(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.temperature > 0:  # the sampler's generator advances on every replay
            if not hasattr(graph, "register_generator_state"):
                raise ValueError("cuda_graph: sampling (temperature > 0) in a graph needs torch >= 2.5; "
                                 "pass cuda_graph=False")
            graph.register_generator_state(self.generator)
        # "relaxed": kept from when the verify launcher viewed torch tensors through CuPy inside the
        # step (the prepared step no longer does); tests/test_decode.py checks graph == eager
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            self.step()
        self.graph = graph
        return device_clock(self.device) - start

    def acceptance(self, rounds: int) -> list[np.ndarray]:
        """Per request, the tokens committed in each of its first `rounds` rounds (a read of the log)."""
        # a copy: on a CPU, .cpu() returns the decoder's own buffer, which the next batch overwrites
        per_round = self.accepted[:, :min(rounds, self.accepted.shape[1])].cpu().numpy().copy()
        return [row[row > 0] for row in per_round]

    def _result(self, rounds, cuda_graph, **times) -> DecodeResult:
        return DecodeResult(tokens=self.emitted(), acceptance=self.acceptance(rounds), method=self.method, budget=self.budget,
                            batch=self.batch, backend=self.backend, cuda_graph=cuda_graph, rounds=rounds, **times)


@dataclass
class RoundsUpdate:
    """What Decoder.rounds yields every sync_every rounds."""
    rounds: int                            # rounds run since reset (warm-up rounds of a first capture included)
    active: np.ndarray                     # bool [B]: requests still decoding
    new_tokens: list[np.ndarray] | None    # per request, tokens emitted since the previous update (stream=True)
    request_rounds: np.ndarray | None = None  # per request, rounds it took part in since reset/admit (stream=True)


def emitted_tokens(row: np.ndarray, length: int, max_new_tokens: int, stop_tokens) -> np.ndarray:
    """A request's output row cut as generate returns it: at most max_new_tokens, through the first
    stop token (a round may commit tokens past either; they are dropped). The one owner of the cut."""
    new = row[:min(int(length), max_new_tokens)]
    hits = np.flatnonzero(np.isin(new, stop_tokens)) if len(stop_tokens) else []
    return (new[:hits[0] + 1] if len(hits) else new).copy()


class PreparedStep:
    """A Decoder's step on the kernels, every launch made once over the decoder's buffers: the
    drafter's logits buffer and the fused top-k over it, the tree build over the top-k and the
    decoder's roots, the target's verify launches (Transformer.prepare_verify: verify attention and
    INT4 MoE per layer) over that tree and cache, the accept walk over the tree and the posterior
    buffer, the compaction of every layer into the decoder's new-lengths buffer. `step` enqueues
    them in order; nothing in it reads the device back."""

    def __init__(self, decoder: Decoder):
        self.decoder = d = decoder
        self.draft_logits = self.topk = self.build = self.accept = self.compact = None
        if d.drafting:
            vocab = d.drafter.config.vocab_size
            self.draft_logits = torch.zeros(d.batch, d.depth, vocab, dtype=torch.float32, device=d.device)
            self.topk = prepare_draft_topk(self.draft_logits, d.topk, backend="cupy")
        if d.tree_mode == "root":
            self.tree = d.root_tree
        else:
            self.build = prepare_build_launch(self.topk.out, d.budget, root=d.root, mode=d.tree_mode)
            self.tree = self.build.out
        self.verify = d.target.prepare_verify(self.tree, d.cache)
        if d.walk and d.tree_mode != "root":
            self.new_lengths = torch.zeros_like(d.cache.lengths)
            self.accept = prepare_accept_launch(self.tree, d.posterior)
            self.compact = prepare_compact_launch(d.cache.kv, d.cache.lengths, self.accept.out,
                                                  new_lengths=self.new_lengths)

    def step(self, timer) -> StepOutputs:
        d = self.decoder
        draft = None
        with timer("draft"):
            if d.drafting:
                d.drafter.draft(d.draft_cache, d.features, d.root, d.n_features, static=True, out=self.draft_logits)
                draft = self.topk()
        with timer("tree"):
            if self.build is None:
                d.root_tree.tokens.copy_(d.root[:, None])
            else:
                self.build()
        with timer("verify"):
            out = d.target.verify(self.tree, d.cache, feature_layers=d.feature_layers, static=True,
                                  prepared=self.verify)
            sample_posterior(out.logits, d.temperature, d.generator, out=d.posterior)
            d.bad_logits.logical_or_(torch.isnan(out.logits).any())
        with timer("accept"):
            if self.accept is not None:
                result = self.accept()
                new_lengths = self.compact()
                path, n_accepted, bonus = result.path.long(), result.n_accepted.long(), result.bonus.long()
            else:  # the root alone: its entry is already in place
                new_lengths = d.cache.lengths + 1
                path, n_accepted, bonus = d.root_path, d.ones, d.posterior[:, 0]
            d._commit(self.tree.tokens.long(), out.features, path, n_accepted, bonus, new_lengths)
        return StepOutputs(draft=draft, tree=self.tree, logits=out.logits, posterior=d.posterior)


def sample_posterior(logits, temperature: float, generator=None, *, out=None) -> torch.Tensor:
    """The target's token at every node, int64 [B, N] (into `out` when given): argmax at T = 0; at
    T > 0 a sample of softmax(logits / T) by the exponential race argmax(p / E), E ~ Exp(1) (no host
    synchronisation, unlike torch.multinomial)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1, out=out)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / race, dim=-1, out=out)


# ----------------------------------------------------------------------------------------------
# stage times

class StageTimer:
    """Per-stage times: CUDA events on a GPU (read once, at the end), the host clock on a CPU; and on
    either, the host's own seconds in each stage (`host_totals`: the clock around the enqueueing, no
    synchronisation), which is where an eager step's time goes when the host, not the device, bounds it."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.events: list[tuple[str, object, object]] = []
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.host_seconds = dict.fromkeys(STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            yield
            self.host_seconds[stage] += time.perf_counter() - begin
            end.record()
            self.events.append((stage, start, end))
        else:
            begin = time.perf_counter()
            yield
            elapsed = time.perf_counter() - begin
            self.seconds[stage] += elapsed
            self.host_seconds[stage] += elapsed

    def totals(self) -> dict[str, float]:
        if self.events:
            self.events[-1][2].synchronize()
            for stage, start, end in self.events:
                self.seconds[stage] += start.elapsed_time(end) / 1e3
            self.events.clear()
        return dict(self.seconds)

    def host_totals(self) -> dict[str, float]:
        return dict(self.host_seconds)


@contextlib.contextmanager
def _no_timer(stage: str):
    yield


def device_clock(device) -> float:
    """Wall clock after the device's queued work (a synchronisation outside the rounds)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
    parser.add_argument("--drafter-placement", choices=DRAFTER_PLACEMENTS, default=DEFAULT_DRAFTER_PLACEMENT,
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
    from .decode_tp import check_paths, decode_rank, generate_tp
    check_paths(args.target, args.drafter if args.method != "ar" else None, names=("--target", "--drafter"))
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
