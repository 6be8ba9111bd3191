"""The trained target (engine.training: torch model, corpus, tokenizer, timed run) and its cache
(bench/weights.code_small_weights), on the CPU-sized `toy` preset:

- the torch target computes the reference's function: FP32 logits within 1e-4 (relative to the
  largest logit) of the float64 reference and of the native engine, for the same weights, on a
  config with every feature of the format (q_lora, YaRN, MoE groups, shared expert, a dense layer);
- the export round-trips through engine.reference.model.load_weights;
- a toy run on a few stdlib files lowers the loss below the unigram model's, records what
  train.json promises, saves a tokenizer that round-trips text, cuts held-out prompts from the
  held-out files only, and trains a drafter bound to the target;
- the cache reuses a complete folder and trains a damaged one again.

The native parts skip with the reason when libkdtree is not built (KDTREE_LIB / build/*/).
Seeds of the weight checks are fresh per run (printed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from engine.reference import model as M
from engine.training import corpus as C
from engine.training.code_model import PRESETS
from engine.training.target import (TargetNet, engine_weights, export, from_engine_weights,
                                    init_parameters)

TOY = M.ModelConfig.from_dict(PRESETS["toy"]["model"], "toy")
STEPS = 60


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _library_or_skip():
    try:
        from engine.native._lib import library

        return library()
    except Exception as e:  # noqa: BLE001 - not built, or not loadable
        pytest.skip(f"libkdtree is not available ({type(e).__name__}: {e})")


def _native_logits(folder, tokens, device):
    from engine.native.engine import Engine
    from engine.training.drafter import causal_visibility

    lib = _library_or_skip()
    if device == "cuda" and (not lib.has_cuda or lib.cuda_device_count() == 0):
        pytest.skip(f"{lib.path}: no CUDA backend or no visible GPU")
    n = len(tokens)
    with Engine(folder, device=device, max_slots=1, max_seq=n + 8) as eng:
        logits, _ = eng.forward([0], [np.asarray(tokens, np.int64)], [np.arange(n)],
                                [causal_visibility(n, (n + 31) // 32)])
    return logits


@pytest.fixture(scope="module")
def random_target(tmp_path_factory, seed):
    """(folder, weights, tokens, float64 reference logits) for seeded reference-scale weights
    (their router biases and norms are not trivial) written by the torch model's export."""
    M.limit_blas_threads(1)
    weights = M.init_weights(TOY, seed)
    folder = tmp_path_factory.mktemp("random-target")
    export(from_engine_weights(TOY, weights), folder)
    tokens = np.random.default_rng(seed).integers(0, TOY.vocab_size, 37)
    ref = M.Model(TOY, weights)
    logits, _ = ref.forward(tokens, np.arange(len(tokens)), ref.new_cache(len(tokens)))
    return folder, weights, tokens, logits


def test_torch_target_equals_the_reference_and_round_trips(random_target, seed):
    folder, weights, tokens, ref_logits = random_target
    net = from_engine_weights(TOY, weights)
    with torch.no_grad():
        logits32, _ = net(torch.as_tensor(tokens)[None])
        logits64, _ = net.double()(torch.as_tensor(tokens)[None])
    assert _rel(logits32[0], ref_logits) < 1e-4, seed
    assert _rel(logits64[0], ref_logits) < 1e-10, seed  # the same function, not a near one
    cfg, loaded = M.load_weights(folder)  # the export is the engine's format, exactly
    assert cfg == TOY
    assert set(loaded) == set(weights)
    assert all(np.array_equal(loaded[k], weights[k].astype(np.float64)) for k in weights)
    assert all(np.array_equal(v, weights[k]) for k, v in engine_weights(net.float()).items())


def test_dropout_is_training_only(random_target, seed):
    _, weights, tokens, ref_logits = random_target
    net = TargetNet(TOY, dropout=0.5)
    net.load_state_dict(from_engine_weights(TOY, weights).state_dict())
    x = torch.as_tensor(tokens)[None]
    with torch.no_grad():
        assert _rel(net.eval()(x)[0][0], ref_logits) < 1e-4, seed
        assert _rel(net.train()(x)[0][0], ref_logits) > 1e-2, seed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_native_engine_equals_the_torch_target(random_target, device, seed):
    folder, weights, tokens, ref_logits = random_target
    native = _native_logits(folder, tokens, device)
    with torch.no_grad():
        torch_logits, _ = from_engine_weights(TOY, weights)(torch.as_tensor(tokens)[None])
    assert _rel(native, ref_logits) < 1e-4, seed
    assert _rel(native, torch_logits[0]) < 1e-4, seed


def test_a_model_that_is_not_the_reference_differs(random_target, seed):
    # The comparison can fail: a correction bias that sends every token to experts 0 and 1,
    # or routed weights without routed_scaling_factor, change the logits.
    _, weights, tokens, ref_logits = random_target
    w = dict(weights)
    for k, v in weights.items():
        if k.endswith("e_score_correction_bias"):
            w[k] = np.array([10.0, 10.0] + [0.0] * (len(v) - 2), np.float32)
    unscaled = dataclasses.replace(TOY, routed_scaling_factor=1.0)
    with torch.no_grad():
        biased, _ = from_engine_weights(TOY, w)(torch.as_tensor(tokens)[None])
        plain, _ = from_engine_weights(unscaled, weights)(torch.as_tensor(tokens)[None])
    assert _rel(biased[0], ref_logits) > 1e-3, seed
    assert _rel(plain[0], ref_logits) > 1e-3, seed


