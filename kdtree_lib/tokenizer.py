"""The stand-in pair's tokenizer: byte-level BPE trained on the corpus's train split.

8192 ids in all: `<|endoftext|>` is id 0 (it ends every corpus file), 8190 byte-level BPE tokens
(the 256 bytes and the merges), and the drafter's `<|mask|>` is the last id, 8191, added after
training as real models add their mask token. Held-out packages never reach the trainer.

Corpus text may contain the literal strings "<|endoftext|>" or "<|mask|>" (transformers' own source
does): they are encoded as plain text, never as the special ids.

    python -m kdtree_lib.tokenizer train  --corpus data/corpus/build   # -> data/models/k26-mini/tokenizer*.json
    python -m kdtree_lib.tokenizer encode --corpus data/corpus/build   # token caches + statistics
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import SPLITS, read_documents
from .paths import MODELS_DIR

TOKENIZER_PATH = MODELS_DIR / "k26-mini" / "tokenizer.json"
VOCAB_SIZE = 8192
EOT = "<|endoftext|>"
MASK = "<|mask|>"
# beside tokenizer.json, so that transformers' AutoTokenizer loads the folder
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
                    "mask_token": MASK, "model_max_length": 4096}


def train_tokenizer(documents, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE with `vocab_size` ids in all: EOT first, MASK last."""
    if vocab_size < 258 + 2:
        raise ValueError(f"vocab_size: expected at least 260 (bytes, specials, a few merges), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.add_special_tokens([MASK])
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"documents: too little text to learn {vocab_size} tokens "
                         f"(got {tokenizer.get_vocab_size()})")
    return tokenizer


def load_tokenizer(path=TOKENIZER_PATH) -> Tokenizer:
    """The committed tokenizer (or another tokenizer.json), set to encode special strings as text."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eot_id, mask_id)."""
    ids = tokenizer.token_to_id(EOT), tokenizer.token_to_id(MASK)
    if None in ids:
        raise ValueError(f"tokenizer: has no {EOT} or {MASK} token")
    return ids


def encode_documents(tokenizer: Tokenizer, documents) -> np.ndarray:
    """uint16 [n_tokens]: every document's tokens followed by EOT."""
    tokenizer.encode_special_tokens = True
    eot, _ = special_ids(tokenizer)
    pieces = []
    batch = []
    for text in documents:
        batch.append(text)
        if len(batch) == 256:
            pieces.extend(_encode_batch(tokenizer, batch, eot))
            batch = []
    pieces.extend(_encode_batch(tokenizer, batch, eot))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def _encode_batch(tokenizer, texts, eot):
    return [np.array([*encoding.ids, eot], dtype=np.uint16) for encoding in tokenizer.encode_batch(texts)]


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def corpus_tokens(build_dir, split: str, tokenizer_path=TOKENIZER_PATH) -> np.ndarray:
    """One split of a corpus build as uint16 tokens, cached beside it per tokenizer hash."""
    cache = Path(build_dir) / f"tokens-{split}-{file_sha256(tokenizer_path)[:12]}.npy"
    if not cache.is_file():
        tokens = encode_documents(load_tokenizer(tokenizer_path), read_documents(build_dir, split))
        np.save(cache.with_suffix(".tmp.npy"), tokens)
        cache.with_suffix(".tmp.npy").replace(cache)
    return np.load(cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdtree_lib.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train on the corpus's train split and write tokenizer.json")
    train.add_argument("--corpus", type=Path, required=True, help="a corpus build folder")
    train.add_argument("--out", type=Path, default=TOKENIZER_PATH)
    train.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    encode = sub.add_parser("encode", help="tokenize both splits (cached) and print statistics")
    encode.add_argument("--corpus", type=Path, required=True)
    encode.add_argument("--tokenizer", type=Path, default=TOKENIZER_PATH)
    args = parser.parse_args(argv)

    if args.command == "train":
        tokenizer = train_tokenizer(read_documents(args.corpus, "train"), args.vocab_size)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(args.out))
        (args.out.parent / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
        eot, mask = special_ids(tokenizer)
        print(f"{args.out}: {tokenizer.get_vocab_size()} ids, {EOT}={eot}, {MASK}={mask}, "
              f"sha256 {file_sha256(args.out)[:16]}")
        return 0
    for split in SPLITS:
        tokens = corpus_tokens(args.corpus, split, args.tokenizer)
        n_bytes = sum(len(text.encode()) for text in read_documents(args.corpus, split))
        print(json.dumps({"split": split, "tokens": int(tokens.size), "bytes": n_bytes,
                          "bytes_per_token": round(n_bytes / max(tokens.size, 1), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
