"""The server stays responsive and refuses client mistakes with a 4xx: servers in this process on
127.0.0.1 (a thread runs the event loop), a tiny random pair. Nothing here depends on how fast the
machine is: where a test must catch the server in the middle of something (tokenising, prefilling),
the tokenizer or the prefill is held on an Event until the test has looked; every wait has a bound
far above any honest duration, there only so that a broken server fails the test instead of hanging it."""
import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from kdtree_lib.pairs import random_pair
from kdtree_lib.serve import main as serve_main
from kdtree_lib.serving.engine import Engine, EngineSettings
from kdtree_lib.serving.server import MAX_BODY_BYTES, Service, serve

VOCAB = 64
CONTEXT = 256
WAIT_S = 120  # the bound on any wait below: never reached by a working server, however busy the machine


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run on one torch thread, as the server runs them (spinning threads crawl on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class CharTokenizer:
    """One id per character (its code point mod 60), so that a text's token count is its length; with
    `held`, encode waits until the test releases it, after saying it has started."""

    def __init__(self, held: bool = False):
        self.held, self.entered, self.release, self.calls = held, threading.Event(), threading.Event(), 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        self.entered.set()
        if self.held and not self.release.wait(WAIT_S):
            raise RuntimeError("the test never released the tokenizer")
        return [ord(c) % 60 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def make_service(*, method="ddtree", prefill_chunk=256, target=None, drafter=None, **limits) -> Service:
    if target is None:
        target, drafter = random_pair(vocab=VOCAB)
    engine = Engine(target, drafter, EngineSettings(method=method, budget=8, max_batch=2,
                                                    prefill_chunk=prefill_chunk))
    return Service(engine, model_name="random", context_length=CONTEXT, stop_tokens=(), **limits)


@contextlib.contextmanager
def serving(service: Service):
    """The service on 127.0.0.1 (a free port) with its event loop in a thread; yields the URL."""
    loop, url, stop = asyncio.new_event_loop(), concurrent.futures.Future(), []

    async def run():
        stop.append(asyncio.Event())
        await serve(service, "127.0.0.1", 0, stop=stop[0], ready=url.set_result)

    def thread_main():
        try:
            loop.run_until_complete(run())
        except BaseException as err:  # noqa: BLE001 (the test sees why the server did not start)
            if not url.done():
                url.set_exception(err)
            raise

    thread = threading.Thread(target=thread_main, daemon=True)
    thread.start()
    try:
        yield url.result(WAIT_S)
    finally:
        if stop:
            loop.call_soon_threadsafe(stop[0].set)
        thread.join(WAIT_S)
        loop.close()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.01)


def raw_request(url: str, head: bytes) -> socket.socket:
    parts = urlsplit(url)
    connection = socket.create_connection((parts.hostname, parts.port), timeout=WAIT_S)
    connection.sendall(head)
    return connection


def read_all(connection: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := connection.recv(65536):
            data += chunk
    return data


# ----------------------------------------------------------------------------------------------
# one client cannot stall the others

def test_health_answers_while_a_long_prompt_is_tokenised():
    tokenizer = CharTokenizer(held=True)
    service = make_service(tokenizer=tokenizer, max_prompt_tokens=100)
    with serving(service) as url, concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            big = pool.submit(httpx.post, url + "/generate", json={"text": "ab" * 500_000}, timeout=WAIT_S)
            assert tokenizer.entered.wait(WAIT_S), "the prompt never reached the tokenizer"
            # the tokenizer is held: if it ran on the event loop, nothing below could be answered
            health = httpx.get(url + "/health", timeout=WAIT_S)
            info = httpx.get(url + "/get_server_info", timeout=WAIT_S)
            assert health.status_code == 200 and info.json()["max_prompt_tokens"] == 100
            assert not big.done()
        finally:
            tokenizer.release.set()
        refused = big.result(WAIT_S)
        assert refused.status_code == 400, refused.text
        assert "1000000 tokens, more than this server's max_prompt_tokens (100" in refused.json()["error"]["message"]
        good = httpx.post(url + "/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 2}},
                          timeout=WAIT_S)
        assert good.status_code == 200 and good.json()["meta_info"]["prompt_tokens"] == 3


def test_the_longest_prompt_is_configurable_and_refused_by_name():
    service = make_service(tokenizer=CharTokenizer(), max_prompt_tokens=8)
    with serving(service) as url:
        for path, body in [("/generate", {"input_ids": list(range(1, 10))}), ("/generate", {"text": "x" * 9}),
                           ("/v1/completions", {"prompt": "x" * 9}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            response = httpx.post(url + path, json=body, timeout=WAIT_S)
            assert response.status_code == 400 and "max_prompt_tokens (8" in response.text, (path, response.text)
        fits = httpx.post(url + "/generate", json={"input_ids": list(range(1, 9)),
                                                   "sampling_params": {"max_new_tokens": 2}}, timeout=WAIT_S)
        assert fits.status_code == 200 and fits.json()["meta_info"]["prompt_tokens"] == 8
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        make_service(max_prompt_tokens=CONTEXT)
    assert make_service().max_prompt_tokens == CONTEXT - 1, "the default leaves room for one new token"


class VocabTokenizer(CharTokenizer):
    """With a vocabulary whose longest token decodes to 2 bytes ("é"), so the server can bound a
    text's token count from its length."""
    vocab_size = 60

    def decode(self, ids) -> str:
        return "".join("é" if i == 7 else "a" for i in ids)


def test_a_text_no_tokenisation_could_fit_is_refused_before_tokenising():
    tokenizer = VocabTokenizer()
    service = make_service(tokenizer=tokenizer, max_prompt_tokens=8)
    assert service.max_token_bytes == 3, "2 bytes, + 1 for a leading space a lone decode may drop"
    with serving(service) as url:
        unread = httpx.post(url + "/generate", json={"text": "x" * 25}, timeout=WAIT_S)
        assert unread.status_code == 400 and "25 bytes of text" in unread.text and "max_prompt_tokens (8" in unread.text
        assert tokenizer.calls == 0, "a text longer than 8 tokens of 3 bytes can hold is not tokenised"
        counted = httpx.post(url + "/generate", json={"text": "x" * 24}, timeout=WAIT_S)
        assert counted.status_code == 400 and "24 tokens, more than" in counted.text and tokenizer.calls == 1
        fits = httpx.post(url + "/generate", json={"text": "x" * 8, "sampling_params": {"max_new_tokens": 1}},
                          timeout=WAIT_S)
        assert fits.status_code == 200 and tokenizer.calls == 2


def test_a_client_that_leaves_during_prefill_stops_the_prefill():
    target, drafter = random_pair(vocab=VOCAB)
    entered, release, computed = threading.Event(), threading.Event(), []
    prefill_chunks = target.prefill_chunks

    def held_prefill(*args, **kwargs):
        """The target's prefill, held after its first chunk until the test releases it."""
        for chunk in prefill_chunks(*args, **kwargs):
            computed.append(chunk.start)
            if len(computed) == 1:
                entered.set()
                release.wait(WAIT_S)
            yield chunk

    target.prefill_chunks = held_prefill
    prompt = list(range(1, 41))  # 39 tokens to prefill: 10 chunks of 4
    service = make_service(target=target, drafter=drafter, prefill_chunk=4)
    engine = service.engine
    try:
        with serving(service) as url:
            body = json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}).encode()
            client = raw_request(url, b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert entered.wait(WAIT_S), "the prefill never started"
            client.close()
            wait_for(lambda: engine.batch and all(job.cancelled for job in engine.batch),
                     "the server noticing that its client left")
            release.set()
            wait_for(lambda: not engine.batch, "the cancelled batch ending")
            assert computed == [0], f"the prefill ran on after its only client left: chunks at {computed}"
            assert engine.states()["cancelled"] == 1 and engine.batches == 1
            good = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}},
                              timeout=WAIT_S)
            assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 2
            assert computed[1:] == list(range(0, 39, 4)), "the next request prefills its whole prompt"
    finally:
        release.set()


