"""Test helper: the suites' code-small on the CPU in seconds: the real training path
(bench/weights.code_small_weights, toy preset) on a small corpus of stdlib modules, a few steps,
cached for the test session. `install(monkeypatch, cache)` points bench/models.py's
`code_small_weights` at it (held-out prompts stay the real ones: cut from this corpus's held-out
files). What this cannot show: that code-small learns enough for a real tau; the H200 pipeline
run with the full preset measures that."""

from __future__ import annotations

import shutil
from pathlib import Path

STEPS = 30


def small_corpus(dst: Path) -> Path:
    """A few top-level stdlib modules of 3-30 KB, two of them held out by the split rule."""
    from engine.training import corpus as C

    if dst.is_dir():
        return dst
    held, train = [], []
    for p in sorted(C.stdlib_root().glob("*.py")):
        if 3000 < p.stat().st_size < 30000:
            (held if C.is_heldout(p.name) else train).append(p)
    assert len(held) >= 2, "the stdlib has too few small held-out top-level modules"
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in held[:2] + train[:16]:
        shutil.copyfile(p, tmp / p.name)
    tmp.rename(dst)
    return dst


def install(monkeypatch, cache: Path) -> list:
    """bench.models.code_small_weights -> the toy on small_corpus(cache / "corpus") in `cache`;
    returns the calls the suites made (device, minutes, toy)."""
    from bench import models as bm
    from bench import weights as bw

    calls = []
    corpus = small_corpus(Path(cache) / "corpus")

    def weights(device, minutes, toy):
        calls.append({"device": device, "minutes": minutes, "toy": toy})
        return bw.code_small_weights(device, minutes=5.0, cache=Path(cache), toy=True,
                                     corpus=corpus, steps=STEPS)

    monkeypatch.setattr(bm, "code_small_weights", weights)
    return calls
