"""engine.remote.report_code_small: the code-small section of the report from synthetic e2e and
service JSON with fresh random figures (tau, speedups, histograms, losses), checked against
values recomputed here; tiny's sections leave code-small's records out; the whole page with
its accept-length plot from a run folder."""

from __future__ import annotations

import json

import numpy as np

from engine.remote import report, report_meaning as rm
from engine.remote.report_code_small import HIST_BINS, code_small_lines, hist_shares

TRAINING = {"config_name": "small", "parameters": 27_000_000, "active_parameters": 12_000_000,
            "vocab_size": 4096, "corpus_root": "/usr/lib/python3.12", "corpus_digest": "ab" * 32,
            "corpus_files": 1786, "train_files": 1694, "heldout_files": 92, "steps": 5000,
            "tokens_seen": 80_000_000, "tokens_per_second": 500000.0, "device": "cuda",
            "device_name": "NVIDIA H200", "drafter_steps": 800, "tau_estimate": 4.2,
            "drafter_held_out_top1_by_depth": [0.8, 0.6, 0.5], "seconds": {"wall": 210.0, "target": 150.0}}


def _hist(rng, n):
    h = [0] + rng.integers(0, 20, size=n).tolist()
    h[1] += 1
    return h


def _suites(rng, identical=True, tiny_speedup=0.3):
    e2e, cs = [], {}
    for model in ("tiny", "code-small"):
        for b in (1, 8):
            e2e.append({"bench": "e2e", "backend": "cuda", "model": model, "batch": b, "mode": "ar",
                        "budget": 0, "drafter": "-", "summary": {"median": 1.0},
                        "validation": {"ok": True},
                        "rates": {"tokens_per_s": float(rng.uniform(100, 900)),
                                  "target_forwards_per_token": 1.0, "mean_accept_length": 1.0,
                                  "speedup_vs_ar": 1.0}, "accept_hist": [0, 10]})
            for g in (15, 63, 255):
                h = _hist(rng, 16)
                tau = float((np.arange(len(h)) * h).sum() / sum(h))
                sp = tiny_speedup if model == "tiny" else float(rng.uniform(0.5, 4))
                e2e.append({"bench": "e2e", "backend": "cuda", "model": model, "batch": b,
                            "mode": "ddtree", "budget": g, "drafter": "block:trained",
                            "summary": {"median": 1.0}, "validation": {"ok": True},
                            "accept_hist": h,
                            "rates": {"tokens_per_s": 1.0, "target_forwards_per_token": 1 / tau,
                                      "mean_accept_length": tau, "speedup_vs_ar": sp}})
                cs[(model, b, g)] = (tau, sp, h)
    heldout, unigram = float(rng.uniform(1.0, 2.0)), float(rng.uniform(3.0, 5.0))
    training = dict(TRAINING, train_loss=heldout - 0.1, heldout_loss=heldout, unigram_heldout_loss=unigram)
    ids = rng.integers(0, 4096, size=12).tolist()
    sample = {"model": "code-small", "device": "cuda", "batch": 1, "budget": 63,
              "drafter": "block:trained", "prompt_ids": list(range(70)),
              "prompt_text": "def f(x):\n    ```return", "ar_ids": ids,
              "ddtree_ids": ids if identical else ids[:-1] + [0],
              "ar_text": " x + 1\n", "ddtree_text": " x + 1\n" if identical else " x + 2\n",
              "identical": identical}
    svc = []
    for target, model in (("tiny", "kdtree-tiny"), ("code-small", "kdtree-code-small")):
        for m in ("ar", "ddtree"):
            for c in (1, 8):
                svc.append({"bench": "service", "backend": f"{m}/cuda", "target": target,
                            "case": {"mode": m, "concurrency": c, "model": model},
                            "summary": {"median": 0.1}, "errors": 0, "validation": {"ok": True},
                            "ttft_s": {"p50": 0.002, "p99": 0.02},
                            "rates": {"aggregate_tokens_per_s": {"value": float(rng.uniform(100, 9000))}}})
    suites = {"e2e": {"results": e2e, "params": {"weights": "/w/tiny", "code_small": {
                  "training": training, "toy": False, "new_tokens": 64, "sample": sample,
                  "prompts": {"n": 8, "lengths": [64, 100, 128]}}}},
              "service": {"results": svc, "params": {"requests": 64, "max_tokens": 256, "budget": 15,
                                                     "round_tokens": 64, "code_small": {
                                                         "training": training, "prompt_tokens": [64, 128]}}}}
    return suites, cs, training, svc


