"""The stand-in pair's tokenizer: byte-level BPE trained on the corpus's train split.

8192 ids in all: `<|endoftext|>` is id 0 (it ends every corpus file), 8190 byte-level BPE tokens
(the 256 bytes and the merges), and the drafter's `<|mask|>` is the last id, 8191, added after
training as real models add their mask token. Held-out packages never reach the trainer.

Corpus text may contain the literal strings "<|endoftext|>" or "<|mask|>" (transformers' own source
does): they are encoded as plain text, never as the special ids.

    python -m kdtree_lib.tokenizer train  --corpus data/corpus/build   # -> data/models/k26-mini/tokenizer*.json
    python -m kdtree_lib.tokenizer encode --corpus data/corpus/build   # token caches + statistics

The real target's tokenizer is Kimi's tiktoken BPE: `tiktoken.model` (one "base64(token) rank" line
per base token, ranks 0..n-1) and `tokenizer_config.json`, whose `added_tokens_decoder` names the
special ids; like Kimi's tokenization_kimi.py, the KIMI_RESERVED_SPECIAL_TOKENS ids after the base
vocabulary are all special, the unnamed ones `<|reserved_token_{id}|>`, and text is split by
KIMI_PATTERN. `load_text_tokenizer(folder)` reads either kind (tiktoken.model, else tokenizer.json)
into one interface: encode(text) / decode(ids), special ids by name, bos/eos.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from . import cli
from .corpus import SPLITS, read_documents
from .paths import MODELS_DIR

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
KIMI_RESERVED_SPECIAL_TOKENS = 256
KIMI_PATTERN = "|".join([   # tokenization_kimi.py's pat_str
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

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


# ----------------------------------------------------------------------------------------------
# a checkpoint folder's tokenizer: Kimi's tiktoken files, or a tokenizer.json

class TextTokenizer:
    """Text <-> ids for a checkpoint folder. Special strings in text stay text unless
    allow_special; `special` maps every special token's name to its id."""

    def __init__(self, encode, decode, special: dict[str, int], vocab_size: int, bos: str | None, eos: str | None):
        self._encode, self._decode = encode, decode
        self.special, self.vocab_size = special, vocab_size
        self.bos_id = special.get(bos) if bos else None
        self.eos_id = special.get(eos) if eos else None

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return self._encode(text, allow_special)

    def decode(self, ids) -> str:
        return self._decode([int(i) for i in ids])


def load_text_tokenizer(folder) -> TextTokenizer:
    """The tokenizer of a checkpoint folder: Kimi's tiktoken.model + tokenizer_config.json, else a
    tokenizer.json (the stand-in's)."""
    folder = Path(folder)
    if (folder / TIKTOKEN_FILE).is_file():
        return load_tiktoken(folder)
    if (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _tokenizer_config(folder)
        special = {token.content: index for index, token in tokenizer.get_added_tokens_decoder().items()}

        def encode(text, allow_special):
            tokenizer.encode_special_tokens = not allow_special
            # encode_batch releases the interpreter lock while it works (encode holds it: a 1 MB text
            # stalled every other thread for a second), so a server's tokenising thread stalls nobody
            return tokenizer.encode_batch([text])[0].ids
        return TextTokenizer(encode, tokenizer.decode, special, tokenizer.get_vocab_size(),
                             _token_name(config.get("bos_token")), _token_name(config.get("eos_token")))
    raise ValueError(f"folder: neither {TIKTOKEN_FILE} nor tokenizer.json in {folder}")


def load_tiktoken(folder) -> TextTokenizer:
    """Kimi's tokenizer from tiktoken.model and tokenizer_config.json, with the tiktoken package."""
    import tiktoken
    folder = Path(folder)
    model = folder / TIKTOKEN_FILE
    ranks = read_tiktoken_ranks(model)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{model}: ranks are not 0..{len(ranks) - 1}")
    config = _tokenizer_config(folder)
    named = {}
    for index, entry in (config.get("added_tokens_decoder") or {}).items():
        if not (isinstance(entry, dict) and "content" in entry and str(index).isdigit()):
            raise ValueError(f"{folder / TOKENIZER_CONFIG_FILE}: added_tokens_decoder[{index!r}] needs an integer "
                             "id and a 'content'")
        named[int(index)] = entry["content"]
    base = len(ranks)
    reserved = range(base, base + KIMI_RESERVED_SPECIAL_TOKENS)
    outside = sorted(set(named) - set(reserved))
    if outside:
        raise ValueError(f"{folder / TOKENIZER_CONFIG_FILE}: added_tokens_decoder ids {outside[:5]} lie outside "
                         f"the special range {base}..{reserved[-1]}")
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in reserved}
    encoding = tiktoken.Encoding(name=folder.name or "kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=special)

    def encode(text, allow_special):
        return encoding.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
    return TextTokenizer(encode, encoding.decode, special, base + KIMI_RESERVED_SPECIAL_TOKENS,
                         _token_name(config.get("bos_token")), _token_name(config.get("eos_token")))


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken BPE file, read directly (tiktoken's loader caches files by
    path under the temp folder, so a folder rewritten in place would read stale ranks)."""
    import base64
    import binascii
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}: line {number} is not 'base64(token) rank'") from None
    return ranks


def save_tiktoken(folder, ranks: dict[bytes, int], special: dict[int, str], *, bos: str, eos: str) -> Path:
    """Write tiktoken.model and tokenizer_config.json in Kimi's layout (a made-to-format tokenizer)."""
    import base64
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda t: t[1])]
    (folder / TIKTOKEN_FILE).write_text("\n".join(lines) + "\n")
    decoder = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for i, name in sorted(special.items())}
    config = {"added_tokens_decoder": decoder, "bos_token": bos, "eos_token": eos, "tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}, "model_max_length": 262144}
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _tokenizer_config(folder: Path) -> dict:
    path = folder / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None


def _token_name(token) -> str | None:
    """A tokenizer_config token entry: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


@cli.command
def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.tokenizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train on the corpus's train split and write tokenizer.json")
    train.add_argument("--corpus", type=Path, required=True, help="a corpus build folder")
    train.add_argument("--out", type=Path, default=TOKENIZER_PATH)
    train.add_argument("--vocab-size", type=cli.positive_int, default=VOCAB_SIZE)
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
