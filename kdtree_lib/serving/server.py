"""This engine served over HTTP with SGLang's endpoints and response fields, so that the client that
benchmarks a live SGLang service can be tested against a real server process, and either pair can be
served.

    python -m kdtree_lib.serve --method ddtree --budget 32 --port 30000          # the stand-in pair
    python -m kdtree_lib.serve --target PATH --drafter PATH --device cuda ...     # another pair, by path

Endpoints (SGLang's request and response fields):
    POST /generate               {"text" | "input_ids", "sampling_params", "stream"} -> {"text", "output_ids",
                                 "meta_info": {prompt_tokens, completion_tokens, e2e_latency, spec_verify_ct,
                                 spec_accept_length, spec_accept_rate, finish_reason, ...}}
    POST /v1/completions         OpenAI's completions, streamed as server-sent events when "stream" is true
    POST /v1/chat/completions    OpenAI's chat completions (the messages as "role: content" lines)
    GET  /get_server_info        the server's configuration (also /server_info), with queue counts
    GET|POST /flush_cache        SGLang's cache flush (this server keeps no prefix cache between requests)
    GET  /health, /v1/models

Requests wait in a queue. The engine takes up to `max_batch` waiting requests with the same sampling
settings (temperature, max_new_tokens, stop tokens) into one decode batch and runs it in a worker
thread round by round with the decode loop's own Decoder (prefill, then `step` until every request
is done), streaming each round's tokens back. So at T = 0 every request's tokens and acceptance are
what `decode.generate` gives for its prompt, whatever its batch (at T > 0 each batch samples with a
seed of its own). A request whose client goes away is cancelled: its row runs on with its batch (the
shapes are fixed) but nothing is sent, and a batch whose requests are all gone stops. Bad input gets
a 4xx with a message, a full queue a 503; a failed batch answers each of its requests with a 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.web

from .. import __version__
from ..decode import (MAX_STOP_TOKENS, METHODS, Decoder, check_pair, decoder_capacity, resolve_backend,
                      step_shape)
from ..paths import REPO_ROOT

READY_LINE = "kdtree server listening on"   # the line `running_server` waits for, then the URL
MAX_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_NEW_TOKENS = 128                # SGLang's default when sampling_params name none
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "rid"}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "ignore_eos", "stop_token_ids"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos",
                     "stop_token_ids", "n"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt"}) | {"messages", "max_completion_tokens"}


class RequestError(ValueError):
    """Bad input: answered with `status` (4xx) and the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ----------------------------------------------------------------------------------------------
# the engine: a queue, decode batches, a worker thread

@dataclass(frozen=True)
class Sampling:
    """What one decode batch shares."""
    max_new_tokens: int
    temperature: float
    stop_tokens: tuple[int, ...]


@dataclass(eq=False)
class Job:
    """One request in the engine; `updates` receives ("tokens", ids), then ("done", meta_info) or ("error", text)."""
    rid: str
    prompt: np.ndarray
    sampling: Sampling
    updates: asyncio.Queue
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


