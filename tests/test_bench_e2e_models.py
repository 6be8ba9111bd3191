"""The e2e suite's model dimension: tiny and code-small (here its toy, trained for a few steps
on a small stdlib corpus: tests/code_small_toy.py) on the CPU, quick: code-small's cases (AR, DDTree per budget with its trained drafter, per batch
size), the accept-length histogram that tau is the mean of, the sample continuation (ids and
text, identical), its params; and a DDTree != AR difference fails the suite loudly."""

from __future__ import annotations

import json

import numpy as np
import pytest

import code_small_toy
from native_helpers import native

pytestmark = pytest.mark.native

QUICK = dict(prompts=2, new_tokens=12, budgets=[15], qualities=[0.9], batches=[1], reps=1,
             drafter_steps=20, code_small={"budgets": [7, 15], "batches": [1, 2], "prompts": 3,
                                           "prompt_tokens": [10, 20], "new_tokens": 12})


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_models_cache")  # one drafter training for the module


@pytest.fixture
def ctx(tmp_path, monkeypatch, cache):
    import bench

    native()
    monkeypatch.setenv("KDTREE_CACHE", str(cache))
    calls = code_small_toy.install(monkeypatch, cache / "code-small")

    def make(**args):
        return bench.Context(out_dir=tmp_path / "out", quick=True, devices=["cpu"],
                             library=native().library(), args={**QUICK, **args})
    return make, calls


def test_code_small_beside_tiny(ctx):
    from bench import e2e
    from engine.serving.tokenizer import load_tokenizer

    make, calls = ctx
    out = e2e.run(make())
    p = out["params"]
    assert p["models"] == ["tiny", "code-small"]
    assert calls == [{"device": "cpu", "minutes": None, "toy": True}]
    cs = p["code_small"]
    assert cs["toy"] is True and cs["drafters"]["block:trained"]["kind"] == "trained"
    t = cs["training"]  # bench/weights.code_small_record of the folder's train.json
    assert t["config_name"] == "toy" and t["steps"] == code_small_toy.STEPS
    assert t["heldout_files"] == 2 and len(t["corpus_digest"]) == 64
    for k in ("train_loss", "heldout_loss", "unigram_heldout_loss", "tokens_seen"):
        assert isinstance(t[k], (int, float)), k
    assert t["seconds"]["wall"] > 0
    assert all(10 <= n <= 20 for n in cs["prompts"]["lengths"]) and len(cs["prompts"]["lengths"]) == 3
    assert p["weights"]["path"] != cs["weights"]["path"]  # tiny's params stay tiny's

    recs = [r for r in out["results"] if r.get("model") == "code-small"]
    keys = {(r["mode"], r["budget"], r["drafter"], r["batch"]) for r in recs}
    assert keys == {(m, b, d, bs) for bs in (1, 2) for m, b, d in
                    [("ar", 0, "-"), ("ddtree", 7, "block:trained"), ("ddtree", 15, "block:trained")]}
    for r in recs:
        assert r["validation"]["ok"], r["validation"]
        assert r["case"].startswith("code-small ")
        hist = np.asarray(r["accept_hist"])  # per request and round: >= the batched rounds
        assert hist[0] == 0 and hist.sum() >= r["round"]["rounds"]
        if r["batch"] == 1:
            assert hist.sum() == r["round"]["rounds"]
        tau = float((np.arange(len(hist)) * hist).sum() / hist.sum())
        assert abs(tau - r["rates"]["mean_accept_length"]) < 1e-12
        # tokens: the prefill's first one, then each round's accepted (bonus included)
        assert (np.arange(len(hist)) * hist).sum() + 3 >= 3 * 12
        if r["mode"] == "ar":
            assert list(hist) == [0, 3 * (12 - 1)]  # one token per AR step
    tiny = [r for r in out["results"] if r.get("model") == "tiny"]
    assert tiny and all(not r["case"].startswith("code-small") for r in tiny)
    assert "code-small" in out["table"] and "tiny" in out["table"]

    s = cs["sample"]
    tok = load_tokenizer(cs["weights"]["path"], cs["weights"]["config"]["vocab_size"])
    assert s["identical"] and s["ar_ids"] == s["ddtree_ids"] and len(s["ar_ids"]) == 12
    assert s["budget"] == 15 and s["batch"] == 1 and s["device"] == "cpu"
    assert s["prompt_text"] == tok.decode(s["prompt_ids"]) and s["ar_text"] == tok.decode(s["ar_ids"])
    assert s["ddtree_text"] == s["ar_text"]
    json.dumps(out["params"])  # the suite JSON can hold it


