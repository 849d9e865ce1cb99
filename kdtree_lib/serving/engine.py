"""The serving engine: a request queue, decode batches, and the worker thread that decodes them with
the decode loop's own Decoders, kept across batches. Nothing here knows HTTP: `serving.server`
parses requests into Jobs, submits them and relays each Job's updates.

Requests wait in a queue. The scheduler (a coroutine on the server's event loop) takes up to
`max_batch` waiting requests with the same sampling settings (temperature, max_new_tokens, stop
tokens) into one decode batch, whose size fixes the Decoder's shape (batch size, step budget,
capacity rounded by contracts.cache_capacity, sampling temperature: decode.cached_decoder's LRU,
which generate shares; reset per batch, its CUDA graph captured once where the step can be). The
worker thread runs the batch round by round (Decoder.rounds, one small read per round) and posts
each round's new tokens to their Jobs. Continuous batching: a row whose request finished (or whose
client left) is refilled between two rounds by the next waiting request the batch can take (same
sampling settings, a prompt that fits the capacity), prefilled into that row alone
(Decoder.admit): same Decoder, same prepared step and graph, the other rows untouched. A refill
stops (the batch drains, the next batch forms) once the oldest waiting request is one the batch
cannot take, so it never waits behind a stream of others, or once more requests wait than a
batch smaller than max_batch has free rows, so the next batch forms wider. So at T = 0 every
request's tokens and acceptance are what `decode.generate` gives for its prompt alone, whatever
its row and whenever it joined (at T > 0 each batch samples with a seed of its own).

A request whose client goes away is cancelled: while it waits it is dropped; in a batch its row is
freed at the next round (and refilled), and its prefill (a batch's, once all its requests are gone,
or its own admission) stops between two chunks. A failed batch answers each of its requests with an
error.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..contracts import MAX_BUDGET
from ..decode import (METHODS, PrefillCancelled, cached_decoder, check_pair, decoder_capacity, resolve_graph,
                      resolve_backend, step_shape)
from ..model.model import PREFILL_CHUNK


class RequestError(ValueError):
    """A request refused: answered with `status` (4xx, or 503 for a full queue) and the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sampling:
    """What one decode batch shares."""
    max_new_tokens: int
    temperature: float
    stop_tokens: tuple[int, ...]


@dataclass(eq=False)
class Job:
    """One request in the engine. `updates` receives ("tokens", ids) per round, then one of ("done",
    meta_info), ("error", text) or ("cancelled", None)."""
    rid: str
    prompt: np.ndarray
    sampling: Sampling
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.time)
    cancelled: bool = False
    started: float | None = None                     # when it took a row (its prefill began)
    tokens: list[int] = field(default_factory=list)  # the tokens sent so far