class Engine:
    """Batches queued requests and decodes them with the project's Decoder in one worker thread."""

    def __init__(self, target, drafter, settings: EngineSettings):
        if settings.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {settings.method!r}")
        if settings.method != "ar":
            check_pair(target, drafter)
        self.target, self.drafter, self.settings = target, drafter if settings.method != "ar" else None, settings
        self.backend = resolve_backend(settings.backend, target)
        self.depth = drafter.config.draft_depth if self.drafter is not None else 0
        self.step_budget, self.nodes = step_shape(settings.method, settings.budget, self.depth)  # as generate
        self.waiting: deque[Job] = deque()
        self.running = 0
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
        return {"waiting": sum(not job.cancelled for job in self.waiting), "running": self.running,
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
            self.running = len(batch)
            try:
                await loop.run_in_executor(self._executor, self._decode, batch, loop)
            finally:
                self.running = 0
                self.finished += len(batch)

    def stop(self) -> None:
        """Stop after the current round; the worker thread ends with it."""
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _take_batch(self) -> list[Job]:
        """The oldest live request and up to max_batch - 1 more with its sampling settings."""
        live = [job for job in self.waiting if not job.cancelled]
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
        """Prefill, then rounds until every request is done; each round's new tokens go out as they come."""
        started = time.time()
        sampling = batch[0].sampling
        prompts = [job.prompt for job in batch]
        try:
            decoder = Decoder(self.target, self.drafter, method=self.settings.method, budget=self.step_budget,
                              batch=len(batch), capacity=decoder_capacity(prompts, sampling.max_new_tokens, self.nodes,
                                                                          self.depth),
                              temperature=sampling.temperature, backend=self.backend)
            self.batches += 1  # a seed per batch: repeated prompts sample anew at T > 0
            decoder.reset(prompts, max_new_tokens=sampling.max_new_tokens, stop_tokens=sampling.stop_tokens,
                          seed=self.batches)
            sent = [0] * len(batch)
            rounds = 0
            tokens = emitted_tokens(decoder, sampling)
            while (rounds < sampling.max_new_tokens and bool(decoder.active.any()) and not self._stopping
                   and not all(job.cancelled for job in batch)):
                decoder.step()
                rounds += 1
                tokens = emitted_tokens(decoder, sampling)
                for index, job in enumerate(batch):
                    if len(tokens[index]) > sent[index]:
                        _post(loop, job, ("tokens", tokens[index][sent[index]:].tolist()))
                        sent[index] = len(tokens[index])
            self.cancelled += sum(job.cancelled for job in batch)
            per_round = decoder.accepted[:, :rounds].cpu().numpy()
            for index, job in enumerate(batch):
                accepted = per_round[index][per_round[index] > 0]
                _post(loop, job, ("done", self._meta_info(job, tokens[index], accepted, started, len(batch))))
        except Exception as err:  # a failed batch answers every request in it
            for job in batch:
                _post(loop, job, ("error", f"{type(err).__name__}: {err}"))

    def _meta_info(self, job: Job, tokens: np.ndarray, rounds: np.ndarray, started: float, batch_size: int) -> dict:
        """SGLang's meta_info for a finished request; spec_* only for a drafting method, as SGLang does."""
        count = len(tokens)
        stopped = count > 0 and int(tokens[-1]) in job.sampling.stop_tokens
        meta = {"id": job.rid, "prompt_tokens": len(job.prompt), "completion_tokens": count, "cached_tokens": 0,
                "finish_reason": {"type": "stop", "matched": int(tokens[-1])} if stopped
                else {"type": "length", "length": count},
                "e2e_latency": time.time() - job.created, "queue_time": started - job.created,
                "batch_size": batch_size}
        if self.drafter is not None and len(rounds):  # none when every request left before the first round
            verify, accepted = len(rounds), count - len(rounds)   # a round emits its accepted drafts + one bonus
            self.tokens_served += count
            self.rounds_served += verify
            meta.update(spec_verify_ct=verify, spec_accept_length=count / verify,
                        spec_accept_rate=accepted / (verify * self.step_budget), spec_accept_token_num=accepted,
                        spec_draft_token_num=verify * self.step_budget)
        return meta


def emitted_tokens(decoder: Decoder, sampling: Sampling) -> list[np.ndarray]:
    """Each request's tokens so far, as generate returns them: at most max_new_tokens, through the
    first stop token."""
    out, lengths = decoder.out.cpu().numpy(), decoder.out_len.cpu().numpy()
    tokens = []
    for row, length in zip(out, lengths):
        new = row[:min(int(length), sampling.max_new_tokens)]
        hits = np.flatnonzero(np.isin(new, sampling.stop_tokens)) if sampling.stop_tokens else []
        tokens.append(new[:hits[0] + 1] if len(hits) else new.copy())
    return tokens


def _post(loop, job: Job, update: tuple) -> None:
    """Hand an update from the worker thread to the request's handler (dropped once the loop is gone)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(job.updates.put_nowait, update)


# ----------------------------------------------------------------------------------------------
# the service: what handlers share (engine, tokenizer, limits, the configuration reported)

class Service:
    """The engine plus the tokenizer (tokenizer.load_text_tokenizer's: encode(text) -> ids, decode(ids)
    -> text; None: token-id prompts only) and the request limits; parses requests into Jobs."""

    def __init__(self, engine: Engine, *, tokenizer=None, model_name: str, context_length: int,
                 stop_tokens: tuple[int, ...] = (), reported: dict | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.context_length, self.stop_tokens = context_length, stop_tokens
        self.vocab = engine.target.config.vocab_size
        self.reported = dict(reported or {})

    def server_info(self) -> dict:
        settings = self.engine.settings
        speculative = {"ar": None, "chain": "DFLASH", "ddtree": "DDTREE"}[settings.method]
        return {**self.reported, "served_model_name": self.model_name, "decode_method": settings.method,
                "speculative_algorithm": speculative, "ddtree_budget": settings.budget if speculative else None,
                "speculative_num_draft_tokens": self.engine.nodes if speculative else None,
                "max_running_requests": settings.max_batch, "max_queued_requests": settings.max_queue,
                "context_length": self.context_length, "backend": self.engine.backend,
                "version": f"kdtree {__version__}", "internal_states": [self.engine.states()]}

    def encode(self, prompt) -> np.ndarray:
        """Token ids from text (the server's tokenizer) or a list of ids; checked against the vocabulary
        and the context length."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this server has no tokenizer: send token ids (input_ids, or a list of ids as "
                                   "prompt)")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise RequestError("prompt: expected one text or one list of token ids (batched prompts are not served)")
        if not ids:
            raise RequestError("prompt: empty")
        if min(ids) < 0 or max(ids) >= self.vocab:
            raise RequestError(f"prompt: token ids must lie in 0..{self.vocab - 1}")
        if len(ids) >= self.context_length:
            raise RequestError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                               f"({self.context_length} tokens).")
        return np.asarray(ids, np.int64)

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def job(self, prompt, *, max_new_tokens, temperature, ignore_eos, stop_token_ids, rid=None) -> Job:
        """A Job from one request's prompt and sampling fields (RequestError naming the bad field)."""
        ids = self.encode(prompt)
        if max_new_tokens is None:
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
        if len(ids) + max_new_tokens > self.context_length:
            raise RequestError(f"max_new_tokens: the input ({len(ids)} tokens) plus {max_new_tokens} new tokens "
                               f"exceed the model's context length ({self.context_length} tokens)")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise RequestError(f"temperature: expected a number >= 0, got {temperature!r}")
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"ignore_eos: expected true or false, got {ignore_eos!r}")
        stops = list(stop_token_ids or []) + ([] if ignore_eos else list(self.stop_tokens))
        if not all(isinstance(t, int) and 0 <= t < self.vocab for t in stops) or len(stops) > MAX_STOP_TOKENS:
            raise RequestError(f"stop_token_ids: expected at most {MAX_STOP_TOKENS} ids in 0..{self.vocab - 1}")
        sampling = Sampling(max_new_tokens, float(temperature), tuple(sorted(set(stops))))
        return Job(rid or uuid.uuid4().hex, ids, sampling, asyncio.Queue())


