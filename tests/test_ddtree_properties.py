"""Property tests of engine.reference.ddtree (hypothesis), with exact score ties on purpose.

Log-probs are drawn from small pools of multiples of 2**-20 in [-8, 0] (exact in float32, and
every path sum of them is exact in float64), so ties are frequent and `math.fsum` of a rank
path is the true score: the brute-force order below is independent of the heap's arithmetic.
"""

import itertools
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.reference import ddtree
from engine.reference.ddtree import accept_greedy, build_tree, unpack_visibility

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
ID_STRIDE = 1000  # top_ids[b, d, r] = d * ID_STRIDE + r, so a token names its depth and rank


@st.composite
def tree_inputs(draw, max_l=4, max_k=4, max_bs=3):
    bs = draw(st.integers(1, max_bs))
    L = draw(st.integers(1, max_l))
    K = draw(st.integers(1, max_k))
    space = sum(K ** d for d in range(1, L + 1))
    budget = draw(st.integers(1, min(space + 3, 80)))
    # A pool of 1-4 values per example: repeated values make exact ties common.
    pool = draw(st.lists(st.integers(0, 8 << 20), min_size=1, max_size=4))
    raw = draw(st.lists(st.sampled_from(pool), min_size=bs * L * K, max_size=bs * L * K))
    lp = -np.sort(np.array(raw, np.float64).reshape(bs, L, K), axis=2) / (1 << 20)
    ids = np.arange(L)[:, None] * ID_STRIDE + np.arange(K)[None, :]
    ids = np.broadcast_to(ids, (bs, L, K)).astype(np.int64)
    seq = np.array(draw(st.lists(st.integers(0, 50), min_size=bs, max_size=bs)), np.int64)
    roots = np.arange(bs, dtype=np.int64) + 555
    return lp.astype(np.float32), ids, budget, roots, seq


def _rank_path(tree, b, i):
    path = []
    while i > 0:
        path.append(int(tree.tokens[b, i]) % ID_STRIDE)
        i = int(tree.parents[b, i])
    return tuple(reversed(path))


@SETTINGS
@given(tree_inputs())
def test_heap_order_is_the_sorted_order_of_all_candidates(args):
    lp, ids, budget, roots, seq = args
    tree = build_tree(lp, ids, budget, roots, seq)
    bs, L, K = lp.shape
    for b in range(bs):
        cands = [p for d in range(1, L + 1) for p in itertools.product(range(K), repeat=d)]
        score = {p: math.fsum(float(lp[b, d, r]) for d, r in enumerate(p)) for p in cands}
        expect = sorted(cands, key=lambda p: (-score[p], p))[:budget]
        got = [_rank_path(tree, b, i) for i in range(1, int(tree.num_nodes[b]))]
        assert got == expect
        assert tree.scores[b, 1:len(got) + 1].tolist() == [score[p] for p in expect]


