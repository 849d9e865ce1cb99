"""The committed byte-level BPE tokenizer and the training/encoding helpers."""
import json

import numpy as np
import pytest

from kdtree_lib import tokenizer as tk

CODE = 'def f(x):\n    """<|endoftext|> and <|mask|> are text here."""\n    return x  # é ✓\n'


def test_committed_tokenizer_layout_and_round_trip():
    tokenizer = tk.load_tokenizer()
    assert tokenizer.get_vocab_size() == tk.VOCAB_SIZE == 8192
    assert tk.special_ids(tokenizer) == (0, 8191)
    ids = tokenizer.encode(CODE).ids
    assert tokenizer.decode(ids) == CODE
    assert 0 not in ids and 8191 not in ids  # literal special strings stay text


def test_training_is_deterministic_and_encode_appends_eot(tmp_path):
    docs = [f"def f{i}(a, b):\n    return a * {i} + b\n" for i in range(200)]
    first, second = tk.train_tokenizer(docs, 300), tk.train_tokenizer(docs, 300)
    assert first.to_str() == second.to_str()
    assert tk.special_ids(first) == (0, 299)
    tokens = tk.encode_documents(first, docs[:3])
    assert tokens.dtype == np.uint16 and (tokens == 0).sum() == 3 and tokens[-1] == 0
    with pytest.raises(ValueError, match="vocab_size"):
        tk.train_tokenizer(docs, 100)


def test_corpus_tokens_cached_per_tokenizer(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    for split, text in (("train", "x = 1\n"), ("heldout", "y = 2\n")):
        (build / f"corpus-{split}.jsonl").write_text(json.dumps({"package": "p", "path": "p/a.py", "text": text}) + "\n")
    tokens = tk.corpus_tokens(build, "heldout")
    assert tk.load_tokenizer().decode(tokens[:-1].tolist()) == "y = 2\n"
    assert len(list(build.glob("tokens-heldout-*.npy"))) == 1
    assert np.array_equal(tk.corpus_tokens(build, "heldout"), tokens)