def test_a_connection_that_never_finishes_its_headers_is_closed():
    service = make_service(header_timeout_s=3.0)  # long enough that a whole request is never cut on a busy CPU
    with serving(service) as url:
        slow = raw_request(url, b"GET /health HTTP/1.1\r\nHost: test\r\n")  # never the blank line
        with slow:
            assert httpx.get(url + "/health", timeout=WAIT_S).status_code == 200, "the others are served meanwhile"
            assert read_all(slow) == b"", "the server closes the connection without an answer"
        assert httpx.get(url + "/health", timeout=WAIT_S).status_code == 200


def test_a_body_over_the_limit_gets_413_with_a_json_message():
    with serving(make_service()) as url:
        big = b'{"input_ids": [' + b"1," * 8_500_000 + b'1]}'
        assert len(big) > 17_000_000 > MAX_BODY_BYTES
        response = httpx.post(url + "/generate", content=big, timeout=WAIT_S)
        assert response.status_code == 413, response.text[:200]
        message = response.json()["error"]["message"]
        assert f"{len(big)} bytes, more than this server's max_body_bytes ({MAX_BODY_BYTES}" in message
        assert httpx.get(url + "/health", timeout=WAIT_S).status_code == 200

    with serving(make_service(max_body_bytes=1000)) as url:
        padding = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        fits = json.dumps(padding).encode().ljust(1000)
        assert httpx.post(url + "/generate", content=fits, timeout=WAIT_S).status_code == 200
        over = fits + b" "
        for path in ("/generate", "/v1/completions"):
            response = httpx.post(url + path, content=over, timeout=WAIT_S)
            assert response.status_code == 413 and "max_body_bytes (1000" in response.text, response.text
        assert httpx.post(url + "/v1/completions", content=over, timeout=WAIT_S).json()["code"] == 413
        chunked = httpx.post(url + "/generate", content=iter([fits, b" " * 500]), timeout=WAIT_S)  # no length
        assert chunked.status_code == 413 and "1500 bytes" in chunked.text, chunked.text
        # a body declared far beyond anything worth reading is refused before it is sent
        client = raw_request(url, b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Length: 300000000\r\n\r\n")
        with client:
            head = read_all(client)
        assert head.startswith(b"HTTP/1.1 413") and b"max_body_bytes (1000" in head, head[:300]
        assert httpx.post(url + "/generate", content=fits, timeout=WAIT_S).status_code == 200


# ----------------------------------------------------------------------------------------------
# client mistakes are 4xx with a JSON message naming the field, never a 500

DEEP = 100_000
MISTAKES = [
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 5}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [True]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [1.5]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": ["3"]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": list(range(20))}}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": 5}, "stop_token_ids"),
    ("/generate", b'{"text": "a\\ud800b"}', "not valid Unicode"),
    ("/v1/completions", b'{"prompt": "\\udfff"}', "not valid Unicode"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "not valid Unicode"),
    ("/generate", b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
    ("/generate", b'{"text": ' * DEEP + b'"a"' + b"}" * DEEP, "nested too deeply"),
    ("/generate", b'{"text": "a", "sampling_params": {"temperature": ' + b"[" * 500 + b"]" * 500 + b"}}",
     "temperature"),
    ("/generate", b'{"text": "a", "sampling_params": {"temperature": 1e999}}', "temperature"),
    ("/generate", b'{"text": "a", "sampling_params": {"temperature": -1e999}}', "temperature"),
    ("/generate", b'{"text": "a", "sampling_params": {"temperature": NaN}}', "temperature"),
    ("/generate", b'{"text": "a", "sampling_params": {"temperature": 1' + b"0" * 400 + b"}}", "temperature"),
    ("/v1/completions", b'{"prompt": "a", "temperature": Infinity}', "temperature"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": True}}, "temperature"),
    ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 1e999}}', "max_new_tokens"),
    ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 1' + b"0" * 400 + b"}}", "context length"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"ignore_eos": 1}}, "ignore_eos"),
    ("/generate", {"text": "a", "sampling_params": "fast"}, "sampling_params"),
    ("/generate", {"input_ids": [True, 1]}, "prompt"),
    ("/generate", {"input_ids": [[1, 2]]}, "prompt"),
    ("/generate", {"input_ids": [1e999]}, "prompt"),
    ("/generate", {"input_ids": [-1]}, "token ids must lie in"),
    ("/generate", {"input_ids": []}, "empty"),
    ("/generate", {"text": 5}, "prompt"),
    ("/generate", {"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    ("/generate", {"text": "a", "rid": ["x"]}, "rid"),
    ("/generate", {"text": "a", "stream": "yes"}, "stream"),
    ("/generate", {"text": "a", **{f"extra{i}": i for i in range(1000)}}, "unknown parameter"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": 1}}, "include_usage"),
    ("/v1/completions", {"prompt": "a", "n": 2}, "n: only 1"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_new_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 1, "content": "x"}]}, "messages"),
    ("/generate", b"[]", "expected a JSON object"),
    ("/generate", b'{"text": "\xff\xfe"}', "malformed JSON"),
    ("/generate", b"", "malformed JSON"),
    ("/generate", b'{"text": "a",}', "malformed JSON"),
]


