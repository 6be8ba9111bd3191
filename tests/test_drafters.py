"""engine.drafters and engine.drafters.block: the interface contract, the oracle's quality knob,
numpy vs torch forwards of the block drafter, its file format, and a brief training run.

Fresh seeds every run (printed). float32 comparisons: relative error (norm-wise) under 1e-5; the
two forwards differ only in float32 summation order.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine.drafters import block as BD
from engine.reference import model as M
from engine.drafters.oracle import NoisyOracleDrafter
from engine.drafters.topk import topk_from_logits
from model_helpers import rel_err, single_thread_blas  # noqa: F401 (autouse fixture)

REL32 = 1e-5


def _check_contract(top_logp, top_ids, L, K, V):
    assert top_logp.dtype == np.float32 and top_logp.shape == (L, K)
    assert top_ids.dtype == np.int64 and top_ids.shape == (L, K)
    assert np.isfinite(top_logp).all() and (top_logp <= 0).all()
    assert (np.diff(top_logp, axis=1) <= 0).all(), "rows must be sorted descending"
    assert ((top_ids >= 0) & (top_ids < V)).all()
    assert all(len(set(row)) == K for row in top_ids.tolist()), "ids in a row must be distinct"


def test_topk_from_logits_matches_log_softmax(rng):
    logits = rng.standard_normal((5, 40)) * 3
    logits[2, 7] = logits[2, 9]  # an exact tie: the lower id first
    lp, ids = topk_from_logits(logits, 12)
    ref = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert rel_err(lp, np.take_along_axis(ref, ids, 1)) < 1e-6
    assert (ids[:, 0] == logits.argmax(1)).all()
    _check_contract(lp, ids, 5, 12, 40)
    r = ids[2].tolist()
    if 7 in r and 9 in r:
        assert r.index(7) < r.index(9)
    assert topk_from_logits(logits, 100)[0].shape == (5, 40)  # K clipped to V


def test_oracle_contract_and_extremes(rng):
    V, L, K = 512, 15, 15
    truth = rng.integers(0, V, 200)
    for P in (1, 50, 190):  # 190: the truth runs out past depth 9
        right = NoisyOracleDrafter(truth, V, L, quality=1.0, seed=3).draft(truth[:P], truth[P], None, K)
        wrong = NoisyOracleDrafter(truth, V, L, quality=0.0, seed=3).draft(truth[:P], truth[P], None, K)
        for lp, ids in (right, wrong):
            _check_contract(lp, ids, L, K, V)
        known = [d for d in range(1, L + 1) if P + d < len(truth)]
        assert all(right[1][d - 1, 0] == truth[P + d] for d in known)
        assert all(truth[P + d] not in wrong[1][d - 1] for d in known)


def test_oracle_quality_sets_the_rank_of_the_truth(rng):
    V, L, K, q = 512, 15, 8, float(rng.uniform(0.2, 0.8))
    truth = rng.integers(0, V, 400)
    seed = int(rng.integers(1 << 30))
    oracle = NoisyOracleDrafter(truth, V, L, quality=q, seed=seed)
    at0 = inside = total = 0
    for P in range(1, 380, 2):
        _, ids = oracle.draft(truth[:P], truth[P], None, K)
        for d in range(1, L + 1):
            row = ids[d - 1].tolist()
            at0 += row[0] == truth[P + d]
            inside += truth[P + d] in row
            total += 1
    # Binomial with n = 2850: 5 standard deviations is under 0.05 for every q.
    assert abs(at0 / total - q) < 0.05, (at0 / total, q)
    assert abs(inside / total - (q + (1 - q) * q)) < 0.05, (inside / total, q)
    again = NoisyOracleDrafter(truth, V, L, quality=q, seed=seed).draft(truth[:101], truth[101], None, K)
    assert all((a == b).all() for a, b in zip(again, oracle.draft(truth[:101], truth[101], None, K)))


def test_oracle_rejects_a_bad_quality():
    with pytest.raises(ValueError, match="quality = 1.5"):
        NoisyOracleDrafter([1, 2], 10, 3, quality=1.5)


# ---------------------------------------------------------------- block drafter

@pytest.fixture
def drafter_parts(rng):
    cfg = BD.DrafterConfig(vocab_size=512, target_hidden_size=256, context_size=int(rng.integers(4, 33)))
    return cfg, BD.init_weights(cfg, int(rng.integers(1 << 30)))


def test_numpy_and_torch_forwards_agree(drafter_parts, rng):
    cfg, w = drafter_parts
    dn = BD.BlockDrafter(cfg, w, backend="numpy")
    dt = BD.BlockDrafter(cfg, w, backend="torch")
    for P in (0, 1, cfg.context_size - 1, cfg.context_size + 7):
        hidden = rng.standard_normal((P, 256))
        root = int(rng.integers(512))
        a, b = dn.logits(hidden, root), dt.logits(hidden, root).numpy()
        assert a.shape == (cfg.depth, 512)
        assert rel_err(b, a) < REL32, P
        _check_contract(*dn.draft(None, root, hidden, 15), cfg.depth, 15, 512)
        lp_t, ids_t = dt.draft(None, root, hidden, 15)
        _check_contract(lp_t, ids_t, cfg.depth, 15, 512)
        lp_n, _ = dn.draft(None, root, hidden, 15)
        assert rel_err(lp_t, lp_n) < REL32


def test_torch_batch_with_left_padding_equals_single_requests(drafter_parts, rng):
    import torch

    cfg, w = drafter_parts
    net = BD.make_net(cfg, w)
    C = cfg.context_size
    lens = [C, 1, C // 2]
    ctx = np.zeros((3, C, 256), np.float32)
    valid = np.zeros((3, C), bool)
    hs = [rng.standard_normal((n, 256)).astype(np.float32) for n in lens]
    for b, h in enumerate(hs):
        ctx[b, C - len(h):], valid[b, C - len(h):] = h, True
        ctx[b, :C - len(h)] = 1e3  # padding content must not matter
    roots = rng.integers(0, 512, 3)
    with torch.no_grad():
        out = net(torch.tensor(ctx), torch.tensor(valid), torch.tensor(roots)).numpy()
    for b, h in enumerate(hs):
        assert rel_err(out[b], BD.forward_numpy(cfg, w, h, int(roots[b]))) < REL32


def test_drafter_files_round_trip_and_errors(tmp_path, drafter_parts):
    cfg, w = drafter_parts
    BD.save(tmp_path, cfg, w)
    cfg2, w2 = BD.load(tmp_path)
    assert cfg2 == cfg and all((w2[k] == w[k]).all() for k in w)
    json_cfg = json.loads((tmp_path / BD.CONFIG_FILE).read_text())
    (tmp_path / BD.CONFIG_FILE).write_text(json.dumps(dict(json_cfg, depth_bonus=1)))
    with pytest.raises(ValueError, match="unknown drafter config keys.*depth_bonus"):
        BD.load(tmp_path)
    (tmp_path / BD.CONFIG_FILE).write_text(json.dumps(dict(json_cfg, num_layers=3)))
    with pytest.raises(ValueError, match="drafter.safetensors: missing tensor layers.2"):
        BD.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no block drafter here"):
        BD.load(tmp_path / "nowhere")


@pytest.mark.cuda
def test_torch_cuda_forward_agrees_with_numpy(drafter_parts, rng):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch (the cuda marker runs on GPU hosts)")
    cfg, w = drafter_parts
    hidden = rng.standard_normal((40, 256))
    a = BD.BlockDrafter(cfg, w, backend="numpy").logits(hidden, 7)
    b = BD.BlockDrafter(cfg, w, backend="torch", device="cuda").logits(hidden, 7).cpu().numpy()
    # 1e-4, not 1e-5: TF32 matmuls may be on by default for CUDA float32 on some torch builds.
    assert rel_err(b, a) < 1e-4


# ---------------------------------------------------------------- training

@pytest.mark.slow
def test_brief_training_learns_and_keeps_the_invariant(tmp_path):
    from engine.reference.decode import generate

    out = tmp_path / "w"
    subprocess.run([sys.executable, "-m", "engine.cli.model", "init", "--out", str(out)], check=True,
                   capture_output=True)
    before = BD.load(out)[1]
    proc = subprocess.run([sys.executable, "-m", "engine.cli.drafter", "train", "--weights", str(out),
                           "--steps", "150", "--sequences", "12", "--new-tokens", "48"],
                          check=True, capture_output=True, text=True)
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    print(result)
    assert result["final_loss"] < result["first_loss"] - 0.5, result
    cfg, after = BD.load(out)
    assert cfg.trained_steps == 150
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    model = M.Model.from_dir(out)
    drafter = BD.BlockDrafter.from_dir(out, backend="numpy")
    prompt = np.arange(3, 20)
    ar = generate(model, prompt, 40)
    dd = generate(model, prompt, 40, mode="ddtree", budget=15, drafter=drafter)
    assert (dd.tokens == ar.tokens).all()
