"""engine.remote.report: the page and plots from synthetic runs with fresh random medians; its
computed figures are checked against values recomputed here from the same JSON."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from engine.remote import report


def _tree_rec(backend, bs, budget, med, rng):
    s = (med * (1 + 0.01 * rng.random(5))).tolist()
    return {"bench": "tree_build", "backend": backend, "case": {"bs": bs, "budget": budget},
            "validation": {"ok": True}, "samples": s, "summary": {"median": float(np.median(s)), "p10": min(s),
                                                                 "p90": max(s), "min": min(s), "mean": float(np.mean(s)), "n": 5}}


def _att_rec(bs, prefix, tree, med, frac_mm, frac_bw):
    return {"bench": "verify_attention", "backend": "cuda",
            "case": {"bs": bs, "prefix": prefix, "tree": tree, "dtype": "bfloat16"},
            "validation": {"ok": True}, "samples": [med] * 3, "summary": {"median": med},
            "rates": {"frac_matmul_ceiling": {"value": frac_mm}, "frac_copy_ceiling": {"value": frac_bw},
                      "TFLOP_per_s": {"value": frac_mm * 700}, "GB_per_s": {"value": frac_bw * 4000}}}


def _run(root, run_id, rng, speed=1.0):
    d = root / run_id
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"schema": 1, "run_id": run_id, "kind": "bench"}))
    recs = []
    for bs in (1, 4, 64):
        for budget in (15, 255):
            recs.append(_tree_rec("native-cuda", bs, budget, speed * 1e-5 * (1 + budget / 100), rng))
            recs.append(_tree_rec("native-cpu", bs, budget, 1e-6 * bs * budget, rng))
            recs.append(_tree_rec("sglang-cuda", bs, budget, 3e-6 * bs * budget + rng.random() * 1e-4, rng))
    (d / "tree_build.json").write_text(json.dumps({
        "schema": 1, "suite": "tree_build", "status": "ok", "params": {}, "results": recs,
        "table": "backend  bs\n-------  --\n", "provenance": {
            "git": {"sha": "f" * 40, "dirty": False, "branch": "main"},
            "host_facts": {"hostname": "h200-box", "gpus": [{"name": "NVIDIA H200", "driver": "570"}]}},
        "build": {"library": "/r/build/sm_90/libkdtree.so", "arch": "sm_90", "commands": ["nvcc -O3 -c x.cu"]}}))
    att = [_att_rec(bs, p, t, 1e-5 * bs * p / 1024, rng.random(), rng.random())
           for bs in (1, 64) for p in (1024, 32768) for t in (16, 64)]
    (d / "kernels.json").write_text(json.dumps({
        "schema": 1, "suite": "kernels", "status": "ok", "params": {}, "results": att, "table": "",
        "ceilings": {"cuda": {"copy": {"value": 4200.0}, "matmul": {"value": 770.0, "params": {"dtype": "bfloat16", "n": 8192}}}}}))
    e2e = [{"bench": "e2e", "backend": "cuda", "batch": 1, "mode": "ddtree", "budget": 15,
            "drafter": "block", "case": "ddtree B=15 block bs=1", "samples": [0.5, 0.5, 0.5],
            "summary": {"median": 0.5}, "validation": {"ok": True},
            "rates": {"tokens_per_s": 400.0, "target_forwards_per_token": 0.25}}]
    (d / "e2e.json").write_text(json.dumps({"schema": 1, "suite": "e2e", "status": "ok",
                                            "params": {"weights": "/x/e2e_weights"}, "results": e2e, "table": "e2e\n"}))
    (d / "selftest.json").write_text(json.dumps({"suite": "selftest", "params": {}, "results": [
        {"name": "sha256_64KiB", "samples": [1e-5], "summary": {"median": 1e-5}}]}))
    return d


def test_report_page_plots_and_computed_figures(tmp_path, rng):
    host = tmp_path / "results" / "h200"
    _run(host, "20260101T000000Z-aaaaaaa-bench", rng, speed=2.0)
    newest = _run(host, "20260102T000000Z-bbbbbbb-bench", rng)
    (host / "20260103T000000Z-ccccccc-test").mkdir()  # a test run: no suite JSON, ignored
    docs = tmp_path / "docs"
    page = report.write_report(host, docs)
    assert page == docs / "BENCHMARKS_h200.md"
    text = page.read_text()
    assert "run `20260102T000000Z-bbbbbbb-bench`" in text and "NVIDIA H200" in text
    assert "2 run(s)" in text and "nvcc -O3 -c x.cu" in text
    # the speedup in "what this means" equals the one recomputed from the newest JSON
    recs = json.loads((newest / "tree_build.json").read_text())["results"]
    med = {(r["backend"], r["case"]["bs"], r["case"]["budget"]): r["summary"]["median"] for r in recs}
    for bs, budget in ((1, 15), (64, 255)):
        want = med[("sglang-cuda", bs, budget)] / med[("native-cuda", bs, budget)]
        m = re.search(rf"bs = {bs}, budget = {budget}: native-cuda .*?\*\*([0-9.]+)x\*\*", text)
        assert m and float(m.group(1)) == pytest.approx(want, rel=0.06), (m and m.group(0), want)
    # attention: the best matmul fraction of the newest run, as a percentage
    att = json.loads((newest / "kernels.json").read_text())["results"]
    best = max(r["rates"]["frac_matmul_ceiling"]["value"] for r in att)
    assert report._pct(best) in text
    # the share of a step bounded by attention: 61 layers x the bf16 P=32768 bs=1 T=16 median
    step = 61 * next(r["summary"]["median"] for r in att if r["case"] == {
        "bs": 1, "prefix": 32768, "tree": 16, "dtype": "bfloat16"})
    assert report._pct(med[("native-cuda", 1, 15)] / step) in text
    # the e2e step: batch / (forwards per token x tokens/s) = 1 / (0.25 x 400) = 10 ms
    assert "bs = 1, DDTree budget 15, drafter block): 10.00 ms per target forward" in text
    assert report._pct(med[("native-cuda", 1, 15)] / 0.01) + " of it" in text
    # plots exist, are PNGs, and the page links every one
    pngs = sorted(docs.glob("BENCHMARKS_h200_*.png"))
    assert {p.stem.split("h200_")[1] for p in pngs} == {"tree_vs_batch", "tree_vs_budget", "speedup",
                                                         "attention", "history"}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({p.name})" in text
    assert "sha256_64KiB" in text  # a generic suite still gets a table
    assert text.count("| `2026010") == 2  # history: one line per bench run


def test_report_is_reproducible(tmp_path, rng):
    host = tmp_path / "h200"
    _run(host, "20260101T000000Z-aaaaaaa-bench", rng)
    a = report.write_report(host, tmp_path / "d1")
    b = report.write_report(host, tmp_path / "d2")
    assert a.read_text() == b.read_text()
    for p in sorted((tmp_path / "d1").glob("*.png")):
        assert p.read_bytes() == (tmp_path / "d2" / p.name).read_bytes(), p.name


def test_report_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        report.write_report(tmp_path / "nowhere", tmp_path / "docs")
    (tmp_path / "h" / "run1").mkdir(parents=True)
    with pytest.raises(ValueError, match="no run under .*h holds"):
        report.write_report(tmp_path / "h", tmp_path / "docs")


def test_report_with_a_failed_suite(tmp_path, rng):
    host = tmp_path / "h200"
    d = _run(host, "20260101T000000Z-aaaaaaa-bench", rng)
    (d / "e2e.json").write_text(json.dumps({"schema": 1, "suite": "e2e", "status": "failed",
                                            "error": "RuntimeError: bench/e2e.py is not in this checkout",
                                            "results": [], "table": ""}))
    text = report.write_report(host, tmp_path / "docs").read_text()
    assert "### e2e (FAILED)" in text and "not in this checkout" in text


def test_report_reads_only_complete_runs_and_counts_the_skipped(tmp_path, rng):
    """A dead fetch's .incoming-* folder and a run without a final manifest are not read (their
    figures would show up as the newest run) and the page says how many folders were skipped."""
    host = tmp_path / "results" / "h200"
    _run(host, "20260101T000000Z-aaaaaaa-bench", rng)
    late = _run(host, "20260103T000000Z-ccccccc-bench", rng, speed=50.0)
    (late / "manifest.json").unlink()
    _run(host, ".incoming-20260104T000000Z-ddddddd-bench-77", rng, speed=50.0)
    (host / "20260102T000000Z-bbbbbbb-test").mkdir()
    (host / "20260102T000000Z-bbbbbbb-test" / "manifest.json").write_text('{"kind": "test"}')
    runs, skipped = report.load_runs(host)
    assert [r["id"] for r in runs] == ["20260101T000000Z-aaaaaaa-bench"]
    assert sorted(n for n, _ in skipped) == [".incoming-20260104T000000Z-ddddddd-bench-77",
                                             "20260102T000000Z-bbbbbbb-test",
                                             "20260103T000000Z-ccccccc-bench"]
    page = report.write_report(host, tmp_path / "docs").read_text()
    assert "3 folder(s) skipped" in page and "ccccccc" not in page.split("## Runs shown")[1]
    assert "no final manifest.json" in page
    (host / "20260101T000000Z-aaaaaaa-bench" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="no final manifest.json"):
        report.write_report(host, tmp_path / "docs")


def test_page_names_partial_runs_and_failed_bench_runs_as_such(tmp_path, rng):
    """A timed-out or interrupted bench run is not called complete; a failed bench run without
    suite JSON is named a failed bench run (its summary), not "(a test run?)"."""
    host = tmp_path / "results" / "h200"
    _run(host, "20260101T000000Z-aaaaaaa-bench", rng)
    page = report.write_report(host, tmp_path / "docs").read_text()
    assert "Every folder there is a complete benchmark run whose steps all finished ok." in page
    late = _run(host, "20260102T000000Z-bbbbbbb-bench", rng)
    (late / "manifest.json").write_text(json.dumps({
        "kind": "bench", "ok": False, "state": "complete",
        "summary": "bench: bench failed (timed out after 3600 s; its process group was killed)"}))
    dead = host / "20260103T000000Z-ccccccc-bench"
    dead.mkdir()
    (dead / "manifest.json").write_text(json.dumps({"kind": "bench", "ok": False, "state": "interrupted",
                                                   "summary": "INTERRUPTED (SIGTERM): bench: bench interrupted"}))
    page = report.write_report(host, tmp_path / "docs").read_text()
    assert "Every folder" not in page and "a test run" not in page
    assert "`20260103T000000Z-ccccccc-bench` (a bench run that interrupted with no suite JSON" in page
    assert "1 run(s) below are partial" in page and "bbbbbbb-bench` (did not finish ok: bench: bench failed (timed out" in page