def test_section_figures(rng):
    suites, cs, training, svc = _suites(rng)
    view = {"suites": suites, "from": {k: f"run-{k}" for k in suites}}
    text = "\n".join(code_small_lines(view))
    assert text.startswith("## code-small: a trained target")
    for b in (1, 8):
        for g in (15, 63, 255):
            tau, sp, _ = cs[("code-small", b, g)]
            cell = f"{sp:.2f}" if sp <= 1 else f"**{sp:.2f}**"
            assert f"{tau:.2f} | {1 / tau:.3f} | {cell}" in text, (b, g)
    tau63, sp63, h63 = cs[("code-small", 1, 63)]
    assert f"| trained drafter tau, budget 63, held-out prompts, bs 1 | >= 4 | {tau63:.2f} |" in text
    assert f"| DDTree vs AR wall clock, bs 1, budget 63 | >= 2x | {sp63:.2f}x |" in text
    ho, uni = training["heldout_loss"], training["unigram_heldout_loss"]
    assert f"{ho:.3f} vs {uni:.3f}" in text and f"**{uni - ho:.2f} nats below**" in text
    shares = hist_shares(h63)
    assert abs(sum(shares) - 1) < 1e-12 and len(shares) == len(HIST_BINS)
    assert "| 63 | " + " | ".join(f"{100 * x:.0f}%" for x in shares) + f" | {tau63:.2f} |" in text
    assert "80,000,000 tokens seen" in text and "1694 for training, 92 held out" in text
    assert "AR == DDTree tokens on code-small: **yes**" in text
    # served rows: code-small's only, DDTree against AR at the same level
    by = {(r["case"]["mode"], r["case"]["concurrency"]): r["rates"]["aggregate_tokens_per_s"]["value"]
          for r in svc if r["target"] == "code-small"}
    for c in (1, 8):
        assert f"| ddtree | {c} | {by[('ddtree', c)]:.0f} | {by[('ddtree', c)] / by[('ar', c)]:.2f}x |" in text
    # the sample: a fence longer than the prompt's backtick run; identical
    assert "identical: **yes**" in text and "````\ndef f(x):\n    ```return\n````" in text
    assert "Continuation (AR = DDTree)" in text and "Continuation (DDTree)" not in text


def test_section_says_so_when_ddtree_differs_and_tiny_ignores_code_small(rng):
    suites, *_ = _suites(rng, identical=False, tiny_speedup=0.3)
    bad = next(r for r in suites["e2e"]["results"]
               if r["model"] == "code-small" and r["mode"] == "ddtree")
    bad["validation"] = {"ok": False, "error": "prompt 0, token 3: x"}
    view = {"suites": suites, "from": {}}
    text = "\n".join(code_small_lines(view))
    assert "identical: **NO**" in text and "Continuation (DDTree)" in text
    assert "AR == DDTree tokens on code-small: **NO**, " in text and "prompt 0, token 3" in text
    # tiny's sections see tiny's records only: its best speedup is tiny's 0.30x
    meaning = "\n".join(rm.meaning(view))
    assert "Best wall-clock speedup over AR: 0.30x" in meaning
    assert all(r.get("target") == "tiny" for r in rm.service_records(view))
    assert {r["model"] for r in rm.e2e_records(view)} == {"tiny"}


def test_no_code_small_no_section(rng):
    suites, *_ = _suites(rng)
    for d in suites.values():
        d["results"] = [r for r in d["results"] if (r.get("model") or r.get("target")) == "tiny"]
    assert code_small_lines({"suites": suites, "from": {}}) == []


def test_page_and_plot(tmp_path, rng):
    suites, *_ = _suites(rng)
    d = tmp_path / "results" / "h200" / "20261201T000000Z-abc-bench"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"schema": 1, "run_id": d.name, "kind": "bench"}))
    for name, doc in suites.items():
        (d / f"{name}.json").write_text(json.dumps({"schema": 1, "suite": name, "status": "ok",
                                                    "table": f"{name}\n", **doc}))
    page = report.write_report(tmp_path / "results" / "h200", tmp_path / "docs")
    text = page.read_text()
    assert "## code-small: a trained target" in text
    assert text.index("## What this means") < text.index("## code-small") < text.index("## Plots")
    png = tmp_path / "docs" / "BENCHMARKS_h200_code_small_accept.png"
    assert png.is_file() and png.stat().st_size > 1000 and f"]({png.name})" in text
    first = page.read_bytes(), png.read_bytes()
    report.write_report(tmp_path / "results" / "h200", tmp_path / "docs")
    assert (page.read_bytes(), png.read_bytes()) == first  # reproducible
