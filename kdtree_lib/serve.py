"""Serve a pair over HTTP with SGLang's endpoints (kdtree_lib.serving.server says which and how).

    python -m kdtree_lib.serve                                # the stand-in pair, DDTree budget 32, port 30000
    python -m kdtree_lib.serve --target PATH --drafter PATH --method ddtree --budget 32 --port 30000
    python -m kdtree_lib.serve --random-pair --method chain   # the tiny random pair (tests; no checkpoint)

The tokenizer is the target folder's (Kimi's tiktoken.model, or a tokenizer.json; without one the server
takes token-id prompts only). The random pair's vocabulary is its tokenizer's (the stand-in's 8192 ids
unless --tokenizer names another folder).

The server listens on 127.0.0.1 unless --host says otherwise, and prints one line, "kdtree server
listening on URL", once it accepts requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

from .decode import METHODS
from .pairs import load_pair, random_pair, stand_in_paths
from .serving.server import Engine, EngineSettings, Service, serve
from .tokenizer import TIKTOKEN_FILE, TOKENIZER_PATH, load_text_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_service(args) -> Service:
    """The pair, tokenizer and engine the arguments name."""
    dtype = DTYPES[args.dtype]
    if args.random_pair:
        tokenizer_folder = args.tokenizer or TOKENIZER_PATH.parent
        tokenizer = load_text_tokenizer(tokenizer_folder)
        target, drafter = random_pair(vocab=tokenizer.vocab_size, device=args.device, dtype=dtype,
                                      draft_sharpness=args.draft_sharpness)
        name, reported = "random-pair", {"model_path": None, "speculative_draft_model_path": None}
    else:
        tokenizer_folder = args.tokenizer or args.target
        has_tokenizer = any((tokenizer_folder / file).is_file() for file in (TIKTOKEN_FILE, "tokenizer.json"))
        tokenizer = load_text_tokenizer(tokenizer_folder) if has_tokenizer else None
        if tokenizer is None:
            print(f"no {TIKTOKEN_FILE} or tokenizer.json in {tokenizer_folder}: serving token-id prompts only",
                  file=sys.stderr)
        target, drafter = load_pair(args.target, args.drafter, device=args.device, dtype=dtype)
        name = args.target.name
        reported = {"model_path": str(args.target), "speculative_draft_model_path": str(args.drafter)}
    eos = target.config.eos_token_id
    stops = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    settings = EngineSettings(method=args.method, budget=args.budget, max_batch=args.max_batch,
                              max_queue=args.max_queue, backend=args.backend)
    context = args.context_length or target.config.max_position_embeddings
    reported.update(tokenizer_path=str(tokenizer_folder) if tokenizer is not None else None, device=args.device,
                    dtype=args.dtype)
    return Service(Engine(target, drafter, settings), tokenizer=tokenizer, model_name=name, context_length=context,
                   stop_tokens=stops, reported=reported)


def main(argv=None) -> int:
    target, drafter = stand_in_paths()
    parser = argparse.ArgumentParser(prog="python -m kdtree_lib.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=target, help="target checkpoint folder (default: the stand-in)")
    parser.add_argument("--drafter", type=Path, default=drafter, help="DFlash drafter folder (default: the stand-in's)")
    parser.add_argument("--random-pair", action="store_true", help="serve the tiny random pair instead (no files)")
    parser.add_argument("--draft-sharpness", type=float, default=1.0,
                        help="the random pair's drafter: small values give flat drafts (pairs.random_pair)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a folder with tiktoken.model or tokenizer.json (default: the target's; the stand-in's "
                             "for --random-pair)")
    parser.add_argument("--method", choices=METHODS, default="ddtree")
    parser.add_argument("--budget", type=int, default=32, help="draft nodes per tree (the chain drafts min(budget, D))")
    parser.add_argument("--max-batch", type=int, default=8, help="requests per decode batch")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get HTTP 503")
    parser.add_argument("--context-length", type=int, default=None,
                        help="longest prompt + new tokens accepted (default: the target's max_position_embeddings)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--backend", default="auto", help="the tree ops' backend (numpy, torch, cupy, auto)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 is fastest for small pairs on a busy CPU)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: a free port (printed)")
    args = parser.parse_args(argv)
    for name in ("budget", "max_batch", "max_queue", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer")
    if args.threads:
        torch.set_num_threads(args.threads)
    service = build_service(args)
    print(json.dumps({key: value for key, value in service.server_info().items() if key != "internal_states"}),
          flush=True)
    asyncio.run(serve(service, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
