"""Suite `e2e` (bench/e2e.py) on a small grid: records validate, rates follow their formulas.

Not a timing test: it checks what the suite computes from its samples, not how fast anything is.
"""

from __future__ import annotations

import numpy as np
import pytest

from native_helpers import native

pytestmark = pytest.mark.native


def test_e2e_suite_small_grid(tmp_path):
    import bench
    from bench import e2e
    from engine.drafters.block import init_block_drafter
    from engine.reference import model

    lib = native().library()
    w = tmp_path / "weights"
    cfg = model.tiny_config()
    model.save_weights(w, cfg, model.init_weights(cfg, 0))
    init_block_drafter(w, seed=1)
    devices = ["cpu", "cuda"]  # cuda: a record saying why it was skipped, unless a GPU is there
    ctx = bench.Context(out_dir=tmp_path, devices=devices, library=lib, args=dict(
        weights=str(w), prompts=3, new_tokens=12, budgets=[7], qualities=[0.0, 1.0],
        batches=[1, 2], reps=1, block=True))
    out = e2e.run(ctx)
    assert set(out) == {"params", "results", "table"}
    recs = [r for r in out["results"] if "skipped" not in r]
    skipped = [r for r in out["results"] if "skipped" in r]
    if not (lib.has_cuda and lib.cuda_device_count() > 0):
        assert any(r["backend"] == "cuda" and "CUDA" in r["skipped"] for r in skipped), skipped
    cpu = [r for r in recs if r["backend"] == "cpu"]
    # per batch size: AR, oracle 0.0, oracle 1.0, block
    assert len(cpu) == 2 * 4, [r["case"] for r in cpu]
    total = 3 * 12
    for r in recs:
        assert r["validation"]["ok"], f"{r['case']}: {r['validation']}"
        med = float(np.median(r["samples"]))
        assert r["summary"]["median"] == pytest.approx(med, rel=1e-12)
        assert r["rates"]["tokens_per_s"] == pytest.approx(total / med, rel=1e-12)
        assert r["rates"]["mean_accept_length"] >= 1.0
    for bs in (1, 2):
        by = {(r["mode"], r["drafter"]): r for r in cpu if r["batch"] == bs}
        ar = by[("ar", "-")]
        # AR: the prefill + (new_tokens - 1) steps per batch, each counted once per request.
        assert ar["rates"]["target_forwards_per_token"] == 1.0
        assert ar["rates"]["mean_accept_length"] == 1.0
        assert ar["rates"]["speedup_vs_ar"] == pytest.approx(1.0)
        never = by[("ddtree", "oracle:0.0")]["rates"]
        always = by[("ddtree", "oracle:1.0")]["rates"]
        assert never["mean_accept_length"] == 1.0 and never["target_forwards_per_token"] == 1.0
        # Always right: every round accepts at least node 1 (rank 0 at depth 1, always in the
        # tree), so tau >= 2 and 12 tokens take the prefill and at most 6 rounds; tau <= 8
        # (budget 7), so at least 2 rounds.
        assert always["mean_accept_length"] >= 2.0, always
        assert 2 / 12 <= always["target_forwards_per_token"] <= 7 / 12, always
        assert always["target_forwards_per_token"] < never["target_forwards_per_token"]
        for r in by.values():
            assert r["rates"]["speedup_vs_ar"] == pytest.approx(
                float(np.median(ar["samples"])) / float(np.median(r["samples"])), rel=1e-12)
    assert "oracle:1.0" in out["table"] and "block" in out["table"]
