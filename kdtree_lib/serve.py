"""Serve a pair over HTTP with SGLang's endpoints (kdtree_lib.serving.server says which and how).

    python -m kdtree_lib.serve                                # the stand-in pair, DDTree budget 32, port 30000
    python -m kdtree_lib.serve --target PATH --drafter PATH --method ddtree --budget 32 --port 30000
    python -m kdtree_lib.serve --random-pair --method chain   # the tiny random pair (tests; no checkpoint)

The tokenizer is the target folder's (Kimi's tiktoken.model, or a tokenizer.json; without one the server
takes token-id prompts only). The random pair's vocabulary is its tokenizer's (the stand-in's 8192 ids
unless --tokenizer names another folder).

The server listens on 127.0.0.1 unless --host says otherwise, and prints one line, "kdtree server
listening on URL", once it accepts requests. A bad argument, or a pair that cannot be served with
them, is refused at startup in one line naming the flag (exit status 2), never per request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

from . import cli
from .contracts import MAX_BUDGET
from .backend import BACKENDS
from .decode import METHODS
from .pairs import load_pair, random_pair, stand_in_paths
from .serving.engine import Engine, EngineSettings
from .serving.server import HEADER_TIMEOUT_S, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, Service, serve
from .tokenizer import TIKTOKEN_FILE, TOKENIZER_PATH, load_text_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_service(args) -> Service:
    """The pair, tokenizer and engine the arguments name."""
    dtype = DTYPES[args.dtype]
    if args.tokenizer is not None and not any((args.tokenizer / file).is_file()
                                              for file in (TIKTOKEN_FILE, "tokenizer.json")):
        raise ValueError(f"--tokenizer: neither {TIKTOKEN_FILE} nor tokenizer.json in {args.tokenizer}")
    if args.random_pair:
        tokenizer_folder = args.tokenizer or TOKENIZER_PATH.parent
        tokenizer = load_text_tokenizer(tokenizer_folder)
        target, drafter = random_pair(vocab=tokenizer.vocab_size, device=args.device, dtype=dtype,
                                      draft_sharpness=args.draft_sharpness)
        name, reported = "random-pair", {"model_path": None, "speculative_draft_model_path": None}
    else:
        for flag, folder in (("--target", args.target), ("--drafter", args.drafter)):
            if not (folder / "config.json").is_file():
                raise ValueError(f"{flag}: no checkpoint at {folder} (its config.json is missing)")
        tokenizer_folder = args.tokenizer or args.target
        has_tokenizer = any((tokenizer_folder / file).is_file() for file in (TIKTOKEN_FILE, "tokenizer.json"))
        target, drafter = load_pair(args.target, args.drafter, device=args.device, dtype=dtype)
        tokenizer = load_text_tokenizer(tokenizer_folder) if has_tokenizer else None
        if tokenizer is None:
            print(f"no {TIKTOKEN_FILE} or tokenizer.json in {tokenizer_folder}: serving token-id prompts only",
                  file=sys.stderr)
        name = args.target.name
        reported = {"model_path": str(args.target), "speculative_draft_model_path": str(args.drafter)}
    eos = target.config.eos_token_id
    stops = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    settings = EngineSettings(method=args.method, budget=args.budget, max_batch=args.max_batch,
                              max_queue=args.max_queue, backend=args.backend)
    longest = target.config.max_position_embeddings
    if args.context_length is not None and args.context_length > longest:
        raise ValueError(f"--context-length: {args.context_length} is beyond the target's max_position_embeddings "
                         f"({longest})")
    context = args.context_length or longest
    if args.max_prompt_tokens is not None and args.max_prompt_tokens >= context:
        raise ValueError(f"--max-prompt-tokens: {args.max_prompt_tokens} leaves no room for a new token in the "
                         f"context length {context}")
    reported.update(tokenizer_path=str(tokenizer_folder) if tokenizer is not None else None, device=args.device,
                    dtype=args.dtype)
    return Service(Engine(target, drafter, settings), tokenizer=tokenizer, model_name=name, context_length=context,
                   max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=max(1, int(args.max_body_mb * 2**20)),
                   header_timeout_s=args.header_timeout, stop_tokens=stops, reported=reported)


def device(text: str) -> str:
    """An argparse type: a torch device this machine has."""
    try:
        chosen = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text} needs a CUDA GPU, and torch sees none")
    if chosen.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


@cli.command
def main(argv=None) -> int:
    target, drafter = stand_in_paths()
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=target, help="target checkpoint folder (default: the stand-in)")
    parser.add_argument("--drafter", type=Path, default=drafter, help="DFlash drafter folder (default: the stand-in's)")
    parser.add_argument("--random-pair", action="store_true", help="serve the tiny random pair instead (no files)")
    parser.add_argument("--draft-sharpness", type=cli.positive_float, default=1.0,
                        help="the random pair's drafter: small values give flat drafts (pairs.random_pair)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a folder with tiktoken.model or tokenizer.json (default: the target's; the stand-in's "
                             "for --random-pair)")
    parser.add_argument("--method", choices=METHODS, default="ddtree")
    parser.add_argument("--budget", type=cli.integer_in(1, MAX_BUDGET), default=32,
                        help=f"draft nodes per tree, 1..{MAX_BUDGET} (the chain drafts min(budget, D))")
    parser.add_argument("--max-batch", type=cli.integer_in(1), default=8, help="requests per decode batch")
    parser.add_argument("--max-queue", type=cli.integer_in(1), default=256, help="waiting requests beyond this get HTTP 503")
    parser.add_argument("--context-length", type=cli.integer_in(2), default=None,
                        help="longest prompt + new tokens accepted (default: the target's max_position_embeddings)")
    parser.add_argument("--max-prompt-tokens", type=cli.integer_in(1), default=None,
                        help=f"longer prompts get HTTP 400 (default: {MAX_PROMPT_TOKENS}, or less than the context "
                             "length; a CPU prefills a long prompt for minutes, a GPU takes more)")
    parser.add_argument("--max-body-mb", type=cli.positive_float, default=MAX_BODY_BYTES / 2**20,
                        help="larger request bodies get HTTP 413 (MiB, default %(default)g)")
    parser.add_argument("--header-timeout", type=cli.positive_float, default=HEADER_TIMEOUT_S,
                        help="seconds a connection has to send its request headers (default %(default)g)")
    parser.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="the tree ops' backend")
    parser.add_argument("--threads", type=cli.integer_in(1), default=None,
                        help="torch CPU threads (default: torch's; 1 is fastest for small pairs on a busy CPU)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=cli.integer_in(0, 65535), default=30000, help="0: a free port (printed)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    service = build_service(args)  # a pair or a setting that cannot be served: cli.command's one line
    print(json.dumps({key: value for key, value in service.server_info().items() if key != "internal_states"}),
          flush=True)
    try:
        asyncio.run(serve(service, args.host, args.port))
    except OSError as err:  # the socket could not be bound (the only OSError serve lets out)
        parser.error(f"--host/--port: cannot listen on {args.host}:{args.port} ({err.strerror or err})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