# ---------------------------------------------------------------- corpus

def _small_corpus(dst):
    """A few top-level stdlib modules of 3-30 KB, two of them held out by the split rule."""
    held, train = [], []
    for p in sorted(C.stdlib_root().glob("*.py")):
        if 3000 < p.stat().st_size < 30000:
            (held if C.is_heldout(p.name) else train).append(p)
    assert len(held) >= 2, "the stdlib has too few small held-out top-level modules"
    dst.mkdir()
    for p in held[:2] + train[:24]:
        shutil.copyfile(p, dst / p.name)
    return dst


def test_corpus_split_by_file_and_digest(tmp_path):
    root = _small_corpus(tmp_path / "c")
    (root / "pkg" / "site-packages").mkdir(parents=True)
    (root / "pkg" / "site-packages" / "x.py").write_text("installed = True\n")
    (root / "bad.py").write_bytes(b"\xff\xfe not utf-8\n")
    c = C.load_corpus(root)
    assert len(c.heldout) == 2 and len(c.train) == 24
    assert all(C.is_heldout(p) for p in c.heldout) and not any(C.is_heldout(p) for p in c.train)
    assert c.skipped_not_utf8 == ["bad.py"] and "pkg/site-packages/x.py" not in c.file_sha256
    assert C.load_corpus(root).digest == c.digest
    first = min(c.train)
    (root / first).write_text((root / first).read_text() + "\n# changed\n")
    assert C.load_corpus(root).digest != c.digest
    only_train = tmp_path / "t"
    only_train.mkdir()
    shutil.copyfile(root / first, only_train / first)
    with pytest.raises(ValueError, match="0 held-out"):
        C.load_corpus(only_train)


def test_corpus_sample_is_fixed_spread_and_within_its_bytes():
    # 200 files of 100..7.5k bytes in 7 folders; a sample of 40 kB: fixed (the same whatever
    # the dict's order), in path order, within its bytes and spread over every folder.
    files = {f"d{i % 7}/f{i:03d}.py": "x" * (100 + 37 * i) for i in range(200)}
    assert C.sample(files, None) == list(files)
    got = C.sample(files, 40_000)
    assert got == sorted(got) and got == C.sample(dict(reversed(list(files.items()))), 40_000)
    assert 30_000 < sum(len(files[k]) for k in got) <= 40_000
    assert {k.split("/")[0] for k in got} == {f"d{j}" for j in range(7)}
    first = min(files, key=lambda r: hashlib.sha256(r.encode()).hexdigest())
    assert C.sample(files, 1) == [first]  # one file at least, even past the bytes


# ---------------------------------------------------------------- a toy run, through the cache

@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    from bench import weights as bw

    base = tmp_path_factory.mktemp("toy")
    corpus = _small_corpus(base / "corpus")
    folder = bw.code_small_weights("cpu", minutes=5.0, cache=base / "cache", toy=True,
                                   corpus=corpus, steps=STEPS, log=print)
    return folder, corpus, base / "cache"


