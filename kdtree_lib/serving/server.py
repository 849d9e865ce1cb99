"""The serving engine (`serving.engine`) over HTTP with SGLang's endpoints and response fields, so that
the client that benchmarks a live SGLang service can be tested against a real server process, and
either pair can be served.

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

One client cannot stall the others: the event loop only moves bytes and queues. A request's prompt is
checked and tokenised in a thread pool (both tokenizers release the interpreter lock while they
encode), prompts longer than `max_prompt_tokens` are refused (a text longer than that many of the
vocabulary's longest tokens before it is tokenised), a body larger than `max_body_bytes` is
read to its end and discarded, then answered 413, a connection that has not sent its headers within
`header_timeout_s` is closed, and a request whose client leaves is cancelled (see serving.engine).
Bad input gets a 4xx with a JSON message naming the field, a full queue a 503; a failed batch answers
each of its requests with a 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import queue
import reprlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.web

from .. import __version__
from ..decode import MAX_STOP_TOKENS
from ..paths import REPO_ROOT
from .engine import Engine, Job, RequestError, Sampling

READY_LINE = "kdtree server listening on"   # the line `running_server` waits for, then the URL
MAX_BODY_BYTES = 16 * 2**20                 # a larger body gets 413
DISCARD_BYTES = 256 * 2**20                 # an over-limit body up to this is read and dropped before the 413
HEADER_TIMEOUT_S = 30.0                     # a connection's request headers must arrive within this
MAX_PROMPT_TOKENS = 2048                    # a CPU prefills ~60 tokens/s of the stand-in: longer prompts stall a batch
TOKENIZER_THREADS = 2
DEFAULT_MAX_NEW_TOKENS = 128                # SGLang's default when sampling_params name none
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "rid"}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "ignore_eos", "stop_token_ids"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos",
                     "stop_token_ids", "n"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt"}) | {"messages", "max_completion_tokens"}
_SHOWN = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 40, 40, 6, 4


def shown(value) -> str:
    """A client's value in an error message: short, whatever its size or nesting."""
    return _SHOWN.repr(value)


# ----------------------------------------------------------------------------------------------
# the service: what handlers share (engine, tokenizer, limits, the configuration reported)