def _check_fields(body: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"{where}: unknown parameter(s) {', '.join(unknown)}; "
                           f"accepted: {', '.join(sorted(allowed))}")


def chat_prompt(messages) -> str:
    """The chat messages as one text: "role: content" lines, then "assistant: " (the stand-in pair has
    no chat template; a real model's template is its server's business)."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise RequestError("messages: expected a non-empty list of {\"role\": text, \"content\": text}")
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class TextStream:
    """Incremental detokenisation: each call returns the new text, holding back a partial UTF-8 character."""

    def __init__(self, service: Service):
        self.service, self.ids, self.sent = service, [], ""

    def push(self, ids: list[int], *, final: bool = False) -> str:
        self.ids += ids
        text = self.service.decode_text(self.ids)
        if not final and text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


# ----------------------------------------------------------------------------------------------
# HTTP handlers (tornado)

class Handler(tornado.web.RequestHandler):
    """JSON in, JSON or server-sent events out; bad input -> 4xx with a message."""

    def initialize(self, service: Service):
        self.service = service
        self.active_job: Job | None = None

    def error_body(self, status: int, message: str) -> dict:
        return {"error": {"message": message, "code": status}}

    def fail(self, status: int, message: str) -> None:
        self.set_status(status)
        self.finish(self.error_body(status, message))

    def write_error(self, status_code: int, **kwargs) -> None:
        self.finish(self.error_body(status_code, self._reason))

    def on_connection_close(self) -> None:
        if self.active_job is not None:
            self.active_job.cancelled = True

    def body_json(self) -> dict:
        try:
            body = json.loads(self.request.body or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"malformed JSON body: {err}") from None
        if not isinstance(body, dict):
            raise RequestError("body: expected a JSON object")
        return body


class EngineHandler(Handler):
    """A generation endpoint: parse the body into a Job, queue it, answer whole or as a stream."""

    def parse(self, body: dict) -> tuple[Job, bool]:
        raise NotImplementedError

    def response(self, job: Job, ids: list[int], text: str, meta: dict) -> dict:
        raise NotImplementedError

    def chunks(self, job: Job, ids: list[int], delta: str, meta: dict | None) -> list[dict]:
        """The events for one round's tokens (meta is None) or for the end (meta_info)."""
        raise NotImplementedError

    async def post(self):
        try:
            job, stream = self.parse(self.body_json())
            self.service.engine.submit(job)
        except RequestError as err:
            return self.fail(err.status, str(err))
        self.active_job = job
        with contextlib.suppress(tornado.iostream.StreamClosedError):
            await (self._stream(job) if stream else self._whole(job))

    async def _whole(self, job: Job) -> None:
        ids = []
        while True:
            kind, value = await job.updates.get()
            if kind == "tokens":
                ids += value
            elif kind == "error":
                return self.fail(500, value)
            else:
                return self.finish(self.response(job, ids, self.service.decode_text(ids), value))

    async def _stream(self, job: Job) -> None:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        ids, text = [], TextStream(self.service)
        while True:
            kind, value = await job.updates.get()
            if kind == "error":
                events = [self.error_body(500, value)]
            elif kind == "tokens":
                ids += value
                events = self.chunks(job, ids, text.push(value), None)
            else:
                events = self.chunks(job, ids, text.push([], final=True), value)
            for event in events:
                self.write(f"data: {json.dumps(event)}\n\n")
            await self.flush()
            if kind != "tokens":
                break
        self.write("data: [DONE]\n\n")
        await self.finish()


