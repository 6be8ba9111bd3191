"""Test helpers: a small byte-level BPE tokenizer.json trained on a few strings (the shape that
`python -m engine.cli.model train` saves beside a trained target), for the server's text path
and the suites' code-small path on the tiny model."""

from __future__ import annotations

from pathlib import Path

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "import os\nimport sys\n\nfor name in sorted(os.listdir('.')):\n    print(name, file=sys.stderr)\n",
    "# héllo wörld: naïve café, 你好, emoji 🎉 in a comment\n",
]


def train_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    """Writes a byte-level BPE tokenizer.json of at most vocab_size tokens at path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS * 20, trainer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