class Service:
    """The engine plus the tokenizer (tokenizer.load_text_tokenizer's: encode(text) -> ids, decode(ids)
    -> text; None: token-id prompts only) and the request limits; parses requests into Jobs."""

    def __init__(self, engine: Engine, *, tokenizer=None, model_name: str, context_length: int,
                 max_prompt_tokens: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 header_timeout_s: float = HEADER_TIMEOUT_S, stop_tokens: tuple[int, ...] = (),
                 reported: dict | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.context_length = _positive_int("context_length", context_length)
        self.max_prompt_tokens = (min(MAX_PROMPT_TOKENS, context_length - 1) if max_prompt_tokens is None
                                  else _positive_int("max_prompt_tokens", max_prompt_tokens))
        if self.max_prompt_tokens >= context_length:
            raise ValueError(f"max_prompt_tokens: {max_prompt_tokens} leaves no room for a new token in the context "
                             f"length {context_length}")
        self.max_body_bytes = _positive_int("max_body_bytes", max_body_bytes)
        if not (isinstance(header_timeout_s, (int, float)) and _finite(header_timeout_s) and header_timeout_s > 0):
            raise ValueError(f"header_timeout_s: expected a finite number of seconds > 0, got {header_timeout_s!r}")
        self.header_timeout_s = float(header_timeout_s)
        self.stop_tokens = stop_tokens
        self.vocab = engine.target.config.vocab_size
        self.max_token_bytes = longest_token_bytes(tokenizer)
        self.reported = dict(reported or {})
        self._tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kdtree-tokenize")

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    def server_info(self) -> dict:
        settings = self.engine.settings
        speculative = {"ar": None, "chain": "DFLASH", "ddtree": "DDTREE"}[settings.method]
        return {**self.reported, "served_model_name": self.model_name, "decode_method": settings.method,
                "speculative_algorithm": speculative, "ddtree_budget": settings.budget if speculative else None,
                "speculative_num_draft_tokens": self.engine.nodes if speculative else None,
                "max_running_requests": settings.max_batch, "max_queued_requests": settings.max_queue,
                "context_length": self.context_length, "max_prompt_tokens": self.max_prompt_tokens,
                "max_body_bytes": self.max_body_bytes, "backend": self.engine.backend,
                "cuda_graph": self.engine.cuda_graph,
                "version": f"kdtree {__version__}", "internal_states": [self.engine.states()]}

    async def make_job(self, prompt, **fields) -> Job:
        """`job` in the tokenizer's thread pool: a long prompt is checked and tokenised off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, functools.partial(self.job, prompt, **fields))

    def encode(self, prompt) -> np.ndarray:
        """Token ids from text (the server's tokenizer) or a list of ids; checked against the vocabulary
        and max_prompt_tokens."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this server has no tokenizer: send token ids (input_ids, or a list of ids as "
                                   "prompt)")
            try:
                size = len(prompt.encode("utf-8"))
            except UnicodeEncodeError as err:
                raise RequestError(f"prompt: not valid Unicode text ({err.reason} at character {err.start})") from None
            if self.max_token_bytes is not None and size > self.max_prompt_tokens * self.max_token_bytes:
                raise RequestError(f"prompt: {size} bytes of text, more than this server's max_prompt_tokens "
                                   f"({self.max_prompt_tokens}; python -m kdtree_lib.serve --max-prompt-tokens) "
                                   f"tokens of at most {self.max_token_bytes} bytes can hold")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise RequestError("prompt: expected one text or one list of token ids (batched prompts are not served)")
        if not ids:
            raise RequestError("prompt: empty")
        if min(ids) < 0 or max(ids) >= self.vocab:
            raise RequestError(f"prompt: token ids must lie in 0..{self.vocab - 1}")
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(f"prompt: {len(ids)} tokens, more than this server's max_prompt_tokens "
                               f"({self.max_prompt_tokens}; python -m kdtree_lib.serve --max-prompt-tokens)")
        return np.asarray(ids, np.int64)  # max_prompt_tokens < context_length: the input fits the context

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def job(self, prompt, *, max_new_tokens, temperature, ignore_eos, stop_token_ids, rid=None) -> Job:
        """A Job from one request's prompt and sampling fields (RequestError naming the bad field)."""
        if max_new_tokens is None:
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: expected a positive integer, got {shown(max_new_tokens)}")
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not (_finite(temperature) and temperature >= 0)):
            raise RequestError(f"temperature: expected a finite number >= 0, got {shown(temperature)}")
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"ignore_eos: expected true or false, got {shown(ignore_eos)}")
        if stop_token_ids is not None and not (isinstance(stop_token_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in stop_token_ids)):
            raise RequestError(f"stop_token_ids: expected a list of token ids in 0..{self.vocab - 1}, got "
                               f"{shown(stop_token_ids)}")
        stops = sorted(set(stop_token_ids or []) | (set() if ignore_eos else set(self.stop_tokens)))
        if len(stops) > MAX_STOP_TOKENS:
            raise RequestError(f"stop_token_ids: at most {MAX_STOP_TOKENS} ids with the end-of-text token, "
                               f"got {len(stops)}")
        if rid is not None and not isinstance(rid, str):
            raise RequestError(f"rid: expected a text, got {shown(rid)}")
        ids = self.encode(prompt)  # after the cheap checks: a refused request is not tokenised
        if len(ids) + max_new_tokens > self.context_length:
            raise RequestError(f"max_new_tokens: the input ({len(ids)} tokens) plus {max_new_tokens} new tokens "
                               f"exceed the model's context length ({self.context_length} tokens)")
        return Job(rid or uuid.uuid4().hex, ids, Sampling(max_new_tokens, float(temperature), tuple(stops)))


