"""engine.reference.mla: the float64 verify-attention reference against a direct per-query softmax, the
state merge, the empty-state cases and the ragged layout.

Tolerance: both sides are float64 on the same inputs and differ only in summation order, so
relative errors (max |out - ref| / max |ref|) stay near 1e-15; 1e-12 leaves room for long rows.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kdtr import bundle as kdtr
from engine.reference import ddtree, mla

TOL = 1e-12


def _rel(out, ref):
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _direct(q_lat, q_pe, ckv, kpe, mask, scale):
    """Per (query, head) softmax over the visible keys, written out one query at a time.
    ckv [m, Dl], kpe [m, Dr], mask [n, m] bool."""
    n, H, Dl = q_lat.shape
    out, lse = np.zeros((n, H, Dl)), np.full((n, H), -np.inf)
    for i in range(n):
        keys = np.flatnonzero(mask[i])
        if len(keys) == 0:
            continue
        for h in range(H):
            s = np.array([(q_lat[i, h] @ ckv[j] + q_pe[i, h] @ kpe[j]) * scale for j in keys])
            lse[i, h] = np.logaddexp.reduce(s)
            w = np.exp(s - lse[i, h])
            out[i, h] = w @ ckv[keys]
    return out, lse


def _random_request(rng, n, P, H, Dl, Dr):
    """A tree of n nodes (random parents) with prefix P: arrays for tree_verify_attention."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    vis = np.zeros((n, n), bool)
    for i in range(n):
        if i:
            vis[i] = vis[parents[i]]
        vis[i, i] = True
    W = max(1, math.ceil(n / 32))
    packed = np.zeros((n, W), np.uint32)
    for i, j in zip(*np.nonzero(vis)):
        packed[i, j // 32] |= np.uint32(1 << (j % 32))
    g = rng.standard_normal
    return dict(q_lat=g((n, H, Dl)), q_pe=g((n, H, Dr)), prefix_ckv=g((P, Dl)),
                prefix_kpe=g((P, Dr)), tree_ckv=g((n, Dl)), tree_kpe=g((n, Dr)),
                visibility=packed), vis


@pytest.mark.parametrize("n, P, H, Dl, Dr", [(1, 0, 1, 4, 2), (17, 37, 3, 16, 8),
                                              (37, 1, 2, 8, 4), (33, 0, 5, 12, 4),
                                              (12, 17, 4, 32, 16)])
def test_tree_attention_matches_direct_softmax(n, P, H, Dl, Dr):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    args, vis = _random_request(rng, n, P, H, Dl, Dr)
    scale = 1 / math.sqrt(Dl + Dr)
    out, lse = mla.tree_verify_attention(**args, softmax_scale=scale)
    ckv = np.concatenate([args["prefix_ckv"], args["tree_ckv"]])
    kpe = np.concatenate([args["prefix_kpe"], args["tree_kpe"]])
    mask = np.concatenate([np.ones((n, P), bool), vis], axis=1)
    ref_out, ref_lse = _direct(args["q_lat"], args["q_pe"], ckv, kpe, mask, scale)
    assert out.shape == (n, H, Dl) and lse.shape == (n, H) and out.dtype == np.float64
    assert _rel(out, ref_out) < TOL, f"seed {seed}"
    assert _rel(lse, ref_lse) < TOL, f"seed {seed}"


def test_empty_rows_give_the_empty_state():
    # P = 0 and a row with no visibility bit: no key at all -> out 0, lse -inf (no NaN).
    rng = np.random.default_rng()
    args, _ = _random_request(rng, 3, 0, 2, 4, 2)
    args["visibility"][1] = 0
    out, lse = mla.tree_verify_attention(**args, softmax_scale=0.5)
    assert np.isneginf(lse[1]).all() and (out[1] == 0).all()
    assert np.isfinite(lse[[0, 2]]).all() and not np.isnan(out).any()


def test_large_scores_do_not_overflow():
    rng = np.random.default_rng()
    args, vis = _random_request(rng, 5, 4, 2, 8, 4)
    args["q_lat"] *= 1e3  # scores in the thousands: exp() would overflow without the max shift
    out, lse = mla.tree_verify_attention(**args, softmax_scale=1.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    ckv = np.concatenate([args["prefix_ckv"], args["tree_ckv"]])
    kpe = np.concatenate([args["prefix_kpe"], args["tree_kpe"]])
    mask = np.concatenate([np.ones((5, 4), bool), vis], axis=1)
    ref_out, ref_lse = _direct(args["q_lat"], args["q_pe"], ckv, kpe, mask, 1.0)
    assert _rel(out, ref_out) < TOL and _rel(lse, ref_lse) < TOL


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 12), st.integers(1, 3))
def test_merge_of_a_split_equals_the_whole(seed, m, H):
    """Any split of a key set into two parts (either may be empty) merges to the whole."""
    rng = np.random.default_rng(seed)
    q_lat, q_pe = rng.standard_normal((2, H, 6)), rng.standard_normal((2, H, 3))
    ckv, kpe = rng.standard_normal((m, 6)), rng.standard_normal((m, 3))
    part = rng.random(m) < 0.5
    whole = mla.attention_state(q_lat, q_pe, ckv, kpe, 0.7)
    a = mla.attention_state(q_lat, q_pe, ckv[part], kpe[part], 0.7)
    b = mla.attention_state(q_lat, q_pe, ckv[~part], kpe[~part], 0.7)
    for merged in (mla.merge_states(*a, *b), mla.merge_states(*b, *a)):
        if m == 0:
            assert np.isneginf(merged[1]).all() and (merged[0] == 0).all()
        else:
            assert _rel(merged[0], whole[0]) < TOL and _rel(merged[1], whole[1]) < TOL


