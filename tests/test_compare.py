"""engine.remote.compare and engine.remote.stats: the Mann-Whitney test against brute force,
verdicts on synthetic runs with fresh random samples, like-with-like refusals and the exit codes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.remote import compare as cmp
from engine.remote import stats


def _brute_p(x, y):
    """Exact two-sided p of U by enumerating every split of the pooled ranks."""
    allv = np.concatenate([x, y])
    ranks = np.argsort(np.argsort(allv)) + 1.0
    n1 = len(x)
    u_obs = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    us = np.array([ranks[list(c)].sum() - n1 * (n1 + 1) / 2
                   for c in itertools.combinations(range(len(allv)), n1)])
    return min(1.0, 2 * min(np.mean(us <= u_obs), np.mean(us >= u_obs)))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_exact_p_matches_enumeration(n1, n2, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.random(n1), rng.random(n2) + rng.random() * 0.5  # distinct: no ties
    u, p = stats.mann_whitney_u(x, y)
    assert p == pytest.approx(_brute_p(x, y), rel=1e-12), f"seed {seed}"


def test_normal_approximation_close_to_exact_for_large_samples():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    x, y = rng.normal(0, 1, 30), rng.normal(0.3, 1, 30)
    _, p_norm = stats.mann_whitney_u(x, y, exact=False)
    _, p_exact = stats.mann_whitney_u(x, y, exact=True)
    # the continuity-corrected normal approximation is within ~0.01 of exact at 30 + 30
    assert abs(p_norm - p_exact) < 0.01, f"seed {seed}: {p_norm} vs {p_exact}"
    assert stats.mann_whitney_u(x, y) == stats.mann_whitney_u(x, y, exact=True)
    with pytest.raises(ValueError, match="exact=True"):
        stats.mann_whitney_u([1.0, 1.0], [2.0], exact=True)


def test_ties_and_identical_samples():
    _, p = stats.mann_whitney_u([1.0] * 10, [1.0] * 10)
    assert p == 1.0
    _, p = stats.mann_whitney_u([1.0, 1.0, 2.0, 2.0] * 5, [3.0, 3.0, 4.0, 4.0] * 5)
    assert p < 1e-6


def test_exact_counts_sum_to_binomial():
    for n1, n2 in [(1, 1), (3, 4), (10, 12), (30, 30)]:
        c = stats._exact_u_cdf(n1, n2)
        assert c.sum() == __import__("math").comb(n1 + n2, n1)
        assert np.array_equal(c, c[::-1])  # U's distribution is symmetric


# ---------------------------------------------------------------- runs -------------------

GPU = {"name": "NVIDIA H200", "uuid": "GPU-1"}
CMDS = ["nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I/r/src/cuda/include -c /r/src/cuda/src/a.cu -o /r/build/a.o"]


def _write_run(root, run_id, medians, rng, host="h200", gpu=GPU, cmds=CMDS, n=30, noise=0.02):
    d = root / host / run_id
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({
        "schema": 1, "run_id": run_id, "kind": "bench", "host": {"name": host, "address": "10.0.0.1"},
        "host_facts": {"gpus": [gpu] if gpu else []}, "build": {"commands": cmds}}))
    results = []
    for (bs, backend), med in medians.items():
        s = (med * (1 + noise * rng.standard_normal(n))).tolist()
        results.append({"bench": "tree_build", "backend": backend, "case": {"bs": bs, "budget": 15},
                        "validation": {"ok": True}, "samples": s})
    (d / "tree_build.json").write_text(json.dumps({
        "schema": 1, "suite": "tree_build", "status": "ok", "params": {}, "results": results,
        "build": {"commands": cmds}, "provenance": {}}))
    return d


def test_verdicts_and_exit_code(tmp_path, rng):
    base = {(1, "native-cuda"): 10e-6, (64, "native-cuda"): 20e-6, (1, "sglang-cuda"): 1e-3}
    a = _write_run(tmp_path, "20260101T000000Z-aaaaaaa-bench", base, rng)
    b = _write_run(tmp_path, "20260102T000000Z-bbbbbbb-bench",
                   {(1, "native-cuda"): 10e-6, (64, "native-cuda"): 26e-6, (1, "sglang-cuda"): 0.7e-3}, rng)
    # bs=1 native-cuda: B holds A's samples reshuffled, a certain "no change" (a fresh draw from
    # the same distribution would be called different at alpha = 1% of the time)
    da, db = (json.loads((d / "tree_build.json").read_text()) for d in (a, b))
    db["results"][0]["samples"] = rng.permutation(da["results"][0]["samples"]).tolist()
    (b / "tree_build.json").write_text(json.dumps(db))
    c = cmp.compare_runs(a, b, threshold=0.05)
    assert c.refused is None
    v = {r.key: r.verdict for r in c.rows}
    assert v["tree_build/native-cuda bs=1 budget=15"] == "no significant change"
    assert v["tree_build/native-cuda bs=64 budget=15"] == "slower"
    assert v["tree_build/sglang-cuda bs=1 budget=15"] == "faster"
    slow = next(r for r in c.rows if r.key == "tree_build/native-cuda bs=64 budget=15")
    assert slow.change == pytest.approx(0.3, abs=0.05) and slow.regression
    assert slow.ci[0] < slow.change < slow.ci[1]
    assert c.exit_code == cmp.EXIT_REGRESSION == 2
    text = c.format()
    assert "REGRESSION" in text and "1 faster, 1 slower, 1 no significant change" in text
    # the same 30% slowdown under a 50% threshold is reported but is no regression
    assert cmp.compare_runs(a, b, threshold=0.5).exit_code == 0


def test_noise_larger_than_change_is_no_change(tmp_path, rng):
    # 4 + 4 samples cannot reach p < 0.01 (the smallest exact two-sided p is 2/70): a 5% change
    # under 30% noise must be "no significant change", whatever the medians say
    a = _write_run(tmp_path, "r1", {(1, "native-cpu"): 10e-6}, rng, n=4, noise=0.3)
    b = _write_run(tmp_path, "r2", {(1, "native-cpu"): 10.5e-6}, rng, n=4, noise=0.3)
    c = cmp.compare_runs(a, b)
    assert [r.verdict for r in c.rows] == ["no significant change"] and c.exit_code == 0


@pytest.mark.parametrize("what,kw,reason", [
    ("host", {"host": "other"}, "different hosts"),
    ("gpu", {"gpu": {"name": "NVIDIA RTX PRO 6000"}}, "different GPU models"),
    ("flags", {"cmds": [CMDS[0].replace("-O3", "-O0 -g")]}, "different build flags"),
])
def test_refuses_unlike_runs(tmp_path, rng, what, kw, reason):
    a = _write_run(tmp_path, "r1", {(1, "native-cpu"): 1e-5}, rng)
    b = _write_run(tmp_path, "r2", {(1, "native-cpu"): 1e-5}, rng, **kw)
    c = cmp.compare_runs(a, b)
    assert c.refused and reason in c.refused and c.rows == []
    assert c.exit_code == cmp.EXIT_REFUSED
    assert "refused" in c.format()


def test_build_paths_do_not_count_as_flags():
    other = [CMDS[0].replace("/r/", "/elsewhere/")]
    assert cmp.build_flags(CMDS) == cmp.build_flags(other)
    assert "nvcc -O3" in cmp.build_flags(CMDS)


def test_records_only_in_one_run_and_invalid_records(tmp_path, rng):
    a = _write_run(tmp_path, "r1", {(1, "native-cpu"): 1e-5, (4, "native-cpu"): 1e-5}, rng)
    b = _write_run(tmp_path, "r2", {(1, "native-cpu"): 1e-5, (16, "native-cpu"): 1e-5}, rng)
    c = cmp.compare_runs(a, b)
    assert len(c.rows) == 1 and len(c.only_a) == 1 and len(c.only_b) == 1
    assert "1 only in A, 1 only in B" in c.format()


def test_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        cmp.compare_runs(tmp_path / "nope", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no benchmark suite JSON"):
        cmp.compare_runs(tmp_path / "empty", tmp_path / "empty")


def test_latest_run(tmp_path, rng):
    assert cmp.latest_run(tmp_path / "h200") is None
    a = _write_run(tmp_path, "20260101T000000Z-aaaaaaa-bench", {(1, "x"): 1e-5}, rng)
    b = _write_run(tmp_path, "20260102T000000Z-bbbbbbb-bench", {(1, "x"): 1e-5}, rng)
    assert cmp.latest_run(tmp_path / "h200") == b
    assert cmp.latest_run(tmp_path / "h200", exclude=b) == a


def test_latest_run_picks_only_complete_bench_runs(tmp_path, rng):
    """A newer test run (it may hold JSON files too), a folder without a final manifest and a
    leftover .incoming-* folder are never "the latest bench run"."""
    a = _write_run(tmp_path, "20260101T000000Z-aaaaaaa-bench", {(1, "x"): 1e-5}, rng)
    t = _write_run(tmp_path, "20260103T000000Z-ccccccc-test", {(1, "x"): 1e-5}, rng)
    m = json.loads((t / "manifest.json").read_text())
    (t / "manifest.json").write_text(json.dumps(dict(m, kind="test")))
    (t / "status.json").write_text("{}")
    partial = _write_run(tmp_path, "20260104T000000Z-ddddddd-bench", {(1, "x"): 1e-5}, rng)
    (partial / "manifest.json").unlink()
    _write_run(tmp_path, ".incoming-20260105T000000Z-eeeeeee-bench-42", {(1, "x"): 1e-5}, rng)
    assert cmp.latest_run(tmp_path / "h200") == a
    assert cmp.latest_run(tmp_path / "h200", exclude=a) is None


def test_record_keys():
    assert cmp.record_key({"bench": "tree_build", "backend": "cuda", "case": {"budget": 15, "bs": 1}}) \
        == "tree_build/cuda bs=1 budget=15"
    # bench/e2e.py writes its case as a string: it must still tell records apart
    a = cmp.record_key({"bench": "e2e", "backend": "cpu", "case": "ddtree B=15 block bs=1"})
    b = cmp.record_key({"bench": "e2e", "backend": "cpu", "case": "ar B=0 - bs=1"})
    assert a != b and a == "e2e/cpu ddtree B=15 block bs=1"
    assert cmp.record_key({"name": "sha256_64KiB", "bytes_per_s": 1.5e9}) == "sha256_64KiB"
    assert cmp.record_key({"what": "x", "bs": 4, "rate": 2.5}) == "bs=4 what=x"


def _invoke_compare(*args):
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "invoke", "compare", *map(str, args)], cwd=repo,
                          capture_output=True, text=True, timeout=120)


def test_invoke_compare_cli_positional_and_against_latest(tmp_path, rng):
    """The real CLI: `invoke compare RUN_A RUN_B`, `invoke compare RUN --against latest`, and
    giving both is a usage error (5)."""
    a = _write_run(tmp_path, "20260101T000000Z-aaaaaaa-bench", {(1, "native-cpu"): 1e-5}, rng)
    b = _write_run(tmp_path, "20260102T000000Z-bbbbbbb-bench", {(1, "native-cpu"): 1e-5}, rng)
    doc = json.loads((a / "tree_build.json").read_text())
    doc["results"][0]["samples"] = rng.permutation(doc["results"][0]["samples"]).tolist()
    (b / "tree_build.json").write_text(json.dumps(doc))  # B = A's samples reshuffled: no change
    r = _invoke_compare(a, b)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no significant change" in r.stdout and "tree_build/native-cpu bs=1 budget=15" in r.stdout
    r = _invoke_compare(b, "--against", "latest")  # the newest other bench run of b's host: a
    assert r.returncode == 0 and "no significant change" in r.stdout, r.stdout + r.stderr
    assert a.name in r.stdout and b.name in r.stdout
    r = _invoke_compare(a, b, "--against", "latest")
    assert r.returncode == 5 and "not both" in r.stderr, r.stdout + r.stderr