@dataclass
class EngineSettings:
    method: str = "ddtree"
    budget: int = 32
    max_batch: int = 8          # requests per decode batch
    max_queue: int = 256        # waiting requests beyond this get a 503
    batch_wait_s: float = 0.005  # how long a new request waits for others to share its batch
    backend: str = "auto"
    cuda_graph: bool | str = "auto"  # capture the step where it can be (decode.generate's rule), True, False
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill forward: a cancelled batch stops between two

    def check(self) -> None:
        """Each setting in its range (ValueError naming it): the engine refuses at start, not per request."""
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        for name, high in (("budget", MAX_BUDGET), ("max_batch", None), ("max_queue", None), ("prefill_chunk", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high and value > high):
                raise ValueError(f"{name}: expected an integer in 1..{high or 'inf'}, got {value!r}")
        if not (isinstance(self.batch_wait_s, (int, float)) and math.isfinite(self.batch_wait_s)
                and self.batch_wait_s >= 0):
            raise ValueError(f"batch_wait_s: expected a finite number >= 0, got {self.batch_wait_s!r}")


class Engine:
    """Batches queued requests and decodes them with the project's Decoder in one worker thread."""

    def __init__(self, target, drafter, settings: EngineSettings):
        settings.check()
        if settings.method != "ar":
            check_pair(target, drafter)
        self.target, self.drafter, self.settings = target, drafter if settings.method != "ar" else None, settings
        self.backend = resolve_backend(settings.backend, target)
        self.cuda_graph = resolve_graph(settings.cuda_graph, self.backend, target)
        self.depth = drafter.config.draft_depth if self.drafter is not None else 0
        self.step_budget, self.nodes = step_shape(settings.method, settings.budget, self.depth)  # as generate
        self.waiting: deque[Job] = deque()
        self.batch: list[Job] = []  # the requests in the running batch's rows (the worker thread's)
        self.finished = 0
        self.cancelled = 0
        self.batches = 0
        self.admitted = 0           # requests that joined a running batch (continuous batching)
        self.tokens_served = 0
        self.rounds_served = 0
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        self._lock = threading.Lock()  # the queue: submitted on the event loop, refills taken in the worker
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kdtree-decode")

    def submit(self, job: Job) -> None:
        with self._lock:
            if len(self.waiting) >= self.settings.max_queue:
                raise RequestError(f"server busy: {len(self.waiting)} requests waiting (max_queue)", status=503)
            self.waiting.append(job)
        if self._wakeup is not None:
            self._wakeup.set()

    def states(self) -> dict:
        """Queue counts and the mean acceptance so far (what /get_server_info reports)."""
        with self._lock:
            waiting = sum(not job.cancelled for job in self.waiting)
        return {"waiting": waiting, "running": len(self.batch), "finished": self.finished,
                "cancelled": self.cancelled, "admitted": self.admitted,
                "avg_spec_accept_length": self.tokens_served / self.rounds_served if self.rounds_served else None}

    async def run(self) -> None:
        """The scheduler: take a batch, decode it in the worker thread (refilling its rows), repeat."""
        loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        while not self._stopping:
            if not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                await asyncio.sleep(self.settings.batch_wait_s)
            batch = self._take_batch(loop)
            if batch:
                await loop.run_in_executor(self._executor, self._decode, batch, loop)

    def stop(self) -> None:
        """Stop after the current round; the worker thread ends with it."""
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _drop_cancelled(self, loop) -> list[Job]:
        """The live waiting requests, in order; those whose clients left are answered and dropped.
        Called with the lock held."""
        live = [job for job in self.waiting if not job.cancelled]
        for job in self.waiting:
            if job.cancelled:
                _post(loop, job, ("cancelled", None))
        self.cancelled += len(self.waiting) - len(live)
        self.waiting = deque(live)
        return live

    def _take_batch(self, loop) -> list[Job]:
        """The oldest live request and up to max_batch - 1 more with its sampling settings."""
        with self._lock:
            live = self._drop_cancelled(loop)
            if not live:
                return []
            batch = [job for job in live if job.sampling == live[0].sampling][:self.settings.max_batch]
            taken = set(map(id, batch))
            self.waiting = deque(job for job in live if id(job) not in taken)
        return batch

    def _joiners(self, decoder, sampling: Sampling, free: int, loop) -> list[Job]:
        """Up to `free` waiting requests for a running batch's free rows, oldest first, while the oldest
        is one it can take (its sampling settings, a prompt that fits the decoder's capacity) and,
        for a batch narrower than max_batch, no more wait than it has free rows (else it drains and
        the next batch forms wider)."""
        with self._lock:
            live = self._drop_cancelled(loop)
            if decoder.batch < self.settings.max_batch and len(live) > free:
                return []
            taken = []
            while self.waiting and len(taken) < free:
                head = self.waiting[0]
                if head.sampling != sampling or not decoder.fits(len(head.prompt), sampling.max_new_tokens):
                    break
                taken.append(self.waiting.popleft())
        return taken

    @torch.no_grad()
    def _decode(self, batch: list[Job], loop) -> None:
        """The worker thread's part: one batch, its rows refilled as they free up, until none holds a
        request. Each round's new tokens go out as they come, then each request's meta_info."""
        rows: list[Job | None] = list(batch)
        self.batch = list(batch)
        device = self.target.device  # a thread starts on GPU 0: a graph's capture stream must be the model's GPU's
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self._serve(rows, loop)
        except PrefillCancelled:  # the batch's own prefill, every request of it gone
            for job in rows:
                if job is not None:
                    self._end(job, ("cancelled", None), loop)
        except Exception as err:  # a failed batch answers every request in it
            for job in rows:
                if job is not None:
                    self._end(job, ("error", f"{type(err).__name__}: {err}"), loop)
        finally:
            self.batch = []

    def _serve(self, rows: list[Job | None], loop) -> None:
        """The one place the engine drives a Decoder (its shape's, kept across batches): reset with
        the batch's prefill (stopped between chunks once every request has gone: PrefillCancelled),
        then decode's loop a round at a time: after each round, each request's new tokens (cut at
        its first stop token by decode's own rule) go out, finished and cancelled requests leave
        their rows and waiting requests are admitted into them."""
        sampling = rows[0].sampling
        prompts = [job.prompt for job in rows]
        capacity = decoder_capacity(prompts, sampling.max_new_tokens, self.nodes, self.depth)
        decoder = cached_decoder(self.target, self.drafter, method=self.settings.method, budget=self.step_budget,
                                 batch=len(rows), capacity=capacity, temperature=float(sampling.temperature),
                                 backend=self.backend, prefill_chunk=self.settings.prefill_chunk)
        self.batches += 1  # a seed per batch: repeated prompts sample anew at T > 0
        started = time.time()
        for job in rows:
            job.started = started
        decoder.reset(prompts, max_new_tokens=sampling.max_new_tokens, stop_tokens=sampling.stop_tokens,
                      seed=self.batches, should_stop=lambda: self._stopping or all(job.cancelled for job in rows))
        while any(rows):
            # rounds ends once no row is active on the device; rows admitted at its last round need it again.
            # overlap: the device runs the next round while this thread hands out the last one's tokens
            for update in decoder.rounds(cuda_graph=self.cuda_graph, sync_every=1, stream=True, overlap=True):
                for row, job in enumerate(rows):
                    if job is None:
                        continue
                    if job.cancelled or self._stopping:  # its row runs on, unread, until refilled
                        rows[row] = None
                        self._end(job, ("cancelled", None), loop)
                        continue
                    if len(update.new_tokens[row]):
                        new = update.new_tokens[row].tolist()
                        job.tokens += new
                        _post(loop, job, ("tokens", new))
                    if not update.active[row]:
                        rows[row] = None
                        meta = self._meta_info(job, int(update.request_rounds[row]), decoder.batch)
                        self._end(job, ("done", meta), loop)
                if not self._stopping:
                    self._refill(decoder, rows, sampling, loop)
                self.batch = [job for job in rows if job is not None]
                if not any(rows):
                    break

    def _refill(self, decoder, rows: list[Job | None], sampling: Sampling, loop) -> None:
        """Admit waiting requests into the free rows (Decoder.admit: that row's prefill alone)."""
        free = [row for row, job in enumerate(rows) if job is None]
        if not free:
            return
        for row, job in zip(free, self._joiners(decoder, sampling, len(free), loop)):
            rows[row] = job
            self.batch = [job for job in rows if job is not None]
            job.started = time.time()
            try:
                decoder.admit(row, job.prompt, should_stop=lambda: self._stopping or job.cancelled)
            except PrefillCancelled:
                rows[row] = None
                self._end(job, ("cancelled", None), loop)
                continue
            self.admitted += 1

    def _end(self, job: Job, update: tuple, loop) -> None:
        """A request leaves the engine with its last update."""
        self.finished += 1
        self.cancelled += update[0] == "cancelled"
        _post(loop, job, update)

    def _meta_info(self, job: Job, verify: int, batch_size: int) -> dict:
        """SGLang's meta_info for a finished request (its tokens sent, the rounds it took part in);
        spec_* only for a drafting method, as SGLang does."""
        tokens, count = job.tokens, len(job.tokens)
        stopped = count > 0 and tokens[-1] in job.sampling.stop_tokens
        meta = {"id": job.rid, "prompt_tokens": len(job.prompt), "completion_tokens": count, "cached_tokens": 0,
                "finish_reason": {"type": "stop", "matched": tokens[-1]} if stopped
                else {"type": "length", "length": count},
                "e2e_latency": time.time() - job.created, "queue_time": job.started - job.created,
                "batch_size": batch_size}
        if self.drafter is not None and verify:  # none when every request left before the first round
            accepted = count - verify   # a round emits its accepted drafts + one bonus
            self.tokens_served += count
            self.rounds_served += verify
            meta.update(spec_verify_ct=verify, spec_accept_length=count / verify,
                        spec_accept_rate=accepted / (verify * self.step_budget), spec_accept_token_num=accepted,
                        spec_draft_token_num=verify * self.step_budget)
        return meta


def _post(loop, job: Job, update: tuple) -> None:
    """Hand an update from the worker thread to the request's handler (dropped once the loop is gone)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(job.updates.put_nowait, update)
