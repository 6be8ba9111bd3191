"""bench inputs, validation helpers and CPU ceilings: generators have the structure they claim
(sorted rows with ties, bf16 rounding equal to torch's, ancestor masks equal to the reference's),
and the checks catch what they must."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import inputs, validate


def test_round_bf16_matches_torch(rng):
    torch = pytest.importorskip("torch")
    x = (rng.standard_normal(10000) * 10.0 ** rng.integers(-3, 4, 10000)).astype(np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(inputs.round_bf16(x), want)


def test_tree_inputs_structure(rng):
    x = inputs.tree_inputs(rng, 8, 15, 64, seq_len=4096)
    lp, ids = x["top_logp"], x["top_ids"]
    assert lp.dtype == np.float32 and lp.shape == (8, 15, 64) and ids.dtype == np.int64
    assert np.all(np.diff(lp, axis=2) <= 0) and np.all(lp < 0) and np.all(np.isfinite(lp))
    assert np.any(np.diff(lp, axis=2) == 0), "no exact ties: bf16 logits should give some"
    assert all(len(set(r.tolist())) == 64 for r in ids.reshape(-1, 64))  # distinct ids per row
    assert np.all(x["seq_lens"] == 4096) and x["root_ids"].shape == (8,)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 100), st.integers(0, 2**32 - 1))
def test_pack_visibility_is_the_ancestor_relation(n, seed):
    rng = np.random.default_rng(seed)
    parents = inputs.random_parents(rng, n)
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n))
    vis = inputs.pack_visibility(parents, (n + 31) // 32)
    for i in range(n):
        anc, j = {i}, i
        while parents[j] >= 0:
            j = int(parents[j])
            anc.add(j)
        bits = {j for j in range(n) if (int(vis[i, j // 32]) >> (j % 32)) & 1}
        assert bits == anc, f"seed {seed}, row {i}"


def test_pack_visibility_matches_reference_tree(rng):
    from engine.reference import ddtree

    x = inputs.tree_inputs(rng, 3, 15, 63)
    t = ddtree.build_tree(x["top_logp"], x["top_ids"], 63, x["root_ids"], x["seq_lens"])
    for b in range(3):
        assert np.array_equal(inputs.pack_visibility(t.parents[b], t.visibility.shape[2]), t.visibility[b])


def test_accept_target_walks_deep(rng):
    from engine.reference import ddtree

    x = inputs.tree_inputs(rng, 32, 15, 64)
    t = ddtree.build_tree(x["top_logp"], x["top_ids"], 255, x["root_ids"], x["seq_lens"])
    acc = ddtree.accept_greedy(t, inputs.accept_target(rng, t, p_follow=1.0))
    # following a child at every node, every walk ends only at a leaf
    for b in range(32):
        last = acc.accept_index[b, acc.accept_len[b] - 1]
        assert t.first_child[b, last] == -1
    assert acc.accept_len.mean() > 2


def test_check_exact_names_the_first_difference(rng):
    from engine.reference import ddtree

    x = inputs.tree_inputs(rng, 4, 15, 15)
    t = ddtree.build_tree(x["top_logp"], x["top_ids"], 15, x["root_ids"], x["seq_lens"])
    out = {f: np.array(getattr(t, f)) for f in validate.TREE_FIELDS}
    assert validate.check_exact(out, t, validate.TREE_FIELDS)["ok"]
    out["scores"][2, 5] = np.nextafter(out["scores"][2, 5], 0)  # one ulp: bit for bit catches it
    v = validate.check_exact(out, t, validate.TREE_FIELDS)
    assert not v["ok"] and "scores[(2, 5)] (request 2)" in v["error"]
    sub = ddtree.build_tree(*(x[k][[1, 3]] for k in ("top_logp", "top_ids")), 15,
                            *(x[k][[1, 3]] for k in ("root_ids", "seq_lens")))
    v = validate.check_exact(out, sub, ["scores"], rows=[1, 3])
    assert v["ok"]  # request 2 is not in the subsample
    out["tokens"][3, 1] += 1
    v = validate.check_exact(out, sub, ["tokens"], rows=[1, 3])
    assert not v["ok"] and "(request 3)" in v["error"]


def test_rel_err_and_check_close():
    ref = np.array([1.0, -2.0, np.inf])
    assert validate.rel_err(ref, ref) == 0.0
    assert validate.rel_err(np.array([1.0, -2.0 + 2e-5, np.inf]), ref) == pytest.approx(1e-5)
    assert validate.rel_err(np.array([1.0, -2.0, 5.0]), ref) == float("inf")  # inf position moved
    v = validate.check_close({"out": (np.array([1.0, 2.1]), np.array([1.0, 2.0]))}, 1e-5, "all")
    assert not v["ok"] and "out: relative error" in v["error"]


def test_cpu_ceilings_have_formulas_and_samples():
    from bench import ceilings

    c = ceilings.measure("cpu", quick=True)
    for k in ("copy", "matmul"):
        assert c[k]["value"] > 0 and c[k]["value"] >= c[k]["value_at_median"]
        assert c[k]["formula"] and len(c[k]["samples"]) >= 3
    assert c["copy"]["unit"] == "GB/s" and c["matmul"]["unit"] == "TFLOP/s"
    with pytest.raises(ValueError, match="device"):
        ceilings.measure("tpu")
