"""Runs that overlapped in time on one machine: find_overlaps against brute force on random
windows; the report never picks an overlapped suite when a clean one exists and says which runs
overlapped; compare_runs warns (and still compares) when a run it compares overlapped another."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.remote import compare as cmp
from engine.remote import report

T0 = datetime(2026, 1, 1, 10, 0, 0, tzinfo=timezone.utc)
CMDS = ["nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -c /r/src/cuda/src/a.cu -o /r/a.o"]


def _iso(minute: float) -> str:
    return (T0 + timedelta(minutes=minute)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _manifest(run_id, start, end, boot="boot-1"):
    return {"schema": 1, "run_id": run_id, "kind": "bench", "host": {"name": "h200"},
            "host_facts": {"boot_id": boot, "gpus": [{"name": "NVIDIA H200"}]},
            "build": {"commands": CMDS}, "started": _iso(start), "finished": _iso(end)}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20), st.sampled_from(["b1", "b2"])),
                min_size=1, max_size=6))
def test_find_overlaps_matches_brute_force(wins):
    manifests = {f"r{i}": _manifest(f"r{i}", s, s + d, boot) for i, (s, d, boot) in enumerate(wins)}
    got = {k: sorted(o for o, _ in v) for k, v in cmp.find_overlaps(manifests).items()}
    want = {}
    for i, (s, d, boot) in enumerate(wins):
        secs = set(range(s * 60, (s + d) * 60))  # whole seconds inside the window
        for j, (s2, d2, boot2) in enumerate(wins):
            if i != j and boot == boot2 and secs & set(range(s2 * 60, (s2 + d2) * 60)):
                want.setdefault(f"r{i}", []).append(f"r{j}")
    assert got == want, wins


def test_runs_without_times_or_boot_id_never_overlap():
    m = _manifest("a", 0, 10)
    assert cmp.find_overlaps({"a": m, "b": {**_manifest("b", 5, 8), "started": None}}) == {}
    no_boot = {**_manifest("c", 5, 8), "host_facts": {}}
    assert cmp.find_overlaps({"a": m, "c": no_boot}) == {}


def _suite(name, start, end, med, rng, status="ok"):
    s = (med * (1 + 0.02 * rng.standard_normal(20))).tolist()
    recs = [{"bench": "tree_build", "backend": "native-cuda", "case": {"bs": 1, "budget": 15},
             "validation": {"ok": True}, "samples": s,
             "summary": {"median": float(np.median(s)), "n": len(s)}}]
    if name == "service":
        recs = [{"bench": "service", "backend": f"{m}/cuda", "case": {"mode": m, "concurrency": c},
                 "samples": [0.1], "summary": {"median": 0.1}, "ttft_s": {"p50": 1e-3, "p99": 2e-3},
                 "rates": {"aggregate_tokens_per_s": {"value": float(rng.uniform(100, 1000))}}, "errors": 0}
                for m in ("ar", "ddtree") for c in (1, 4)]
    return {"schema": 1, "suite": name, "status": status, "params": {}, "results": recs,
            "table": f"{name} table {med:.3e}\n", "build": {"commands": CMDS},
            "started": _iso(start), "finished": _iso(end)}


def _run(host, run_id, start, end, suites, boot="boot-1"):
    d = host / run_id
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps(_manifest(run_id, start, end, boot)))
    for doc in suites:
        (d / f"{doc['suite']}.json").write_text(json.dumps(doc))
    return d


@pytest.fixture
def host(tmp_path, rng):
    """A: clean tree_build (10:00-10:10). B: tree_build 10:20-10:30 then service 10:30-10:40.
    C: tree_build 10:32-10:36 on the same boot (overlaps B's service, not B's tree_build).
    D: tree_build 10:33-10:34 on another boot (no overlap: another machine boot)."""
    h = tmp_path / "results" / "h200"
    med = rng.uniform(1e-5, 1e-4)
    _run(h, "20260101T100000Z-aaaaaaa-bench", 0, 10, [_suite("tree_build", 0, 10, med, rng)])
    _run(h, "20260101T102000Z-bbbbbbb-bench", 20, 40,
         [_suite("tree_build", 20, 30, med * 1.5, rng), _suite("service", 30, 40, 0, rng)])
    _run(h, "20260101T103200Z-ccccccc-bench", 32, 36, [_suite("tree_build", 32, 36, med * 3, rng)])
    _run(h, "20260101T103300Z-ddddddd-bench", 33, 34,
         [_suite("tree_build", 33, 34, med, rng, status="failed")], boot="boot-2")
    return h


def test_report_chooses_clean_suites_and_marks_overlaps(host, tmp_path):
    manifests = report.all_manifests(host)
    ov = cmp.find_overlaps(manifests)
    assert sorted(ov) == ["20260101T102000Z-bbbbbbb-bench", "20260101T103200Z-ccccccc-bench"]
    runs, _ = report.load_runs(host)
    chosen = report.choose_suites(runs, ov, manifests)
    # tree_build: C (overlapped) and D (failed) are newer, but B's tree_build ran before C began
    assert chosen["tree_build"][0]["id"] == "20260101T102000Z-bbbbbbb-bench"
    assert chosen["tree_build"][1] == ""
    # service: only B has it, and it ran during C: chosen, with the reason
    run, why = chosen["service"]
    assert run["id"] == "20260101T102000Z-bbbbbbb-bench" and "ccccccc" in why
    page = report.write_report(host, tmp_path / "docs").read_text()
    overlap = [ln for ln in page.splitlines() if ln.startswith("- **Overlap:**")]
    assert len(overlap) == 1 and "bbbbbbb" in overlap[0] and "ccccccc" in overlap[0]
    assert "10:32:00..10:36:00 UTC" in overlap[0]
    assert "### tree_build (run `20260101T102000Z-bbbbbbb-bench`)" in page
    assert "caution: ran while `20260101T103200Z-ccccccc-bench`" in page  # the service section
    assert "| `20260101T103200Z-ccccccc-bench` (overlapped) |" in page
    assert "| `20260101T103300Z-ddddddd-bench` |" in page  # another boot: not marked


def test_an_overlapped_suite_loses_to_an_older_clean_one(host, tmp_path):
    # C overlapping B's tree_build too: then A's (older, clean) tree_build is the one shown
    m = host / "20260101T103200Z-ccccccc-bench" / "manifest.json"
    m.write_text(json.dumps(_manifest("c", 25, 36)))
    runs, _ = report.load_runs(host)
    manifests = report.all_manifests(host)
    chosen = report.choose_suites(runs, cmp.find_overlaps(manifests), manifests)
    assert chosen["tree_build"][0]["id"] == "20260101T100000Z-aaaaaaa-bench"


def test_compare_warns_about_overlapped_runs(host):
    a, c = host / "20260101T100000Z-aaaaaaa-bench", host / "20260101T103200Z-ccccccc-bench"
    res = cmp.compare_runs(a, c)
    assert res.refused is None and res.rows, "an overlap warns, it does not refuse"
    text = res.format()
    warn = [ln for ln in text.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "ccccccc" in warn[0] and "bbbbbbb" in warn[0]
    assert "the other run's load" in warn[0] and "not judged" in warn[0]
    clean = cmp.compare_runs(a, host / "20260101T100000Z-aaaaaaa-bench")
    assert not clean.warnings and "warning:" not in clean.format()