class GenerateHandler(EngineHandler):
    """SGLang's native /generate (non-streamed meta_info holds the acceptance fields)."""

    def parse(self, body):
        _check_fields(body, GENERATE_FIELDS, "/generate")
        if ("text" in body) == ("input_ids" in body):
            raise RequestError("/generate: give exactly one of text or input_ids")
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise RequestError("sampling_params: expected an object")
        _check_fields(sampling, SAMPLING_FIELDS, "sampling_params")
        job = self.service.job(body.get("text", body.get("input_ids")),
                               max_new_tokens=sampling.get("max_new_tokens"),
                               temperature=sampling.get("temperature", 1.0),
                               ignore_eos=sampling.get("ignore_eos", False),
                               stop_token_ids=sampling.get("stop_token_ids"), rid=body.get("rid"))
        return job, _flag(body, "stream")

    def response(self, job, ids, text, meta):
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def chunks(self, job, ids, delta, meta):
        partial = {"id": job.rid, "finish_reason": None, "prompt_tokens": len(job.prompt),
                   "completion_tokens": len(ids)}
        return [{"text": self.service.decode_text(ids), "output_ids": list(ids), "meta_info": meta or partial}]


class OpenAIHandler(EngineHandler):
    """OpenAI's completions; the chat endpoint differs in its prompt and its chunks."""
    chat = False

    def error_body(self, status, message):
        return {"object": "error", "message": message, "type": "BadRequestError" if status < 500 else "InternalError",
                "param": None, "code": status}

    def parse(self, body):
        _check_fields(body, CHAT_FIELDS if self.chat else COMPLETION_FIELDS, self.request.path)
        if body.get("n", 1) != 1:
            raise RequestError("n: only 1 completion per request is served")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError("stream_options: expected {\"include_usage\": true|false}")
        self.include_usage = bool(options.get("include_usage", False))
        self.role_sent = False
        prompt = chat_prompt(body.get("messages")) if self.chat else body.get("prompt")
        job = self.service.job(prompt, max_new_tokens=body.get("max_completion_tokens", body.get("max_tokens", 16)),
                               temperature=body.get("temperature", 1.0), ignore_eos=body.get("ignore_eos", False),
                               stop_token_ids=body.get("stop_token_ids"))
        self.created = int(time.time())
        return job, _flag(body, "stream")

    def _envelope(self, job, kind: str, choices: list) -> dict:
        return {"id": job.rid, "object": kind, "created": self.created, "model": self.service.model_name,
                "choices": choices}

    def _usage(self, job, meta) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": meta["completion_tokens"],
                "total_tokens": len(job.prompt) + meta["completion_tokens"]}

    def response(self, job, ids, text, meta):
        finish = meta["finish_reason"]["type"]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish} if self.chat
                  else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return {**self._envelope(job, "chat.completion" if self.chat else "text_completion", [choice]),
                "usage": self._usage(job, meta)}

    def chunks(self, job, ids, delta, meta):
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        finish = meta["finish_reason"]["type"] if meta else None
        if self.chat:
            content = {"content": delta} if self.role_sent else {"role": "assistant", "content": delta}
            self.role_sent = True
            choice = {"index": 0, "delta": content, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        events = [self._envelope(job, kind, [choice])]
        if meta and self.include_usage:
            events.append({**self._envelope(job, kind, []), "usage": self._usage(job, meta)})
        return events


class ChatHandler(OpenAIHandler):
    chat = True


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name}: expected true or false, got {value!r}")
    return value


