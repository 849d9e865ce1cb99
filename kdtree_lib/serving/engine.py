"""The serving engine: a request queue, decode batches, and the worker thread that decodes them with
the decode loop's own Decoders, kept across batches. Nothing here knows HTTP: `serving.server`
parses requests into Jobs, submits them and relays each Job's updates.

Requests wait in a queue. The scheduler (a coroutine on the server's event loop) takes up to
`max_batch` waiting requests with the same sampling settings (temperature, max_new_tokens, stop
tokens) into one decode batch and runs it in one worker thread round by round (prefill, then a step
until every request is done) on the Decoder kept for its shape (batch size, step budget, capacity
rounded by contracts.cache_capacity, sampling temperature: decode.cached_decoder's LRU, which
generate shares), reset per batch, posting each round's new tokens to its Job. So at T = 0 every
request's tokens and acceptance are what `decode.generate` gives for its prompt, whatever its batch
(at T > 0 each batch samples with a seed of its own).

A request whose client goes away is cancelled: while it waits it is dropped; in a batch its row runs
on (the shapes are fixed) but nothing is sent, and a batch whose requests are all gone stops, between
two prefill chunks or two rounds. A failed batch answers each of its requests with an error.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..contracts import MAX_BUDGET
from ..decode import (METHODS, PrefillCancelled, cached_decoder, check_pair, decoder_capacity, resolve_backend,
                      step_shape)
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


@dataclass
class EngineSettings:
    method: str = "ddtree"
    budget: int = 32
    max_batch: int = 8          # requests per decode batch
    max_queue: int = 256        # waiting requests beyond this get a 503
    batch_wait_s: float = 0.005  # how long a new request waits for others to share its batch
    backend: str = "auto"
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
        self.depth = drafter.config.draft_depth if self.drafter is not None else 0
        self.step_budget, self.nodes = step_shape(settings.method, settings.budget, self.depth)  # as generate
        self.waiting: deque[Job] = deque()
        self.batch: list[Job] = []  # the batch in the worker thread
        self.finished = 0
        self.cancelled = 0
        self.batches = 0
        self.tokens_served = 0
        self.rounds_served = 0
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kdtree-decode")

    def submit(self, job: Job) -> None:
        if len(self.waiting) >= self.settings.max_queue:
            raise RequestError(f"server busy: {len(self.waiting)} requests waiting (max_queue)", status=503)
        self.waiting.append(job)
        if self._wakeup is not None:
            self._wakeup.set()

    def states(self) -> dict:
        """Queue counts and the mean acceptance so far (what /get_server_info reports)."""
        return {"waiting": sum(not job.cancelled for job in self.waiting), "running": len(self.batch),
                "finished": self.finished, "cancelled": self.cancelled,
                "avg_spec_accept_length": self.tokens_served / self.rounds_served if self.rounds_served else None}

    async def run(self) -> None:
        """The scheduler: take a batch, decode it in the worker thread, repeat."""
        loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        while not self._stopping:
            if not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                await asyncio.sleep(self.settings.batch_wait_s)
            batch = self._take_batch()
            if not batch:
                continue
            self.batch = batch
            try:
                await loop.run_in_executor(self._executor, self._decode, batch, loop)
            finally:
                self.batch = []
                self.finished += len(batch)

    def stop(self) -> None:
        """Stop after the current round; the worker thread ends with it."""
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _take_batch(self) -> list[Job]:
        """The oldest live request and up to max_batch - 1 more with its sampling settings; requests
        whose clients left while waiting are answered "cancelled" and dropped."""
        live = [job for job in self.waiting if not job.cancelled]
        for job in self.waiting:
            if job.cancelled:
                job.updates.put_nowait(("cancelled", None))
        self.cancelled += len(self.waiting) - len(live)
        if not live:
            self.waiting.clear()
            return []
        batch = [job for job in live if job.sampling == live[0].sampling][:self.settings.max_batch]
        taken = set(map(id, batch))
        self.waiting = deque(job for job in live if id(job) not in taken)
        return batch

    @torch.no_grad()
    def _decode(self, batch: list[Job], loop) -> None:
        """The worker thread's part: each round's new tokens go out as they come, then each request's
        meta_info."""
        started = time.time()
        sent = [0] * len(batch)
        tokens, verified = [np.zeros(0, np.int64)] * len(batch), np.zeros(len(batch), np.int64)
        try:
            for tokens, verified in self._rounds(batch):
                for index, job in enumerate(batch):
                    if len(tokens[index]) > sent[index]:
                        _post(loop, job, ("tokens", tokens[index][sent[index]:].tolist()))
                        sent[index] = len(tokens[index])
            ending = [("done", self._meta_info(job, tokens[i], int(verified[i]), started, len(batch)))
                      for i, job in enumerate(batch)]
        except PrefillCancelled:
            ending = [("cancelled", None)] * len(batch)
        except Exception as err:  # a failed batch answers every request in it
            ending = [("error", f"{type(err).__name__}: {err}")] * len(batch)
        self.cancelled += sum(job.cancelled for job in batch)
        for job, update in zip(batch, ending):
            _post(loop, job, update)

    def _rounds(self, batch: list[Job]) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
        """The one place the engine drives a Decoder (its shape's, kept across batches): reset with
        prefill (stopped between chunks once every request has gone: PrefillCancelled), then a step
        per round until every request is done, yielding after each round every request's tokens so
        far (cut at its first stop token by decode's own rule) and the rounds it took part in."""
        sampling = batch[0].sampling
        prompts = [job.prompt for job in batch]
        capacity = decoder_capacity(prompts, sampling.max_new_tokens, self.nodes, self.depth)
        decoder = cached_decoder(self.target, self.drafter, method=self.settings.method, budget=self.step_budget,
                                 batch=len(batch), capacity=capacity, temperature=float(sampling.temperature),
                                 backend=self.backend, prefill_chunk=self.settings.prefill_chunk)
        self.batches += 1  # a seed per batch: repeated prompts sample anew at T > 0
        decoder.reset(prompts, max_new_tokens=sampling.max_new_tokens, stop_tokens=sampling.stop_tokens,
                      seed=self.batches, should_stop=lambda: self._gone(batch))
        # decode's one loop, a round at a time (each round's tokens stream out); leaving it stops the steps
        for update in decoder.rounds(sync_every=1, max_rounds=sampling.max_new_tokens):
            if self._gone(batch):
                break
            verified = np.array([len(taken) for taken in decoder.acceptance(update.rounds)], np.int64)
            yield decoder.emitted(), verified

    def _gone(self, batch: list[Job]) -> bool:
        return self._stopping or all(job.cancelled for job in batch)

    def _meta_info(self, job: Job, tokens: np.ndarray, verify: int, started: float, batch_size: int) -> dict:
        """SGLang's meta_info for a finished request; spec_* only for a drafting method, as SGLang does."""
        count = len(tokens)
        stopped = count > 0 and int(tokens[-1]) in job.sampling.stop_tokens
        meta = {"id": job.rid, "prompt_tokens": len(job.prompt), "completion_tokens": count, "cached_tokens": 0,
                "finish_reason": {"type": "stop", "matched": int(tokens[-1])} if stopped
                else {"type": "length", "length": count},
                "e2e_latency": time.time() - job.created, "queue_time": started - job.created,
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
