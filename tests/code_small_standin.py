"""STAND-IN for code-small in tests (not the trained target): the tiny model's folder with its
trained block drafter (bench/weights.py), a BPE tokenizer.json trained here on a few strings
(bpe_helpers) and a small train.json, in place of bench/weights.code_small_weights; and STUB
held-out prompts (windows of the encoded bpe_helpers texts) in place of
engine.training.corpus.heldout_prompts. `install(monkeypatch, root)` puts both behind the seams
of bench/models.py, so the suites' code-small path runs in seconds on the CPU without the
training code. What this cannot test: that code-small is a trained language model (tau, losses):
the H200 pipeline run measures that."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from bpe_helpers import TEXTS, train_tokenizer

TRAIN_RECORD = {"stand_in": True, "steps": 3, "tokens_seen": 1234, "train_loss": 5.1,
                "heldout_loss": 5.3, "unigram_loss": 5.9, "wall_s": 0.1,
                "corpus": {"root": "stand-in", "digest": "0" * 64, "files": 4,
                           "split": {"rule": "stand-in", "train_files": 3, "heldout_files": 1}}}


def make_folder(root: Path, device: str = "cpu") -> Path:
    from bench import weights as bw

    settings = {**bw.DRAFTER_TRAIN_QUICK, "steps": 20}  # the e2e quick tests' tiny drafter
    src = bw.trained_drafter_weights(bw.tiny_weights(), settings, device=device)
    folder = Path(root) / "code-small-standin"
    if folder.exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.copytree(src, tmp)
    vocab = json.loads((tmp / "config.json").read_text())["vocab_size"]
    train_tokenizer(tmp / "tokenizer.json", vocab_size=vocab - 40)
    (tmp / "train.json").write_text(json.dumps(TRAIN_RECORD))
    tmp.rename(folder)
    return folder


def stub_heldout_prompts(folder, n, prompt_tokens, seed):
    """STUB: n windows of the encoded test texts, lengths in prompt_tokens ([lo, hi] or int)."""
    from engine.serving.tokenizer import BPETokenizer

    tok = BPETokenizer(Path(folder) / "tokenizer.json", 10**6)
    ids = tok.encode("".join(TEXTS))
    lo, hi = (prompt_tokens, prompt_tokens) if isinstance(prompt_tokens, int) else prompt_tokens
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(lo, hi + 1))
        at = int(rng.integers(0, len(ids) - k))
        out.append(ids[at:at + k])
    return out


def install(monkeypatch, root: Path) -> dict:
    """Stands the folder and the stub in for bench/models.py's seams; returns the calls seen."""
    from bench import models as bm

    calls = {"weights": [], "prompts": []}

    def weights(device, minutes, toy):
        calls["weights"].append({"device": device, "minutes": minutes, "toy": toy})
        return make_folder(root, device)

    def prompts(folder, n, prompt_tokens, seed):
        calls["prompts"].append((str(folder), n, prompt_tokens, seed))
        return stub_heldout_prompts(folder, n, prompt_tokens, seed)

    monkeypatch.setattr(bm, "code_small_weights", weights)
    monkeypatch.setattr(bm, "heldout_prompts", prompts)
    return calls