class ServerInfoHandler(Handler):
    def get(self):
        self.finish(self.service.server_info())


class FlushCacheHandler(Handler):
    """SGLang's /flush_cache: nothing is cached between requests here, so it always succeeds."""

    def get(self):
        self.finish("Cache flushed.\n")

    post = get


class HealthHandler(Handler):
    def get(self):
        self.finish("")


class ModelsHandler(Handler):
    def get(self):
        self.finish({"object": "list", "data": [{"id": self.service.model_name, "object": "model",
                                                 "owned_by": "kdtree"}]})


def make_app(service: Service) -> tornado.web.Application:
    routes = [("/generate", GenerateHandler), ("/v1/completions", OpenAIHandler), ("/v1/chat/completions", ChatHandler),
              ("/get_server_info", ServerInfoHandler), ("/server_info", ServerInfoHandler),
              ("/flush_cache", FlushCacheHandler), ("/health", HealthHandler), ("/v1/models", ModelsHandler)]
    return tornado.web.Application([(path, handler, {"service": service}) for path, handler in routes])


async def serve(service: Service, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT; prints READY_LINE and the URL once the socket listens (port 0:
    a free port)."""
    sockets = tornado.netutil.bind_sockets(port, host)
    server = tornado.httpserver.HTTPServer(make_app(service), max_body_size=MAX_BODY_BYTES)
    server.add_sockets(sockets)
    engine = asyncio.create_task(service.engine.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    bound = sockets[0].getsockname()[1]
    print(f"{READY_LINE} http://{host}:{bound}", flush=True)
    await stop.wait()
    server.stop()
    service.engine.stop()
    engine.cancel()
    await server.close_all_connections()


# ----------------------------------------------------------------------------------------------
# a server in a subprocess (tests, notebooks)

@dataclass
class LocalServer:
    url: str
    process: subprocess.Popen


@contextlib.contextmanager
def running_server(*arguments: str, startup_timeout_s: float = 120.0, stop_timeout_s: float = 10.0):
    """`python -m kdtree_lib.serve ARGUMENTS --host 127.0.0.1 --port 0` in a subprocess, yielded once it
    listens (a LocalServer with its URL); stopped (SIGTERM, then SIGKILL) on exit."""
    log = Path(tempfile.mkstemp(prefix="kdtree-serve-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "kdtree_lib.serve", *arguments, "--host", "127.0.0.1",
                                    "--port", "0"], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                   cwd=REPO_ROOT)
    try:
        url = _await_ready(process, startup_timeout_s, log)
        yield LocalServer(url, process)
    finally:
        process.terminate()
        try:
            process.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
        log.unlink(missing_ok=True)


@contextlib.contextmanager
def endpoint(server_url: str | None, *arguments: str):
    """The URL to sweep: an operator's live endpoint as it is, or (server_url None) this engine's server
    started with ARGUMENTS for the duration of the block."""
    if server_url is not None:
        yield server_url
        return
    with running_server(*arguments) as server:
        yield server.url


def _await_ready(process: subprocess.Popen, timeout_s: float, log: Path) -> str:
    """The URL of READY_LINE; a reader thread keeps draining the server's stdout afterwards."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}") from None
            continue
        if line.startswith(READY_LINE):
            return line[len(READY_LINE):].strip()
    raise RuntimeError(f"the server did not listen within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