def test_client_mistakes_are_4xx_with_a_message_never_500():
    with serving(make_service(tokenizer=CharTokenizer())) as url:
        for path, body, expected in MISTAKES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = httpx.post(url + path, content=content, timeout=WAIT_S)
            answer = response.json()
            message = answer["message"] if path.startswith("/v1/") else answer["error"]["message"]
            shown = (path, content[:80], response.status_code, message[:300])
            assert response.status_code == 400 and expected in message, shown
            assert len(message) < 1000, f"a client's value is echoed whole: {shown}"
        good = httpx.post(url + "/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 2,
                                                                                      "stop_token_ids": [3]}},
                          timeout=WAIT_S)
        assert good.status_code == 200, good.text


# ----------------------------------------------------------------------------------------------
# serve's command line: a setting that cannot be served is refused at startup, in one line

@pytest.mark.parametrize("arguments, message", [
    (["--port", "70000"], "argument --port: expected an integer in 0..65535, got 70000"),
    (["--port", "-1"], "argument --port: expected an integer in 0..65535"),
    (["--budget", "5000"], "argument --budget: expected an integer in 1..1024, got 5000"),
    (["--budget", "0"], "argument --budget: expected an integer in 1..1024"),
    (["--context-length", "-5"], "argument --context-length: expected an integer in 2..inf, got -5"),
    (["--max-prompt-tokens", "0"], "argument --max-prompt-tokens"),
    (["--max-batch", "x"], "argument --max-batch: expected an integer, got 'x'"),
    (["--max-body-mb", "nan"], "argument --max-body-mb: expected a finite number > 0"),
    (["--header-timeout", "0"], "argument --header-timeout: expected a finite number > 0"),
    (["--draft-sharpness", "-1"], "argument --draft-sharpness"),
    (["--backend", "triton"], "argument --backend: invalid choice"),
    (["--random-pair", "--context-length", "999999999"], "--context-length: 999999999 is beyond the target's "
                                                         "max_position_embeddings"),
    (["--random-pair", "--context-length", "64", "--max-prompt-tokens", "64"], "--max-prompt-tokens: 64 leaves no "
                                                                                 "room"),
    (["--target", "/nonexistent/k26"], "--target: no checkpoint at /nonexistent/k26"),
])
def test_serve_refuses_bad_settings_in_one_line_naming_the_flag(arguments, message, capsys):
    assert serve_main(arguments) == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and error.startswith("python -m kdtree_lib.serve: ") and message in error, error