def test_merge_with_the_empty_state_is_the_identity():
    rng = np.random.default_rng()
    o, lse = rng.standard_normal((4, 2, 8)), rng.standard_normal((4, 2))
    empty_o, empty_lse = np.zeros((4, 2, 8)), np.full((4, 2), -np.inf)
    mo, ml = mla.merge_states(o, lse, empty_o, empty_lse)
    assert np.array_equal(mo, o) and np.array_equal(ml, lse)
    mo, ml = mla.merge_states(empty_o, empty_lse, empty_o, empty_lse)
    assert (mo == 0).all() and np.isneginf(ml).all()


def test_ragged_equals_per_request_and_accepts_bf16():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    H, Dl, Dr = 3, 16, 8
    sizes, prefixes = [1, 17, 5, 33], [0, 12, 37, 0]
    reqs = [_random_request(rng, n, P, H, Dl, Dr)[0] for n, P in zip(sizes, prefixes)]
    W = 2
    q_lat = np.concatenate([r["q_lat"] for r in reqs])
    q_pe = np.concatenate([r["q_pe"] for r in reqs])
    kv = np.concatenate([np.concatenate([np.concatenate([r["prefix_ckv"], r["prefix_kpe"]], 1),
                                         np.concatenate([r["tree_ckv"], r["tree_kpe"]], 1)])
                         for r in reqs])
    vis = np.zeros((sum(sizes), W), np.uint32)
    q_indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(np.add(sizes, prefixes))]).astype(np.int32)
    for b, r in enumerate(reqs):
        vis[q_indptr[b]:q_indptr[b + 1], : r["visibility"].shape[1]] = r["visibility"]
    out, lse = mla.verify_attention_ragged(q_lat, q_pe, kv, q_indptr, kv_indptr, vis, 0.3)
    for b, r in enumerate(reqs):
        o, s = mla.tree_verify_attention(**r, softmax_scale=0.3)
        rows = slice(q_indptr[b], q_indptr[b + 1])
        assert np.array_equal(out[rows], o) and np.array_equal(lse[rows], s), f"seed {seed}"
    # bf16 torch tensors are read as their exact float64 values.
    as_bf16 = [kdtr.to_bf16(a) for a in (q_lat, q_pe, kv)]
    o16, l16 = mla.verify_attention_ragged(*as_bf16, q_indptr, kv_indptr, vis, 0.3)
    o64, l64 = mla.verify_attention_ragged(*(kdtr.bf16_to_f64(a) for a in as_bf16), q_indptr,
                                           kv_indptr, vis, 0.3)
    assert np.array_equal(o16, o64) and np.array_equal(l16, l64)


def test_reference_on_a_built_tree():
    rng = np.random.default_rng()
    lp = -np.sort(rng.exponential(size=(1, 4, 3)), axis=2).astype(np.float32)
    tree = ddtree.build_tree(lp, rng.integers(0, 50, (1, 4, 3)), 9, np.zeros(1, np.int64),
                             np.zeros(1, np.int64))
    n = int(tree.num_nodes[0])
    args, _ = _random_request(rng, n, 6, 2, 8, 4)
    args["visibility"] = tree.visibility[0]
    out, lse = mla.tree_verify_attention(**args, softmax_scale=0.25)
    mask = np.concatenate([np.ones((n, 6), bool), ddtree.unpack_visibility(tree)[0]], axis=1)
    ckv = np.concatenate([args["prefix_ckv"], args["tree_ckv"]])
    kpe = np.concatenate([args["prefix_kpe"], args["tree_kpe"]])
    ref_out, ref_lse = _direct(args["q_lat"], args["q_pe"], ckv, kpe, mask, 0.25)
    assert _rel(out, ref_out) < TOL and _rel(lse, ref_lse) < TOL


def test_argument_validation():
    rng = np.random.default_rng()
    args, _ = _random_request(rng, 3, 2, 2, 4, 2)
    bad = dict(args, q_lat=args["q_lat"].copy())
    bad["q_lat"][0, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"q_lat: non-finite value nan at \[0, 1, 2\]"):
        mla.tree_verify_attention(**bad, softmax_scale=1.0)
    with pytest.raises(ValueError, match="tree_ckv: 2 rows, expected n = 3"):
        mla.tree_verify_attention(**dict(args, tree_ckv=args["tree_ckv"][:2]), softmax_scale=1)
    with pytest.raises(ValueError, match="visibility: expected a uint32"):
        mla.tree_verify_attention(**dict(args, visibility=args["visibility"].astype(np.int32)),
                                  softmax_scale=1.0)
    with pytest.raises(ValueError, match="prefix_kpe: width 3, expected 2"):
        mla.tree_verify_attention(**dict(args, prefix_kpe=np.zeros((2, 3))), softmax_scale=1)
    q = np.zeros((3, 1, 4))
    with pytest.raises(ValueError, match="kv_indptr: request 0 has 2 cache rows for 3"):
        mla.verify_attention_ragged(q, np.zeros((3, 1, 2)), np.zeros((2, 6)), [0, 3], [0, 2],
                                    np.ones((3, 1), np.uint32), 1.0)
    with pytest.raises(ValueError, match=r"q_indptr: \[0, 2\] must rise from 0 to 3"):
        mla.verify_attention_ragged(q, np.zeros((3, 1, 2)), np.zeros((3, 6)), [0, 2], [0, 3],
                                    np.ones((3, 1), np.uint32), 1.0)