@SETTINGS
@given(tree_inputs(max_l=5, max_k=5))
def test_structure_invariants(args):
    lp, ids, budget, roots, seq = args
    tree = build_tree(lp, ids, budget, roots, seq)
    bs, L, K = lp.shape
    n = budget + 1
    space = sum(K ** d for d in range(1, L + 1))
    vis = unpack_visibility(tree)
    assert tree.visibility.shape == (bs, n, (n + 31) // 32)
    for b in range(bs):
        m = int(tree.num_nodes[b])
        assert m == 1 + min(budget, space)
        par, dep = tree.parents[b], tree.depths[b]
        assert par[0] == -1 and dep[0] == 0 and tree.tokens[b, 0] == roots[b]
        for i in range(1, m):
            p = int(par[i])
            assert 0 <= p < i  # parents precede children
            assert dep[i] == dep[p] + 1
            # Row i = its parent's row plus its own bit.
            expect = vis[b, p].copy()
            expect[i] = True
            assert np.array_equal(vis[b, i], expect)
        assert np.array_equal(tree.positions[b, :m], seq[b] + dep[:m])
        for p in range(m):
            lst, c = [], int(tree.first_child[b, p])
            while c != -1:
                lst.append(c)
                c = int(tree.next_sibling[b, c])
            children = [i for i in range(1, m) if par[i] == p]
            assert lst == sorted(children, reverse=True)  # SGLang prepend order
            ranks = [int(tree.tokens[b, i]) % ID_STRIDE for i in children]
            assert ranks == list(range(len(children)))  # siblings by increasing rank
        for name in ("tokens", "parents", "depths", "positions", "first_child", "next_sibling"):
            assert (getattr(tree, name)[b, m:] == -1).all(), name
        assert not vis[b, m:].any() and not vis[b, :, m:].any()


def _walk_by_parents(tree, b, target):
    """An independent greedy walk: children found through `parents`, not the link lists."""
    path = [0]
    m = int(tree.num_nodes[b])
    while True:
        cur = path[-1]
        hits = [i for i in range(1, m) if tree.parents[b, i] == cur
                and tree.tokens[b, i] == target[cur]]
        assert len(hits) <= 1  # distinct ids per row: no duplicates among siblings
        if not hits:
            return path
        path.append(hits[0])


@SETTINGS
@given(tree_inputs(max_l=5, max_k=4), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_accept_agrees_with_a_walk_over_parents(args, seed, follow):
    lp, ids, budget, roots, seq = args
    tree = build_tree(lp, ids, budget, roots, seq)
    bs, n = tree.tokens.shape
    rng = np.random.default_rng(seed)
    # Each node's target is, with probability `follow`, the token of one of its children.
    target = rng.integers(0, 3, (bs, n)) + 10**6
    for b in range(bs):
        for i in range(int(tree.num_nodes[b])):
            kids = np.flatnonzero(tree.parents[b] == i)
            if len(kids) and rng.random() < follow:
                target[b, i] = tree.tokens[b, rng.choice(kids)]
    acc = accept_greedy(tree, target)
    assert (acc.status == ddtree.ACCEPT_OK).all()
    for b in range(bs):
        path = _walk_by_parents(tree, b, target[b])
        assert acc.accept_len[b] == len(path)
        assert acc.accept_index[b].tolist() == path + [-1] * (n - len(path))
        assert acc.bonus[b] == target[b, path[-1]]


@st.composite
def malformed_trees(draw):
    n = draw(st.integers(1, 10))
    # Mostly in-range links and list ends, so cycles and duplicates are common, plus strays.
    link = st.one_of(st.integers(1, max(1, n - 1)), st.just(-1), st.integers(-2, n + 1))
    links = st.lists(link, min_size=n, max_size=n)
    small = st.lists(st.integers(0, 2), min_size=n, max_size=n)
    return (n, draw(small), draw(links), draw(links), draw(st.integers(-1, n + 1)), draw(small))


@SETTINGS
@given(malformed_trees())
def test_malformed_trees_terminate_with_a_status(args):
    n, tokens, first_child, next_sibling, num_nodes, target = args

    class Tree:
        pass

    t = Tree()
    t.tokens = np.array([tokens], np.int64)
    t.first_child = np.array([first_child], np.int64)
    t.next_sibling = np.array([next_sibling], np.int64)
    t.num_nodes = np.array([num_nodes], np.int32)
    acc = accept_greedy(t, np.array([target], np.int64))
    k, status = int(acc.accept_len[0]), int(acc.status[0])
    path = acc.accept_index[0, :k].tolist()
    assert 1 <= k <= n and path[0] == 0 and (acc.accept_index[0, k:] == -1).all()
    assert acc.bonus[0] == target[path[-1]]
    if not 1 <= num_nodes <= n:
        assert status == ddtree.ACCEPT_OUT_OF_RANGE and k == 1
        return

    def child_list(p, limit):
        """Links followed from p's first child, at most `limit` of them, as raw values."""
        out, c = [], first_child[p]
        while c != -1 and len(out) < limit:
            out.append(c)
            if not 1 <= c < num_nodes:
                break
            c = next_sibling[c]
        return out

    for a, nxt in zip(path, path[1:]):  # every step was a matched, in-range child
        assert nxt in child_list(a, n + 1) and tokens[nxt] == target[a] and 1 <= nxt < num_nodes
    last = path[-1]
    links = child_list(last, n + 1)
    in_range = [c for c in links if 1 <= c < num_nodes]
    matched = [c for c in in_range[:n + 1] if tokens[c] == target[last]]  # with revisits
    if status == ddtree.ACCEPT_OK:
        assert len(links) <= n and len(in_range) == len(links) and not matched
    elif status == ddtree.ACCEPT_OUT_OF_RANGE:
        assert len(in_range) < len(links)
    elif status == ddtree.ACCEPT_CYCLE:
        assert k == n or len(in_range) > n
    else:
        assert status == ddtree.ACCEPT_DUPLICATE and len(matched) >= 2