def test_toy_run_learns_and_records_everything(toy_run):
    folder, corpus, _ = toy_run
    rec = json.loads((folder / C.RECORD_FILE).read_text())
    tg, p = rec["target"], PRESETS["toy"]
    print(json.dumps({k: tg[k] for k in ("first_loss", "last_loss", "train_loss", "heldout_loss",
                                         "unigram_heldout_loss")}))
    assert tg["steps"] == STEPS and tg["tokens_seen"] == STEPS * p["batch"] * p["seq_len"]
    assert tg["stopped_by"] == "steps"
    assert tg["last_loss"] < tg["first_loss"] - 0.5
    assert [c["step"] for c in tg["heldout_curve"]] == [STEPS // 4, STEPS // 2, 3 * STEPS // 4]
    assert tg["heldout_loss"] < tg["unigram_heldout_loss"] - 0.2
    c = C.load_corpus(corpus)
    assert rec["corpus"]["digest"] == c.digest and rec["corpus"]["root"] == str(corpus)
    split = rec["corpus"]["split"]
    assert (split["train_files"], split["heldout_files"]) == (24, 2)
    # the toy's sample of the corpus holds all of this small one
    sample = rec["corpus_sample"]
    assert sample["max_bytes"] == p["corpus_bytes"]
    assert (sample["train_files"], sample["heldout_files"]) == (24, 2)
    assert split["heldout_list_sha256"] == c.heldout_digest
    assert rec["seed"] == 0 and rec["config_name"] == "toy" and rec["device"] == "cpu"
    for key in ("tokenizer", "encode", "target", "eval", "drafter", "tau", "wall"):
        assert rec["seconds"][key] >= 0
    assert tg["tokens_per_second"] > 0 and rec["parameters"] > rec["active_parameters"] > 0
    # the folder is a target the reference loads, with a drafter trained on training-file prompts
    cfg, _ = M.load_weights(folder)
    assert cfg == TOY
    from engine.drafters import block as BD

    dcfg, _ = BD.load(folder)  # bound to this target, else it raises
    assert dcfg.trained_steps == PRESETS["toy"]["drafter"]["steps"]
    assert dcfg.training["prompts"] == "training files" == rec["drafter"]["prompts"]
    tau = rec["tau"]
    assert ("tau" in tau and tau["same_tokens"] and tau["tau"] >= 1.0) or "skipped" in tau


def test_trained_folder_native_logits_match_the_reference(toy_run):
    folder, _, _ = toy_run
    tokens = np.arange(5, 25) % TOY.vocab_size
    ref = M.Model.from_dir(folder)
    logits, _ = ref.forward(tokens, np.arange(len(tokens)), ref.new_cache(len(tokens)))
    assert _rel(_native_logits(folder, tokens, "cpu"), logits) < 1e-4


def test_tokenizer_and_heldout_prompts(toy_run):
    from engine.text import load_tokenizer

    folder, corpus, _ = toy_run
    tok = load_tokenizer(folder)
    assert tok.vocab_size <= TOY.vocab_size and tok.eos_id == 0
    c = C.load_corpus(corpus)
    text = next(iter(c.heldout.values()))
    assert tok.decode(tok.encode(text)) == text
    prompts = C.heldout_prompts(folder, 4, 12, seed=3)
    assert [len(q) for q in prompts] == [12] * 4
    assert C.heldout_prompts(folder, 4, 12, seed=3) == prompts
    assert C.heldout_prompts(folder, 4, 12, seed=4) != prompts
    for q in prompts:
        s = tok.decode(q)
        if "\ufffd" not in s:  # a prompt may end inside a multi-byte character
            assert any(s in t for t in c.heldout.values()), s
            assert not any(s in t for t in c.train.values()) or len(s) < 40, s
    with pytest.raises(ValueError, match="ids but the model's vocab_size is 8"):
        load_tokenizer(folder, vocab_size=8)


def test_heldout_prompts_refuse_a_changed_file(toy_run, tmp_path):
    folder, corpus, _ = toy_run
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    rec = json.loads((copy / C.RECORD_FILE).read_text())
    moved = tmp_path / "corpus"
    shutil.copytree(corpus, moved)
    rec["corpus"]["root"] = str(moved)
    (copy / C.RECORD_FILE).write_text(json.dumps(rec))
    assert C.heldout_prompts(copy, 2, 8, seed=0) == C.heldout_prompts(folder, 2, 8, seed=0)
    name = min(rec["corpus"]["split"]["heldout_sha256"])
    (moved / name).write_text("x = 1\n")
    with pytest.raises(ValueError, match=f"held-out file .*{name} changed since training"):
        C.heldout_prompts(copy, 2, 8, seed=0)


def test_cache_reuses_a_complete_folder_and_retrains_a_damaged_one(toy_run):
    from bench import weights as bw

    folder, corpus, cache = toy_run
    assert folder.parent == cache / "weights" and folder.name.startswith("code-toy-")
    listed = json.loads((folder / bw.DIGESTS).read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json", "train.json",
            "drafter_config.json", "drafter.safetensors"} <= set(listed)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = bw.code_small_weights("cpu", minutes=5.0, cache=cache, toy=True, corpus=corpus,
                                  steps=STEPS)
    assert again == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    rec = bw.code_small_record(folder)
    assert rec["corpus_digest"] == C.load_corpus(corpus).digest and rec["steps"] == STEPS
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(300)
        f.write(b"\x7f\x7f\x7f")
    assert bw.code_small_weights("cpu", minutes=5.0, cache=cache, toy=True, corpus=corpus,
                                 steps=STEPS) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp
    assert bw._trained_complete(folder)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]
    # another budget is another key
    assert bw.code_small_key(True, 5.0, 0, corpus, STEPS)[0] == folder.name
    assert bw.code_small_key(True, 6.0, 0, corpus, STEPS)[0] != folder.name
    assert bw.code_small_key(True, 5.0, 1, corpus, STEPS)[0] != folder.name


def test_the_loop_stops_at_max_epochs():
    from engine.training.code_model import _fit, preset

    torch.set_num_threads(1)
    p = preset("toy", {"max_epochs": 0.5})
    rng = np.random.default_rng(0)
    train_ids = rng.integers(0, TOY.vocab_size, 5000).astype(np.int32)
    held_ids = rng.integers(0, TOY.vocab_size, 1000).astype(np.int32)
    net = TargetNet(TOY)
    init_parameters(net, 0)
    fit = _fit(net, train_ids, held_ids, p, torch.device("cpu"), 0, deadline=1e18, steps=None,
               log=print, progress=False)
    per_step = p["batch"] * p["seq_len"]
    assert fit["stopped_by"] == "epochs"
    assert fit["steps"] == -(-2500 // per_step)  # the first step at or past half an epoch
    assert len(fit["heldout_curve"]) == 3 and fit["epochs"] >= 0.5
