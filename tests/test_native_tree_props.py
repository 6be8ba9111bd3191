"""Property tests (hypothesis): the native CPU backend equals the reference on arbitrary small
trees drawn from a few repeated log-prob values (exact ties everywhere), and accept equals the
reference on arbitrary link arrays. hypothesis prints the failing example; no fixed seed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.reference import ddtree

from native_helpers import FIELDS_ACCEPT, FIELDS_TREE, assert_same, native

pytestmark = pytest.mark.native

POOL = [0.0, -0.25, -0.5, -1.0, -3.0]  # dyadic: float64 sums are exact, so ties are exact


@st.composite
def build_inputs(draw):
    bs = draw(st.integers(1, 3))
    L = draw(st.integers(1, 6))
    budget = draw(st.integers(1, 40))
    K = draw(st.integers(1, budget))
    vals = draw(st.lists(st.sampled_from(POOL), min_size=bs * L * K, max_size=bs * L * K))
    lp = -np.sort(-np.array(vals, np.float32).reshape(bs, L, K), axis=2)
    ids = np.array(draw(st.lists(st.integers(0, 5), min_size=bs * L * K, max_size=bs * L * K)),
                   np.int64).reshape(bs, L, K)
    root = np.arange(bs, dtype=np.int64)
    seq = np.array(draw(st.lists(st.integers(0, 100), min_size=bs, max_size=bs)), np.int64)
    return np.ascontiguousarray(lp), ids, budget, root, seq


@settings(max_examples=150, deadline=None)
@given(build_inputs())
def test_build_equals_reference(args):
    ref = ddtree.build_tree(*args)
    got = native().build_tree(*args)
    assert_same(got, ref, FIELDS_TREE, f"L={args[0].shape[1]} K={args[0].shape[2]} B={args[2]}")


class _Links:
    def __init__(self, tokens, first_child, next_sibling):
        self.tokens, self.first_child, self.next_sibling = tokens, first_child, next_sibling
        self.num_nodes = None


@st.composite
def accept_inputs(draw):
    n = draw(st.integers(1, 12))
    bs = draw(st.integers(1, 3))
    link = st.integers(-2, n + 1)
    def arr(strategy):
        return np.array(draw(st.lists(strategy, min_size=bs * n, max_size=bs * n)),
                        np.int64).reshape(bs, n)
    return _Links(arr(st.integers(0, 2)), arr(link), arr(link)), arr(st.integers(0, 2))


@settings(max_examples=200, deadline=None)
@given(accept_inputs())
def test_accept_equals_reference_on_any_links(args):
    tree, target = args
    ref = ddtree.accept_greedy(tree, target)
    got = native().accept_greedy(tree, target)
    assert_same(got, ref, FIELDS_ACCEPT, "random links")