def longest_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes one token of the vocabulary stands for, bounded from its decoding alone
    (None: a tokenizer without a vocab_size). A text of more bytes than max_prompt_tokens times this
    is too long before it is tokenised. A token holding part of a character decodes to U+FFFD, 3
    bytes, never fewer than the 1-3 bytes it stands for; + 1 for a decoder that drops a token's
    leading space when it decodes alone (SentencePiece's "▁")."""
    size = getattr(tokenizer, "vocab_size", None)
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    return 1 + max(len(tokenizer.decode([i]).encode("utf-8", "surrogatepass")) for i in range(size))


def _finite(value: int | float) -> bool:
    """A JSON number that is a finite float (1e999 parses as inf; a 400-digit integer overflows one)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _check_fields(body: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"{where}: unknown parameter(s) {', '.join(shown(name)[1:-1] for name in unknown[:5])}"
                           f"{' ...' if len(unknown) > 5 else ''}; "
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

@tornado.web.stream_request_body
class Handler(tornado.web.RequestHandler):
    """JSON in, JSON or server-sent events out; bad input -> 4xx with a message. The body streams in,
    so one larger than the service's max_body_bytes is counted and dropped, never held."""

    def initialize(self, service: Service):
        self.service = service
        self.active_job: Job | None = None
        self.gone = False
        self.chunks: list[bytes] = []
        self.received = 0

    def prepare(self):
        declared = self.request.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > max(DISCARD_BYTES, self.service.max_body_bytes):
            return self.fail(413, self._too_large(int(declared)))  # refused unread: the connection closes
        # read to its end before answering: a server that answers and closes while the client is still
        # sending resets the connection, and the client may never see the 413
        self.request.connection.set_max_body_size(max(DISCARD_BYTES, self.service.max_body_bytes))

    def data_received(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received <= self.service.max_body_bytes:
            self.chunks.append(chunk)
        else:
            self.chunks.clear()

    def _too_large(self, size: int) -> str:
        return (f"body: {size} bytes, more than this server's max_body_bytes ({self.service.max_body_bytes}; "
                f"python -m kdtree_lib.serve --max-body-mb)")

    def error_body(self, status: int, message: str) -> dict:
        return {"error": {"message": message, "code": status}}

    def fail(self, status: int, message: str) -> None:
        if self.gone:
            return None
        self.set_status(status)
        self.finish(self.error_body(status, message))

    def write_error(self, status_code: int, **kwargs) -> None:
        self.finish(self.error_body(status_code, self._reason))

    def on_connection_close(self) -> None:
        self.gone = True
        if self.active_job is not None:
            self.active_job.cancelled = True
            self.active_job.updates.put_nowait(("cancelled", None))  # the handler stops waiting now

    def body_json(self) -> dict:
        if self.received > self.service.max_body_bytes:
            raise RequestError(self._too_large(self.received), status=413)
        try:
            body = json.loads(b"".join(self.chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"malformed JSON body: {err}") from None
        except RecursionError:
            raise RequestError("malformed JSON body: nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError("body: expected a JSON object")
        return body


class EngineHandler(Handler):
    """A generation endpoint: parse the body into a Job, queue it, answer whole or as a stream."""

    def parse(self, body: dict) -> tuple[object, dict, bool]:
        """(prompt, the fields Service.job takes, stream) from the request's JSON: the cheap checks,
        on the event loop."""
        raise NotImplementedError

    def response(self, job: Job, ids: list[int], text: str, meta: dict) -> dict:
        raise NotImplementedError

    def chunks_for(self, job: Job, ids: list[int], delta: str, meta: dict | None) -> list[dict]:
        """The events for one round's tokens (meta is None) or for the end (meta_info)."""
        raise NotImplementedError

    async def post(self):
        try:
            prompt, fields, stream = self.parse(self.body_json())
            job = await self.service.make_job(prompt, **fields)
            if self.gone:  # the client left while its prompt was tokenised
                return
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
            elif kind == "cancelled":
                return
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
            if kind == "cancelled":
                return
            if kind == "error":
                events = [self.error_body(500, value)]
            elif kind == "tokens":
                ids += value
                events = self.chunks_for(job, ids, text.push(value), None)
            else:
                events = self.chunks_for(job, ids, text.push([], final=True), value)
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
        fields = dict(max_new_tokens=sampling.get("max_new_tokens"), temperature=sampling.get("temperature", 1.0),
                      ignore_eos=sampling.get("ignore_eos", False), stop_token_ids=sampling.get("stop_token_ids"),
                      rid=body.get("rid"))
        return body.get("text", body.get("input_ids")), fields, _flag(body, "stream")

    def response(self, job, ids, text, meta):
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def chunks_for(self, job, ids, delta, meta):
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
        self.include_usage = _flag(options, "include_usage")
        self.role_sent = False
        prompt = chat_prompt(body.get("messages")) if self.chat else body.get("prompt")
        fields = dict(max_new_tokens=body.get("max_completion_tokens", body.get("max_tokens", 16)),
                      temperature=body.get("temperature", 1.0), ignore_eos=body.get("ignore_eos", False),
                      stop_token_ids=body.get("stop_token_ids"))
        self.created = int(time.time())
        return prompt, fields, _flag(body, "stream")

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

    def chunks_for(self, job, ids, delta, meta):
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
        raise RequestError(f"{name}: expected true or false, got {shown(value)}")
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


async def serve(service: Service, host: str, port: int, *, stop: asyncio.Event | None = None,
                ready: Callable[[str], None] | None = None) -> None:
    """Serve until `stop` is set (None: until SIGTERM or SIGINT). Once the socket listens, ready(URL)
    (default: print READY_LINE and the URL); port 0: a free port."""
    sockets = tornado.netutil.bind_sockets(port, host)
    # idle_connection_timeout is tornado's header timeout: the wait for a request's headers, idle or trickling
    server = tornado.httpserver.HTTPServer(make_app(service), max_body_size=service.max_body_bytes,
                                           idle_connection_timeout=service.header_timeout_s)
    server.add_sockets(sockets)
    engine = asyncio.create_task(service.engine.run())
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    url = f"http://{host}:{sockets[0].getsockname()[1]}"
    (ready or (lambda url: print(f"{READY_LINE} {url}", flush=True)))(url)
    try:
        await stop.wait()
    finally:
        server.stop()
        service.engine.stop()
        engine.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await engine
        await server.close_all_connections()
        service.close()


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
