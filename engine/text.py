"""The saved tokenizer of a trained target: `tokenizer.json` beside the weights (docs/TRAINING.md).

    tok = load_tokenizer("weights/code-small")      # a folder with tokenizer.json, or the file
    ids = tok.encode("def f(x):\n    return x\n")  # list[int], no special tokens added
    tok.decode(ids)                                  # the same text back (byte-level BPE)
    tok.vocab_size, tok.eos_id                       # "<|endoftext|>" separates files in training

A byte-level BPE of the `tokenizers` library (engine.training.bpe trains it): every string
encodes, and decoding the ids of a string gives that string back. Decoding a slice of ids may
end inside a multi-byte character; `decode` then shows U+FFFD for the partial bytes (the
library's behaviour). Below every layer that needs it: the server loads a folder's tokenizer
without importing training code, training and the benchmarks load it the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
EOS = "<|endoftext|>"


class TextTokenizer:
    """A loaded tokenizer.json: encode, decode, vocab_size, eos_id, and the file's path."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # an optional dependency until a folder carries a tokenizer
            raise ImportError(f"{path}: reading a tokenizer needs the `tokenizers` package "
                              "(pip install tokenizers)") from e
        self.path = Path(path)
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises its own exception type for a bad file
            raise ValueError(f"{self.path}: not a tokenizers JSON file: {e}") from e
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._tok.token_to_id(EOS)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts in parallel (the library's threads); without offsets when it can."""
        enc = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [list(e.ids) for e in enc(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, i: int) -> str | None:
        """The vocabulary entry of id i (byte-level form), None outside the vocabulary."""
        return self._tok.id_to_token(int(i))


def load_tokenizer(folder: str | Path, vocab_size: int | None = None) -> TextTokenizer:
    """The tokenizer of a weights folder (its tokenizer.json), or of a tokenizer.json path.

    With `vocab_size` (the model's), a tokenizer with more ids than the model has rows is an
    error naming both numbers; fewer is fine (the model may reserve rows)."""
    p = Path(folder)
    path = p / TOKENIZER_FILE if p.is_dir() else p
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer here (a trained target has one: "
                                "python -m engine.cli.model train --out DIR)")
    tok = TextTokenizer(path)
    if vocab_size is None and p.is_dir() and (p / "config.json").is_file():
        vocab_size = json.loads((p / "config.json").read_text()).get("vocab_size")
    if vocab_size is not None and tok.vocab_size > int(vocab_size):
        raise ValueError(f"{path}: the tokenizer has {tok.vocab_size} ids but the model's "
                         f"vocab_size is {vocab_size}")
    return tok
