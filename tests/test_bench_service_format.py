"""bench/service_load.py's stored request records: compact (integer microseconds, gaps) and read
back to within 0.5 us; the summaries from read-back records match the full-precision ones; the
older float-seconds form (the committed H200 service.json) still reads and re-summarizes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.service_load import compact_request, expand_request, summarize_level

OLD = Path(__file__).resolve().parents[1] / "results/h200/20261129T133728Z-4ae82b6-bench/service.json"


def _records(rng, n=12, max_tokens=256, multi=False):
    out = []
    for i in range(n):
        ks = rng.integers(1, 6, max_tokens).tolist() if multi else [1] * max_tokens
        ks = ks[:int(np.searchsorted(np.cumsum(ks), max_tokens)) + 1]
        ks[-1] -= sum(ks) - max_tokens  # chunks carry exactly max_tokens
        t0 = float(rng.uniform(1e-3, 5e-2))
        times = (t0 + np.cumsum(np.r_[0.0, rng.exponential(7e-4, len(ks) - 1)])).tolist()
        out.append({"prompt_tokens": 32, "status": 200, "error": None, "ttft": times[0],
                    "latency": times[-1] + float(rng.uniform(0, 1e-3)), "tokens": max_tokens,
                    "chunk_times": times, "chunk_tokens": ks, "usage_tokens": max_tokens,
                    "ids_seen": max_tokens, "index": i, "start": float(rng.uniform(0, 2))})
    out.append({"prompt_tokens": 32, "status": 503, "error": "HTTP 503: busy", "ttft": None,
                "latency": None, "tokens": 0, "chunk_times": [], "chunk_tokens": [],
                "usage_tokens": None, "ids_seen": 0, "index": n, "start": 0.5})
    return out


def _close(a, b, what):
    """Times within 1 us; a rate (tokens/s) by relative error: 0.5 us over a latency of at
    least 50 ms is 1e-5."""
    for k in ("p50", "p90", "p99", "mean"):
        ok = (abs(a[k] - b[k]) <= 1e-5 * abs(b[k]) if what == "per_request_tokens_per_s"
              else abs(a[k] - b[k]) <= 1e-6)
        assert ok, (what, k, a[k], b[k])
    assert a["n"] == b["n"], what


@pytest.mark.parametrize("multi", [False, True])
def test_compact_round_trip_and_summaries(rng, multi):
    recs = _records(rng, multi=multi)
    stored = json.loads(json.dumps([compact_request(r) for r in recs]))
    back = [expand_request(r) for r in stored]
    for r, b in zip(recs, back):
        assert b["chunk_tokens"] == r["chunk_tokens"] and b["error"] == r["error"]
        assert len(b["chunk_times"]) == len(r["chunk_times"])
        # every time within 0.5 us of the original: rounding does not accumulate over the stream
        err = max((abs(x - y) for x, y in zip(b["chunk_times"], r["chunk_times"])), default=0.0)
        assert err <= 0.5e-6 + 1e-12, err
        for k in ("ttft", "latency", "start"):
            assert (b[k] is None) == (r[k] is None) and (b[k] is None or abs(b[k] - r[k]) <= 0.5e-6 + 1e-12)
    full, compact = summarize_level(recs, 3.0, 256), summarize_level(back, 3.0, 256)
    for key in ("ttft_s", "itl_s", "tpot_s", "per_request_tokens_per_s"):
        _close(compact[key], full[key], key)
    assert compact["tokens"] == full["tokens"] and compact["errors"] == full["errors"] == 1
    old = len(json.dumps(recs, indent=1))  # as bench/__init__.py writes suite JSON
    assert len(json.dumps(stored, indent=1)) < old / 3, (len(json.dumps(stored, indent=1)), old)


@pytest.mark.skipif(not OLD.is_file(), reason=f"{OLD} (the committed H200 run) is not in this checkout")
def test_old_float_form_still_reads():
    doc = json.loads(OLD.read_text())
    level = doc["results"][0]
    back = [expand_request(r) for r in level["requests"]]
    assert back[0] is level["requests"][0] or back[0] == level["requests"][0]
    s = summarize_level(back, level["wall_s"], level["case"]["max_tokens"])
    for key in ("ttft_s", "itl_s", "tpot_s"):
        _close(s[key], level[key], key)  # the stored summaries, recomputed from the raw records
    # and the compact form of the same records is a fraction of the size, same summaries
    stored = [compact_request(r) for r in level["requests"]]
    assert len(json.dumps(stored, indent=1)) < len(json.dumps(level["requests"], indent=1)) / 4
    s2 = summarize_level([expand_request(r) for r in json.loads(json.dumps(stored))],
                         level["wall_s"], level["case"]["max_tokens"])
    for key in ("ttft_s", "itl_s", "tpot_s"):
        _close(s2[key], level[key], key)
