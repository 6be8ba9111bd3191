"""The server's tokenizers: the model folder's byte-level BPE (`tokenizer.json`), else bytes.

    tok = load_tokenizer(weights_dir, vocab_size)   # BPETokenizer, ByteTokenizer or None
    ids = tok.encode("héllo")
    tok.decode(ids) == "héllo"
    dec = tok.stream_decoder(); dec.feed(ids[:1]) + dec.feed(ids[1:]) + dec.feed([], final=True)

`load_tokenizer` picks, in order: the folder's `tokenizer.json` (a HuggingFace `tokenizers`
byte-level BPE, as `python -m engine.cli.model train` saves beside a trained target; loaded by
engine/text.py, which training and the benchmarks use too), else the
byte tokenizer when the model has >= 256 tokens (the tiny random model: text only needs to be
reversible there, not meaningful), else None (the server then takes token ids only).

ByteTokenizer: token id = byte value (0..255). BPETokenizer: each id's bytes come from the BPE
vocabulary through the byte-level alphabet (every byte is one printable character in the
vocabulary's strings; `_byte_alphabet`); an added (special) token decodes as its own content.
Both decode through one StreamDecoder over those bytes, so a stream never splits a UTF-8
character, the concatenated chunks equal the whole decode, and invalid UTF-8 (a random model's
output) becomes U+FFFD the way `bytes.decode(errors="replace")` does. Ids the tokenizer does not
know (the model's vocabulary may be larger: the tiny model has 512 ids, bytes only 256) decode
as `<|id|>`, so that no generated token is silently lost from the text.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

N_BYTES = 256
TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(weights_dir, vocab_size: int):
    """The tokenizer of the model in weights_dir (module docstring), or None."""
    path = Path(weights_dir) / TOKENIZER_FILE
    if path.is_file():
        return BPETokenizer(path, vocab_size)
    return ByteTokenizer(vocab_size) if vocab_size >= N_BYTES else None


class ByteTokenizer:
    name = "bytes"

    def __init__(self, vocab_size: int):
        if vocab_size < N_BYTES:
            raise ValueError(f"ByteTokenizer: vocab_size = {vocab_size} < {N_BYTES}: the model "
                             "cannot hold one token per byte (send token ids instead of text)")
        self.vocab_size = int(vocab_size)
        self._bytes = [bytes([b]) for b in range(N_BYTES)]

    def encode(self, text: str) -> list:
        """UTF-8 bytes of `text` as token ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return self.stream_decoder().feed(ids, final=True)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self._bytes)


def _byte_alphabet() -> dict:
    """{character: byte} of the byte-level BPE alphabet: the printable bytes ('!'..'~',
    '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes, in increasing order, take the
    code points 256, 257, ... (so that no vocabulary string holds a space or control char)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in printable}
    extra = 0
    for b in range(N_BYTES):
        if b not in printable:
            out[chr(N_BYTES + extra)] = b
            extra += 1
    return out


class BPETokenizer:
    """A byte-level BPE `tokenizer.json` loaded by engine/text.py (encode with the library),
    decoded through the vocabulary's bytes (module docstring)."""

    name = "bpe"

    def __init__(self, path, vocab_size: int):
        from engine.text import load_tokenizer as load_text

        path = Path(path)
        self._text = load_text(path, vocab_size)  # ValueError: not loadable, or too many ids
        doc = json.loads(path.read_text())  # the library read it: valid JSON
        decoder = (doc.get("decoder") or {}).get("type")
        if (doc.get("model") or {}).get("type") != "BPE" or decoder != "ByteLevel":
            raise ValueError(f"tokenizer {path}: need a byte-level BPE (model BPE, decoder "
                             f"ByteLevel), got model {(doc.get('model') or {}).get('type')!r}, "
                             f"decoder {decoder!r}")
        self.path, self.vocab_size = path, int(vocab_size)
        alphabet = _byte_alphabet()
        added = {a["id"]: a["content"] for a in doc.get("added_tokens") or []}
        self._bytes = []
        for i in range(self._text.vocab_size):
            s = self._text.token(i)
            if i in added:
                self._bytes.append(added[i].encode("utf-8"))
            elif s is None:
                self._bytes.append(None)  # a hole in the vocabulary: decodes as <|id|>
            else:
                try:
                    self._bytes.append(bytes(alphabet[c] for c in s))
                except KeyError as e:
                    raise ValueError(f"tokenizer {path}: token {i} ({s!r}) holds {e.args[0]!r}, "
                                     "not a byte-level character") from None

    def encode(self, text: str) -> list:
        """Token ids of text (no special tokens added)."""
        return self._text.encode(text)

    def decode(self, ids) -> str:
        return self.stream_decoder().feed(ids, final=True)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self._bytes)


class StreamDecoder:
    """Incremental decode for streaming over a table {id: bytes or None}: a multi-byte character
    split across chunks (or tokens) comes out whole in the chunk that completes it; invalid UTF-8
    becomes U+FFFD; ids without bytes come out as `<|id|>` after what is pending."""

    def __init__(self, table):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids, final: bool = False) -> str:
        out = []
        for t in ids:
            t = int(t)
            b = self._table[t] if 0 <= t < len(self._table) else None
            if b is not None:
                out.append(self._utf8.decode(b))
            else:  # not a byte string: flush what is pending, then the id itself
                out.append(self._utf8.decode(b"", final=True))
                out.append(f"<|{t}|>")
        if final:
            out.append(self._utf8.decode(b"", final=True))
        return "".join(out)
