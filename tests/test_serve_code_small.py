"""The service suite's code-small path, quick, on the CPU, with its toy (trained for a few steps
on a small stdlib corpus: tests/code_small_toy.py):
its servers take TEXT prompts (the server encodes them with the folder's tokenizer.json), the
engine check encodes them the same way, and its records are keyed apart from tiny's."""

from __future__ import annotations

import json

import pytest

import code_small_toy
from native_helpers import native

pytestmark = pytest.mark.native


def test_service_suite_serves_code_small_with_text_prompts(tmp_path, monkeypatch):
    import bench

    native()
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "cache"))
    calls = code_small_toy.install(monkeypatch, tmp_path / "code-small")
    args = {"models": "code-small", "modes": "ar,ddtree", "concurrency": "1,2", "requests": 3,
            "max_tokens": 6, "code_small_prompt_tokens": "10,14", "budget": 7}
    ctx = bench.Context(out_dir=tmp_path / "out", quick=True, devices=["cpu"], args=args)
    (outcome,) = bench.run_suites(["service"], ctx)
    doc = json.loads(outcome.json_path.read_text())
    assert outcome.status == "ok", doc.get("error") or doc.get("traceback")
    assert calls == [{"device": "cpu", "minutes": None, "toy": True}]
    p = doc["params"]
    assert p["models"] == ["code-small"] and p["weights"] is None  # the option; no tiny
    cs = p["code_small"]
    assert cs["served_model"] == "kdtree-code-small" and cs["drafter"]["kind"] == "trained"
    assert cs["training"]["config_name"] == "toy" and "code-toy-" in cs["weights"]["path"]
    recs = doc["results"]
    assert [(r["backend"], r["case"]["concurrency"]) for r in recs] == [
        ("ar/cpu", 1), ("ar/cpu", 2), ("ddtree/cpu", 1), ("ddtree/cpu", 2)]
    for r in recs:
        assert r["target"] == "code-small" and r["case"]["model"] == "kdtree-code-small"
        assert r["case"]["prompt_tokens"] == "10-14"
        assert r["errors"] == 0 and r["tokens"] == 18
        v = r["validation"]
        assert v["ok"] and v["engine_check"]["ok"] and v["token_check"]["checked"] == 3, v
    table = (tmp_path / "out" / "service.txt").read_text()
    assert "code-small" in table
    assert (tmp_path / "out" / "service_server_code-small_ddtree.log").is_file()
