"""Native greedy accept vs the reference (engine.reference.ddtree.accept_greedy), CPU and CUDA backends.

Trees come from the reference build on fresh random inputs (seed in every message); targets
follow a random tree path (all-accept down to a leaf), reject at the root, or are random;
malformed trees get random links, cycles, out-of-range indices and duplicate sibling tokens.
KDT_TREE_ACCEPT picks the algorithm per call: "walk" (the reference walk; the CPU default) or
"parallel" (the phases of cuda/src/tree_accept_parallel.h: the CUDA default, which the CPU
backend runs thread by thread); every test runs both. Well-formed trees also run under
"parallel-strict", which fails where the parallel phases would fall back to the walk, so those
tests prove the parallel path itself ran (tests/test_native_tree_hostile.py has the hostile
shapes).
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from engine.reference import ddtree

from native_helpers import (  # noqa: F401 (fixtures)
    DEVICES, FIELDS_ACCEPT, Links, assert_same, cuda_ready, native, random_build_inputs,
    skip_cuda_without_gpu)

pytestmark = pytest.mark.native


@pytest.fixture(params=["walk", "parallel"], autouse=True)
def accept_algo(request, monkeypatch):
    monkeypatch.setenv("KDT_TREE_ACCEPT", request.param)
    return request.param


def _targets(rng, tree, mode: str) -> np.ndarray:
    """target_argmax int64 [bs, n]: 'path' follows a random root-to-leaf path then stops at an
    unmatched token, 'reject' matches nothing, 'random' draws from the tree's own tokens."""
    bs, n = tree.tokens.shape
    if mode == "random":
        return rng.choice(tree.tokens.reshape(-1), size=(bs, n)).astype(np.int64)
    tgt = np.full((bs, n), -7, np.int64)  # -7 is never a token
    if mode == "path":
        for b in range(bs):
            cur = 0
            while tree.first_child[b, cur] != -1:
                kids = []
                c = tree.first_child[b, cur]
                while c != -1:
                    kids.append(int(c))
                    c = tree.next_sibling[b, c]
                nxt = kids[rng.integers(0, len(kids))]
                tgt[b, cur] = tree.tokens[b, nxt]
                cur = nxt
    return tgt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs,L,K,budget", [(1, 1, 1, 1), (4, 3, 2, 5), (12, 15, 8, 64),
                                           (3, 32, 4, 300), (2, 15, 64, 1023),
                                           (2, 15, 1024, 1024)])
@pytest.mark.parametrize("mode", ["path", "reject", "random"])
def test_accept_matches_reference(device, bs, L, K, budget, mode, accept_algo, monkeypatch):
    if accept_algo == "parallel":  # built trees are well formed: no fallback to the walk
        monkeypatch.setenv("KDT_TREE_ACCEPT", "parallel-strict")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    args = random_build_inputs(rng, bs, L, K, ties=True)
    tree = ddtree.build_tree(*args[:2], budget, *args[2:])
    tgt = _targets(rng, tree, mode)
    ref = ddtree.accept_greedy(tree, tgt)
    got = native().accept_greedy(tree, tgt, device=device)
    ctx = f"seed={seed} device={device} mode={mode} bs={bs} L={L} K={K} budget={budget}"
    assert_same(got, ref, FIELDS_ACCEPT, ctx)
    if mode == "reject":
        assert (got.accept_len == 1).all(), ctx
    if mode == "path":
        # Duplicate sibling tokens (random ids may repeat) can stop a path early; otherwise it
        # reaches a leaf, so every accepted request has a leaf last.
        ok = got.status == 0
        last = got.accept_index[np.arange(bs), got.accept_len - 1]
        assert (tree.first_child[np.arange(bs), last][ok] == -1).all(), ctx


def _malformed(rng, n: int, bs: int) -> tuple[Links, np.ndarray]:
    """Random link arrays: each entry -1, a valid index, an out-of-range index, or a cycle."""
    tokens = rng.integers(0, 3, size=(bs, n)).astype(np.int64)  # few tokens: duplicates
    choices = np.array([-1, -1, 0, n, n + 5, -2], np.int64)
    def links():
        a = rng.integers(0, n, size=(bs, n)).astype(np.int64)
        mask = rng.random((bs, n)) < 0.3
        a[mask] = rng.choice(choices, size=int(mask.sum()))
        return a
    num_nodes = rng.integers(1, n + 1, size=bs).astype(np.int32) if rng.integers(0, 2) else None
    tgt = rng.integers(0, 3, size=(bs, n)).astype(np.int64)
    return Links(tokens, links(), links(), num_nodes), tgt


