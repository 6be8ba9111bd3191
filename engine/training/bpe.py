"""Byte-level BPE trained on the corpus' training files with the `tokenizers` library.

GPT-2's byte-level pre-tokenizer (runs of spaces stay one piece, so Python's indentation costs
a token or two per line), the 256 byte symbols first, `<|endoftext|>` (engine.text.EOS, the file
separator of the training stream) as id 0, then merges up to `vocab_size`. Saved as
tokenizer.json beside the weights; engine.text.load_tokenizer reads it.
"""

from __future__ import annotations

from pathlib import Path

from engine.text import EOS, TOKENIZER_FILE


def train_bpe(texts: list[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Trains on `texts` (in order), saves out_dir/tokenizer.json and returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"train_bpe: vocab_size = {vocab_size}: need more than the 256 byte "
                         "symbols and the end-of-text token")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    path = Path(out_dir) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
