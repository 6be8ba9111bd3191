"""engine.remote.compare against the committed H200 runs and noisy synthetic runs: no false
alarms when the same code is rerun, a planted real regression still found, each run's own spread
and the noise floor of its kind judged, different machines named and widened, overlapped runs
not judged, exit 5 when nothing is comparable, `latest` accepted for either run."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.remote import compare as cmp

REPO = Path(__file__).resolve().parent.parent
H200 = REPO / "results" / "h200"
TREE_A = H200 / "20261129T133308Z-4ae82b6-bench"   # kernels + tree_build at 4ae82b6
TREE_B = H200 / "20261129T134438Z-4ae82b6-bench"   # tree_build at 4ae82b6, overlapped 133728
needs_h200 = pytest.mark.skipif(not (TREE_A.is_dir() and TREE_B.is_dir()), reason="committed H200 runs absent")


def _invoke(*args):
    return subprocess.run([sys.executable, "-m", "invoke", "compare", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _rerun_copy(src: Path, dest_root: Path, days: int = 1) -> Path:
    """A copy of a run as if it were rerun `days` later on the same machine (same boot)."""
    m = json.loads((src / "manifest.json").read_text())
    t = lambda s: (dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ") + dt.timedelta(days=days)).strftime("%Y-%m-%dT%H:%M:%SZ")
    rid = t(m["started"]).replace("-", "").replace(":", "")[:15] + "Z" + src.name[16:]
    dst = dest_root / "h200" / rid
    shutil.copytree(src, dst)
    m.update(started=t(m["started"]), finished=t(m["finished"]), run_id=rid)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _scale(run: Path, suite: str, key: str, factor: float) -> None:
    doc = json.loads((run / f"{suite}.json").read_text())
    hits = [r for r in doc["results"] if cmp.record_key(r) == key]
    assert len(hits) == 1, key
    hits[0]["samples"] = [x * factor for x in hits[0]["samples"]]
    (run / f"{suite}.json").write_text(json.dumps(doc))


@needs_h200
def test_committed_h200_runs_of_the_same_code_give_exit_0():
    for a, b in ((TREE_A, TREE_B), (TREE_B, TREE_A)):
        r = _invoke(a.name, b.name)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr
        assert "0 regression(s) beyond the allowed change" in r.stdout
        assert "overlapped in time on the same machine" in r.stdout  # why B's slowdowns are not judged


@needs_h200
@pytest.mark.parametrize("suite,key", [
    ("tree_build", "tree_build/native-cuda K=63 L=15 bs=1 budget=63 seq_len=4096"),
    ("tree_build", "tree_build/sglang-cuda K=15 L=15 bs=1 budget=15 seq_len=4096"),
    ("kernels", None),
])
def test_planted_regression_in_a_rerun_gives_exit_2(tmp_path, suite, key):
    b = _rerun_copy(TREE_A, tmp_path)
    if key is None:  # the first kernels record with samples
        doc = json.loads((b / "kernels.json").read_text())
        key = next(cmp.record_key(r) for r in doc["results"] if r.get("samples") and "cuda" in r.get("backend", ""))
    same = cmp.compare_runs(TREE_A, b)
    assert same.exit_code == 0 and not same.regressions and not same.machines and not same.warnings
    _scale(b, suite, key, 2.0)
    c = cmp.compare_runs(TREE_A, b)
    assert c.exit_code == 2 and [(r.suite, r.key) for r in c.regressions] == [(suite, key)]
    r = _invoke(TREE_A, b)
    assert r.returncode == 2 and "REGRESSION" in r.stdout and "1 regression(s)" in r.stdout, r.stdout[-1500:]


def _run(root: Path, rid: str, samples: dict, **facts) -> Path:
    d = root / "h" / rid
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({
        "run_id": rid, "kind": "bench", "host": {"name": "h"},
        "host_facts": {"hostname": facts.get("hostname", "box"), "boot_id": facts.get("boot", "b1"),
                       "gpus": [{"name": "NVIDIA H200", "uuid": facts.get("uuid", "GPU-1")}]}}))
    res = [{"bench": "tree_build", "backend": backend, "case": {"bs": 1}, "samples": list(map(float, s))}
           for backend, s in samples.items()]
    (d / "tree_build.json").write_text(json.dumps({"suite": "tree_build", "results": res}))
    return d


def test_own_spread_and_noise_floor_set_the_allowed_change(tmp_path, rng):
    n = 400  # IQR / median within ~7%: at 60, 0.3% of draws put `allowed` under 0.5
    steady = lambda med, sd: med * (1 + sd * rng.standard_normal(n))
    a = _run(tmp_path, "r1", {"native-cuda": steady(10, 0.005), "native-cpu": steady(10, 0.005),
                              "noisy-cuda": steady(10, 0.25)})
    b = _run(tmp_path, "r2", {"native-cuda": steady(11.2, 0.005), "native-cpu": steady(11.2, 0.005),
                              "noisy-cuda": steady(13, 0.25)})
    c = cmp.compare_runs(a, b, threshold=0.05)
    rows = {r.key.split()[0]: r for r in c.rows}
    assert rows["tree_build/native-cuda"].regression            # +12% over a 5% floor and a tiny spread
    assert rows["tree_build/native-cpu"].verdict == "slower" and not rows["tree_build/native-cpu"].regression  # 20% floor
    noisy = rows["tree_build/noisy-cuda"]
    assert noisy.allowed > 0.5 and not noisy.regression          # +30% inside its own ~34% IQR x 2
    assert c.exit_code == 2 and "slower within the noise" in c.format()


def test_different_machines_are_named_and_widen_the_allowed_change(tmp_path, rng):
    s = lambda med: med * (1 + 0.005 * rng.standard_normal(40))
    a = _run(tmp_path, "r1", {"native-cuda": s(10)})
    same = _run(tmp_path, "r2", {"native-cuda": s(10.8)})
    other = _run(tmp_path, "r3", {"native-cuda": s(10.8)}, hostname="box2", uuid="GPU-2", boot="b2")
    assert cmp.compare_runs(a, same).exit_code == 2
    c = cmp.compare_runs(a, other)
    assert c.machines == ["hostname box vs box2", "GPU UUIDs GPU-1 vs GPU-2", "boot id b1 vs b2"]
    assert c.exit_code == 0 and c.rows[0].allowed == pytest.approx(0.10)
    assert "note: different machines (hostname box vs box2" in c.format()
    far = _run(tmp_path, "r4", {"native-cuda": s(20)}, boot="b3")  # a 2x slowdown stands out from both
    assert cmp.compare_runs(a, far).exit_code == 2


def test_overlapped_runs_are_not_judged(tmp_path, rng):
    s = lambda med: med * (1 + 0.005 * rng.standard_normal(40))
    a = _run(tmp_path, "r1", {"native-cuda": s(10)})
    b = _run(tmp_path, "r2", {"native-cuda": s(30)})
    for d, t0, t1 in ((b, "2026-01-01T00:00:00Z", "2026-01-01T00:10:00Z"),):
        m = json.loads((d / "manifest.json").read_text())
        (d / "manifest.json").write_text(json.dumps(dict(m, started=t0, finished=t1)))
    assert cmp.compare_runs(a, b).exit_code == 2
    other = _run(tmp_path, "r9", {"x": s(1)})
    m = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(dict(m, started="2026-01-01T00:05:00Z", finished="2026-01-01T00:20:00Z")))
    c = cmp.compare_runs(a, b)
    assert c.exit_code == 0 and c.rows[0].verdict == "slower" and c.rows[0].not_judged
    assert "not judged" in c.format()


def test_nothing_comparable_is_exit_5(tmp_path, rng):
    a = _run(tmp_path, "20260101T000000Z-aaaaaaa-bench", {"native-cuda": rng.random(10)})
    b = _run(tmp_path, "20260102T000000Z-aaaaaaa-bench", {"native-cpu": rng.random(10)})
    c = cmp.compare_runs(a, b)
    assert c.exit_code == 5 and "nothing comparable" in c.format() and "1 only in A, 1 only in B" in c.format()


def test_latest_may_stand_for_either_run(tmp_path, rng):
    runs = [_run(tmp_path, f"2026010{i}T000000Z-aaaaaaa-bench", {"native-cuda": rng.random(10)}) for i in (1, 2, 3)]
    assert cmp.resolve_pair(tmp_path, str(runs[0]), "latest") == (runs[0], runs[2])
    assert cmp.resolve_pair(tmp_path, "latest", str(runs[2])) == (runs[1], runs[2])
    assert cmp.resolve_pair(tmp_path, "latest", "latest") == (runs[1], runs[2])
    assert cmp.resolve_pair(tmp_path, runs[0].name, runs[1].name) == (runs[0], runs[1])
    with pytest.raises(ValueError, match="no such run"):
        cmp.resolve_pair(tmp_path, "nope", "latest")
    (tmp_path / "g").mkdir()
    with pytest.raises(ValueError, match="exactly one host"):
        cmp.resolve_pair(tmp_path, "latest", "latest")


@needs_h200
def test_cli_accepts_latest_as_the_second_run():
    # "latest" is the newest committed bench run of h200; what compare then says of the pair
    # depends on the committed runs (nothing comparable, other build flags, a verdict), so the
    # test checks that the CLI resolved "latest" and compared, not the verdict.
    newest = max(p.name for p in H200.iterdir() if p.is_dir() and p.name.endswith("-bench"))
    r = _invoke(TREE_A.name, "latest")
    assert r.returncode in (0, 1, 5) and f"A={TREE_A.name} B={newest}" in r.stdout, r.stdout + r.stderr