def test_a_ddtree_difference_fails_the_suite_loudly(ctx, monkeypatch, capsys):
    import bench
    from bench import e2e

    make, _ = ctx
    real = e2e._decode_all

    def corrupt(eng, batches, new_tokens, mode, budget, drafters):
        out = real(eng, batches, new_tokens, mode, budget, drafters)
        if mode == "ddtree" and budget == 15:
            out["tokens"][0] = out["tokens"][0].copy()
            out["tokens"][0][5] += 1
        return out

    monkeypatch.setattr(e2e, "_decode_all", corrupt)
    c = make(models=["code-small"])
    (o,) = bench.run_suites(["e2e"], c)
    doc = json.loads(o.json_path.read_text())
    assert o.status == "invalid" and doc["status"] == "invalid"
    bad = [r for r in doc["results"] if not r["validation"]["ok"]]
    assert {r["budget"] for r in bad} == {15}
    assert "prompt 0, token 5" in bad[0]["validation"]["error"]
    assert "MISMATCH" in (c.out_dir / "e2e.txt").read_text()
    assert "e2e: MISMATCH: code-small cpu" in capsys.readouterr().err
    assert "weights" not in doc["params"]  # no tiny in this run


def test_unknown_model_is_an_error(ctx):
    from bench import e2e

    make, _ = ctx
    with pytest.raises(ValueError, match="models \\['small'\\]"):
        e2e.run(make(models=["small"]))


def test_grid_overrides_merge_and_cpu_trims_yield_to_given_keys(tmp_path):
    import bench
    from bench import e2e

    def grid(**args):
        return e2e._grid(bench.Context(out_dir=tmp_path, args=args))

    g = grid()
    assert g["models"] == ["tiny", "code-small"] and g["code_small"]["budgets"] == [15, 63, 255]
    assert g["cpu"] == {"qualities": [0.8], "block_random": False, "reps": 1, "profile": False}
    assert g["code_small"]["cpu"] == {"budgets": [15], "batches": [8], "reps": 1,
                                      "new_tokens": 32, "profile": False}
    g = grid(qualities=[0.5], code_small={"reps": 1, "batches": [1]})
    assert g["qualities"] == [0.5] and g["cpu"] == {"block_random": False, "reps": 1,
                                                    "profile": False}
    assert g["code_small"]["reps"] == 1 and g["code_small"]["budgets"] == [15, 63, 255]
    assert g["code_small"]["cpu"] == {"budgets": [15], "new_tokens": 32, "profile": False}
    assert grid(cpu={})["cpu"] == {}


def test_cpu_trims_beside_a_gpu(ctx, monkeypatch):
    """What the CPU backend runs when the run also has a GPU (faked here: _gpu says yes while
    only the CPU runs): code-small's trimmed grid, without the profiled pass."""
    from bench import e2e

    make, _ = ctx
    monkeypatch.setattr(e2e, "_gpu", lambda ctx, lib: True)
    trims = {"budgets": [7], "batches": [2], "reps": 1, "new_tokens": 8, "profile": False}
    out = e2e.run(make(models=["code-small"], code_small=dict(QUICK["code_small"], cpu=trims)))
    recs = out["results"]
    assert {(r["mode"], r["budget"], r["batch"]) for r in recs} == {("ar", 0, 2), ("ddtree", 7, 2)}
    for r in recs:
        assert r["validation"]["ok"] and r["round"]["phases_ms"] == {} and len(r["samples"]) == 1
        assert r["rates"]["tokens_per_s"] == pytest.approx(3 * 8 / r["summary"]["median"], rel=1e-12)
    assert out["params"]["code_small"]["cpu_trims"] == trims
    assert out["params"]["code_small"]["sample"]["budget"] == 7
