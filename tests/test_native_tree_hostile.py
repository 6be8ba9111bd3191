"""engine.native.tree against hostile arguments: a malformed tree is a status per request (as in
the reference and the C ABI, under every KDT_TREE_ACCEPT algorithm), never an exception; seq_lens whose positions would overflow int64
are refused by name; array-likes that are not arrays are a TypeError naming the argument."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import pytest

from engine.reference import ddtree

from native_helpers import (  # noqa: F401 (fixtures)
    DEVICES, FIELDS_ACCEPT, assert_same, native, random_build_inputs, skip_cuda_without_gpu)

pytestmark = pytest.mark.native
INT64_MAX = np.iinfo(np.int64).max


@dataclass
class Links:
    tokens: object
    first_child: object
    next_sibling: object
    num_nodes: object = None


def _tree(rng, bs=3, L=4, K=3, budget=9):
    args = random_build_inputs(rng, bs, L, K, ties=True)
    return ddtree.build_tree(*args[:2], budget, *args[2:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["walk", "parallel"])
@pytest.mark.parametrize("count", [0, -3, "n+1", 2**31 - 1, -(2**31)])
def test_num_nodes_outside_the_tree_is_status_1_per_request(device, algo, count, rng, monkeypatch):
    monkeypatch.setenv("KDT_TREE_ACCEPT", algo)
    t = _tree(rng)
    bs, n = t.tokens.shape
    nn = t.num_nodes.astype(np.int32).copy()
    nn[1] = n + 1 if count == "n+1" else count
    tree = Links(t.tokens, t.first_child, t.next_sibling, nn)
    tgt = rng.choice(t.tokens.reshape(-1), size=(bs, n)).astype(np.int64)
    got = native().accept_greedy(tree, tgt, device=device)
    assert got.status[1] == ddtree.ACCEPT_OUT_OF_RANGE and got.accept_len[1] == 1
    assert_same(got, ddtree.accept_greedy(tree, tgt), FIELDS_ACCEPT, f"num_nodes[1]={nn[1]}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["walk", "parallel"])
def test_links_far_outside_int32_are_a_status(device, algo, rng, monkeypatch):
    monkeypatch.setenv("KDT_TREE_ACCEPT", algo)
    t = _tree(rng)
    fc, ns = t.first_child.copy(), t.next_sibling.copy()
    fc[0, 0], ns[1, 1], fc[2, 0] = INT64_MAX, -INT64_MAX, 2**32 + 1
    tree = Links(t.tokens, fc, ns, t.num_nodes)
    tgt = t.tokens.copy()
    got = native().accept_greedy(tree, tgt, device=device)
    assert_same(got, ddtree.accept_greedy(tree, tgt), FIELDS_ACCEPT, "huge links")
    assert got.status[0] == 1 and got.status[2] == 1


ARRAY_LIKES = [lambda a: a.tolist(), lambda a: tuple(map(tuple, a.tolist())) if a.ndim == 2 else tuple(a.tolist()),
               lambda a: memoryview(a), lambda a: a.tolist()[0] if a.ndim > 1 else 7]


@pytest.mark.parametrize("field", ["tokens", "first_child", "next_sibling", "num_nodes", "target_argmax"])
@pytest.mark.parametrize("make", ARRAY_LIKES, ids=["list", "tuple", "memoryview", "scalar-or-row"])
def test_accept_array_likes_are_a_type_error_naming_the_argument(field, make, rng):
    t = _tree(rng)
    parts = {"tokens": t.tokens, "first_child": t.first_child, "next_sibling": t.next_sibling,
             "num_nodes": t.num_nodes.astype(np.int32)}
    tgt = t.tokens.copy()
    if field == "target_argmax":
        tgt = make(tgt)
    else:
        parts[field] = make(parts[field])
    name = field if field == "target_argmax" else f"tree.{field}"
    with pytest.raises(TypeError, match=f"accept_greedy: {name}: expected a numpy array or a torch tensor"):
        native().accept_greedy(Links(**parts), tgt)


@pytest.mark.parametrize("arg", ["top_logp", "top_ids", "root_ids", "seq_lens"])
def test_build_array_likes_are_a_type_error_naming_the_argument(arg, rng):
    lp, ids, roots, lens = random_build_inputs(rng, 2, 3, 2, ties=False)
    args = {"top_logp": lp, "top_ids": ids, "root_ids": roots, "seq_lens": lens}
    args[arg] = args[arg].tolist()
    with pytest.raises(TypeError, match=f"build_tree: {arg}: expected a numpy array or a torch tensor, got list"):
        native().build_tree(args["top_logp"], args["top_ids"], 5, args["root_ids"], args["seq_lens"])


@pytest.mark.parametrize("device", DEVICES)
def test_seq_lens_that_would_overflow_positions_are_refused(device, rng):
    bs, L, K = 2, 5, 3
    lp, ids, roots, lens = random_build_inputs(rng, bs, L, K, ties=False)
    lens = lens.copy()
    lens[1] = INT64_MAX - L  # the largest that fits: positions up to INT64_MAX
    got = native().build_tree(lp, ids, 7, roots, lens, device=device)
    ref = ddtree.build_tree(lp, ids, 7, roots, lens)
    assert np.array_equal(got.positions, ref.positions) and got.positions.max() <= INT64_MAX
    assert (got.positions[1][: got.num_nodes[1]] >= INT64_MAX - L).all()
    for bad in (INT64_MAX - L + 1, INT64_MAX):
        lens[1] = bad
        with pytest.raises(ValueError, match=rf"build_tree: seq_lens: {bad} at \[1\] would overflow int64"):
            native().build_tree(lp, ids, 7, roots, lens, device=device)
