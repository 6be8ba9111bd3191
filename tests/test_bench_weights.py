"""Weights are inputs, not results (bench/weights.py): the tiny model is generated once into a
cache outside the run folder, reused when verified, regenerated when damaged; the e2e and
service suites record its path, config and sha256 per file, and leave no safetensors (nothing
large) in the run folder."""

from __future__ import annotations

import json

import pytest

import bench
from bench import weights as bw
from native_helpers import bench_library

RUN_FOLDER_MAX_BYTES = 512 * 1024  # "a few hundred KB" per file: JSON, tables, logs


def test_tiny_weights_cached_reused_and_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "cache"))
    w = bw.tiny_weights()
    assert w.parent == tmp_path / "cache" / "weights" and w.name.startswith("tiny-")
    names = {p.name for p in w.iterdir()}
    assert {"config.json", "model.safetensors", "drafter.safetensors", bw.DIGESTS} <= names
    d = bw.describe(w)
    listed = json.loads((w / bw.DIGESTS).read_text())
    assert d["sha256"] == listed and set(listed) >= {"model.safetensors", "drafter.safetensors"}
    assert d["path"] == str(w) and d["config"] == json.loads((w / "config.json").read_text())
    stamp = (w / "model.safetensors").stat().st_mtime_ns
    assert bw.tiny_weights() == w and (w / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    # a damaged file fails the check: the folder is generated again, with the same digests
    with open(w / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xfe")
    assert bw.tiny_weights() == w and bw.describe(w)["sha256"] == listed
    assert not [p for p in w.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def _ctx(out, lib, args):
    return bench.Context(out_dir=out, quick=True, devices=["cpu"], args=args, library=lib)


@pytest.mark.native
@pytest.mark.slow
def test_e2e_and_service_runs_leave_no_weights_in_the_run_folder(tmp_path, monkeypatch,
                                                                 quick_weights):
    lib = bench_library()
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "cache"))
    # the weights made once for the session (conftest.py): what is asserted here is where the
    # suites look for them and what they record, not how they are trained
    quick_weights(tmp_path / "cache")
    out = tmp_path / "run"
    out.mkdir()
    # --quick suites with smaller grids (what is asserted is where files go, not the figures)
    e2e = bench.run_suites(["e2e"], _ctx(out, lib, {"prompts": 1, "new_tokens": 8, "budgets": [7],
                                                    "qualities": [1.0], "reps": 1}))
    svc = bench.run_suites(["service"], _ctx(out, lib, {"concurrency": "1", "requests": 2,
                                                        "max_tokens": 8, "modes": "ar,ddtree"}))
    assert [o.status for o in e2e + svc] == ["ok", "ok"], [(o.name, o.error) for o in e2e + svc]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix == ".safetensors"], files
    big = [(p.name, p.stat().st_size) for p in files if p.stat().st_size > RUN_FOLDER_MAX_BYTES]
    assert not big, big
    cached = bw.tiny_weights()
    for suite, key in (("e2e", "weights"), ("service", "weights")):
        params = json.loads((out / f"{suite}.json").read_text())["params"]
        rec = params[key]
        assert rec["path"] == str(cached), (suite, rec)
        assert rec["sha256"] == json.loads((cached / bw.DIGESTS).read_text()), suite
        assert rec["config"]["vocab_size"] > 0, suite
