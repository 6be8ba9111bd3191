"""The trivial byte-level tokenizer of the server: token id = byte value (0..255).

    tok = ByteTokenizer(vocab_size=512)
    ids = tok.encode("héllo")            # [104, 195, 169, 108, 108, 111]: UTF-8 bytes
    tok.decode(ids) == "héllo"
    dec = tok.stream_decoder(); dec.feed([195]) == ""; dec.feed([169]) == "é"

Our models are random or tiny, so text only needs to be reversible, not meaningful: the load
generator and tests talk in token ids and use text only through this mapping. Ids at or above
256 (the tiny model's vocabulary is 512) have no byte; they decode as `<|id|>` so that no token
is silently lost from the text.
"""

from __future__ import annotations

import codecs

N_BYTES = 256


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < N_BYTES:
            raise ValueError(f"ByteTokenizer: vocab_size = {vocab_size} < {N_BYTES}: the model "
                             "cannot hold one token per byte (send token ids instead of text)")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list:
        """UTF-8 bytes of `text` as token ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return self.stream_decoder().feed(ids, final=True)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder()


class StreamDecoder:
    """Incremental decode for streaming: a multi-byte character split across chunks comes out
    whole in the chunk that completes it; invalid UTF-8 becomes U+FFFD."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids, final: bool = False) -> str:
        out = []
        for t in ids:
            t = int(t)
            if t < N_BYTES:
                out.append(self._utf8.decode(bytes([t])))
            else:  # not a byte: flush what is pending, then the id itself
                out.append(self._utf8.decode(b"", final=True))
                out.append(f"<|{t}|>")
        if final:
            out.append(self._utf8.decode(b"", final=True))
        return "".join(out)
