"""The benchmarks' trained block drafter (bench/weights.trained_drafter_weights): trained once
per target and settings into the cache, reused, never used when bound to other target weights
or half written; the e2e suite runs block:trained and block:random and records both.

Tiny training budgets (the figures are not asserted beyond "trained beats nothing"); fresh
seeds every run (printed).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import weights as bw
from engine.drafters import block as BD
from engine.remote.provenance import sha256_file
from native_helpers import native

pytestmark = pytest.mark.native

TINY = {"steps": 20, "sequences": 8, "new_tokens": 24}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    native()
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "cache"))
    seed = int(np.random.SeedSequence().entropy % (2**31))
    print(f"seed = {seed}")
    return tmp_path / "cache", seed


def _counting_train(monkeypatch):
    """Wraps engine.training.drafter.train to count the trainings the cache starts."""
    from engine.training import drafter as drafter_train

    calls = []
    real = drafter_train.train

    def train(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(drafter_train, "train", train)
    return calls


def test_trained_once_reused_and_bound_to_its_target(cache, monkeypatch):
    root, seed = cache
    calls = _counting_train(monkeypatch)
    base = bw.tiny_weights()
    settings = dict(TINY, seed=seed)
    f = bw.trained_drafter_weights(base, settings)
    assert f.parent == base.parent and f.name.startswith(base.name + "-drafter-")
    assert len(calls) == 1
    for name in bw.TARGET_FILES:  # the same target bytes as the base folder
        assert sha256_file(f / name) == sha256_file(base / name)
    rec = bw.drafter_record(f)
    assert rec["kind"] == "trained" and rec["trained_steps"] == TINY["steps"]
    assert rec["data_source"] == "native-cpu" and rec["train_seed"] == seed
    assert rec["target_sha256"] == BD.target_sha256(base)
    assert len(rec["held_out_top1_by_depth"]) == BD.load(f)[0].depth
    assert bw.drafter_record(base)["kind"] == "random"

    stamp = (f / BD.WEIGHTS_FILE).stat().st_mtime_ns
    assert bw.trained_drafter_weights(base, settings) == f and len(calls) == 1  # reused
    assert (f / BD.WEIGHTS_FILE).stat().st_mtime_ns == stamp
    # other settings: another folder, trained again
    g = bw.trained_drafter_weights(base, dict(settings, steps=TINY["steps"] + 1))
    assert g != f and len(calls) == 2

    # A drafter bound to other target weights (consistent digests, so only the binding can
    # tell) is never used: the folder is trained again for this target.
    cfg_path = f / BD.CONFIG_FILE
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(cfg, target_sha256="0" * 64)))
    (f / bw.DIGESTS).write_text(json.dumps(bw._digests(f)))
    with pytest.raises(ValueError, match="refusing it"):
        BD.load(f)
    assert bw.trained_drafter_weights(base, settings) == f and len(calls) == 3
    assert BD.load(f)[0].target_sha256 == BD.target_sha256(base)

    # Half written (no digest list, as an interrupted write would leave): trained again.
    (f / bw.DIGESTS).unlink()
    assert bw.trained_drafter_weights(base, settings) == f and len(calls) == 4
    assert not [p for p in f.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_unknown_training_setting_is_an_error(cache):
    with pytest.raises(ValueError, match=r"unknown training settings \['step'\]"):
        bw.trained_drafter_weights(bw.tiny_weights(), {"step": 3})


def test_e2e_suite_runs_trained_and_random_block_drafters(cache, tmp_path):
    import bench
    from bench import e2e

    lib = native().library()
    ctx = bench.Context(out_dir=tmp_path, quick=True, devices=["cpu"], library=lib, args=dict(
        prompts=2, new_tokens=16, budgets=[15], qualities=[1.0], batches=[1], reps=1,
        drafter_steps=TINY["steps"], models=["tiny"]))
    out = e2e.run(ctx)
    drafters = out["params"]["drafters"]
    assert set(drafters) == {"block:trained", "block:random"}, drafters
    assert drafters["block:trained"]["kind"] == "trained"
    assert drafters["block:trained"]["trained_steps"] == TINY["steps"]
    assert drafters["block:random"]["kind"] == "random"
    assert out["params"]["weights"]["path"] == str(bw.tiny_weights())
    recs = {r["drafter"]: r for r in out["results"] if r.get("mode") == "ddtree"}
    assert {"block:trained", "block:random", "oracle:1.0"} <= set(recs), list(recs)
    for r in recs.values():
        assert r["validation"]["ok"], (r["case"], r["validation"])