@pytest.mark.parametrize("device", DEVICES)
def test_accept_regular_trees_with_duplicates(device, accept_algo, monkeypatch):
    # Well-formed trees (the parallel path proper) with a few distinct tokens: accepts, stops and
    # duplicate matches (status 3) at every depth; num_nodes below n on some. The parallel
    # algorithm must not fall back to the walk on them.
    if accept_algo == "parallel":
        monkeypatch.setenv("KDT_TREE_ACCEPT", "parallel-strict")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    seen = set()
    for trial in range(30):
        budget = int(rng.integers(1, 300))
        args = random_build_inputs(rng, 3, int(rng.integers(1, 20)),
                                   min(budget, int(rng.integers(1, 9))), ties=False)
        tree = ddtree.build_tree(*args[:2], budget, *args[2:])
        tree.tokens[...] = rng.integers(0, 3, size=tree.tokens.shape)
        tgt = rng.integers(0, 3, size=tree.tokens.shape).astype(np.int64)
        ref = ddtree.accept_greedy(tree, tgt)
        got = native().accept_greedy(tree, tgt, device=device)
        assert_same(got, ref, FIELDS_ACCEPT, f"seed={seed} trial={trial} device={device}")
        seen.update(ref.status.tolist())
    assert seen >= {0, 3}, f"seed={seed}: statuses seen {sorted(seen)}"


@pytest.mark.parametrize("device", DEVICES)
def test_accept_malformed_trees(device):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    seen = set()
    for trial in range(150):
        n, bs = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        tree, tgt = _malformed(rng, n, bs)
        ref = ddtree.accept_greedy(tree, tgt)
        got = native().accept_greedy(tree, tgt, device=device)
        assert_same(got, ref, FIELDS_ACCEPT, f"seed={seed} trial={trial} device={device} n={n}")
        seen.update(ref.status.tolist())
    # The random trees must have exercised every defect, else this test checks too little.
    assert seen >= {0, 1, 2, 3}, f"seed={seed}: statuses seen {sorted(seen)}"


@pytest.mark.parametrize("device", DEVICES)
def test_accept_cycles_terminate(device):
    # Hand-made defects: a self-loop sibling list, a child cycle whose tokens always match
    # (the walk would never end), an out-of-range first child, a duplicate match.
    n = 4
    tokens = np.array([[0, 5, 5, 5]] * 4, np.int64)
    fc = np.array([[1, -1, -1, -1], [1, 1, -1, -1], [4, -1, -1, -1], [1, -1, -1, -1]], np.int64)
    ns = np.array([[-1, 1, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, -1], [2, 2, -1, -1]],
                  np.int64)
    ns[3] = [-1, 2, -1, -1]
    tgt = np.array([[9, 9, 9, 9], [5, 5, 5, 5], [5, 5, 5, 5], [5, 5, 5, 5]], np.int64)
    tree = Links(tokens, fc, ns, None)
    got = native().accept_greedy(tree, tgt, device=device)
    assert got.status.tolist() == [2, 2, 1, 3], got
    assert got.accept_len.tolist() == [1, 4, 1, 1], got
    assert_same(got, ddtree.accept_greedy(tree, tgt), FIELDS_ACCEPT, f"device={device}")


def test_accept_rejects_bad_arguments():
    rng = np.random.default_rng(secrets.randbits(32))
    tree, tgt = _malformed(rng, 5, 2)
    with pytest.raises(ValueError, match="target_argmax: shape"):
        native().accept_greedy(tree, tgt[:, :3])
    with pytest.raises(ValueError, match="tree.first_child: dtype"):
        native().accept_greedy(Links(tree.tokens, tree.first_child.astype(np.int32),
                                     tree.next_sibling, None), tgt)
    # num_nodes outside [1, n] is a malformed tree, not a bad argument: status 1 for that request
    bad_count = Links(tree.tokens, tree.first_child, tree.next_sibling, np.array([0, 5], np.int32))
    got = native().accept_greedy(bad_count, tgt)
    assert got.status[0] == 1 and got.accept_len[0] == 1
    assert_same(got, ddtree.accept_greedy(bad_count, tgt), FIELDS_ACCEPT, "num_nodes [0, 5]")


@pytest.mark.cuda
def test_accept_torch_cuda(cuda_ready):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    args = random_build_inputs(rng, 16, 15, 8, ties=True)
    tree = ddtree.build_tree(*args[:2], 64, *args[2:])
    tgt = _targets(rng, tree, "path")
    ref = ddtree.accept_greedy(tree, tgt)
    ttree = Links(*(torch.from_numpy(getattr(tree, f)).cuda()
                    for f in ("tokens", "first_child", "next_sibling", "num_nodes")))
    got = native().accept_greedy(ttree, torch.from_numpy(tgt).cuda(), device="cuda")
    as_np = ddtree.Accept(**{f: getattr(got, f).cpu().numpy() for f in FIELDS_ACCEPT})
    assert_same(as_np, ref, FIELDS_ACCEPT, f"seed={seed} torch cuda")
