"""engine.reference.ddtree: the worked example, exact ties, degenerate sizes, argument validation.

Property tests (hypothesis) live in test_ddtree_properties.py.
"""

import re

import numpy as np
import pytest

from engine.reference import ddtree
from engine.reference.ddtree import accept_greedy, build_tree, sglang_mask, unpack_visibility


def _one(top_logp, top_ids, budget, root=7, seq_len=10):
    """Wrap one request's [L, K] rows into the batched call."""
    return build_tree(np.asarray(top_logp, np.float32)[None], np.asarray(top_ids, np.int64)[None],
                      budget, np.array([root], np.int64), np.array([seq_len], np.int64))


def _worked_example():
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])
    ids = np.array([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    return _one(np.log(probs).astype(np.float32), ids, 6)


def test_worked_example_of_ddtree_md():
    t = _worked_example()
    assert t.tokens.tolist() == [[7, 11, 21, 12, 31, 22, 31]]
    assert t.depths.tolist() == [[0, 1, 2, 1, 3, 2, 3]]
    assert t.parents.tolist() == [[-1, 0, 1, 0, 2, 1, 5]]
    assert t.positions.tolist() == [[10, 11, 12, 11, 13, 12, 13]]
    # SGLang's prepend lists for this tree (research note): root's children listed 3 then 1.
    assert t.first_child.tolist() == [[3, 5, 4, -1, -1, 6, -1]]
    assert t.next_sibling.tolist() == [[-1, -1, -1, 1, -1, 2, -1]]
    assert t.num_nodes.tolist() == [7]
    assert t.visibility.shape == (1, 7, 1) and t.visibility.dtype == np.uint32
    # Row i = ancestors + self: 0b1, 0b11, 0b111, 0b1001, 0b10111, 0b100011, 0b1100011.
    assert t.visibility[0, :, 0].tolist() == [1, 3, 7, 9, 23, 35, 99]
    lp = np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])).astype(np.float32)
    lp = lp.astype(np.float64)
    expect = [0.0, lp[0, 0], lp[0, 0] + lp[1, 0], (lp[0, 0] - lp[0, 0]) + lp[0, 1],
              (lp[0, 0] + lp[1, 0]) + lp[2, 0], ((lp[0, 0] + lp[1, 0]) - lp[1, 0]) + lp[1, 1],
              (((lp[0, 0] + lp[1, 0]) - lp[1, 0]) + lp[1, 1]) + lp[2, 0]]
    assert t.scores.dtype == np.float64 and t.scores[0].tolist() == expect


def test_all_equal_logprobs_fall_to_rank_path_order():
    # Every score is 0.0: the order is the rank paths sorted lexicographically (prefix first).
    t = _one(np.zeros((3, 2)), np.arange(6).reshape(3, 2), 8)
    # (0,) (0,0) (0,0,0) (0,0,1) (0,1) (0,1,0) (0,1,1) (1,)
    assert t.depths[0].tolist() == [0, 1, 2, 3, 3, 2, 3, 3, 1]
    assert t.parents[0].tolist() == [-1, 0, 1, 2, 2, 1, 5, 5, 0]
    assert t.tokens[0].tolist() == [7, 0, 2, 4, 5, 3, 4, 5, 1]


def test_equal_negative_logprobs_give_depth_major_order():
    # Every log-prob -1: score = -depth exactly, so depth 1 first, then lexicographic paths.
    t = _one(np.full((3, 2), -1.0), np.arange(6).reshape(3, 2), 6)
    assert t.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert t.scores[0].tolist() == [0.0, -1.0, -1.0, -2.0, -2.0, -2.0, -2.0]


def test_budget_one_k_one_l_one():
    t = _one([[-0.5]], [[42]], 1)
    assert t.tokens.tolist() == [[7, 42]] and t.num_nodes.tolist() == [2]
    assert t.parents.tolist() == [[-1, 0]] and t.first_child.tolist() == [[1, -1]]


def test_k_one_is_a_chain():
    t = _one(np.full((5, 1), -0.25), np.arange(5)[:, None], 5)
    assert t.parents[0].tolist() == [-1, 0, 1, 2, 3, 4]
    assert t.tokens[0].tolist() == [7, 0, 1, 2, 3, 4]
    a = accept_greedy(t, np.array([[0, 1, 2, 3, 4, 99]], np.int64))
    assert a.accept_len.tolist() == [6] and a.bonus.tolist() == [99]
    assert a.accept_index.tolist() == [[0, 1, 2, 3, 4, 5]] and a.status.tolist() == [0]


def test_budget_larger_than_candidate_space_fills_unused_slots():
    # L = 2, K = 2: 2 + 4 = 6 candidates, budget 9 -> 7 nodes, slots 7..9 unused.
    t = _one(np.log([[0.7, 0.3], [0.6, 0.4]]), [[1, 2], [3, 4]], 9, seq_len=5)
    assert t.num_nodes.tolist() == [7]
    for name in ("tokens", "parents", "depths", "positions", "first_child", "next_sibling"):
        assert getattr(t, name)[0, 7:].tolist() == [-1, -1, -1], name
    assert not t.visibility[0, 7:].any() and t.scores[0, 7:].tolist() == [0.0] * 3
    assert t.positions[0, :7].tolist() == (5 + t.depths[0, :7]).tolist()


def test_batch_requests_are_independent():
    rng = np.random.default_rng()
    lp = -np.sort(rng.exponential(size=(5, 4, 6)), axis=2).astype(np.float32)
    ids = rng.integers(0, 1000, (5, 4, 6))
    seq = rng.integers(0, 100, 5)
    t = build_tree(lp, ids, 12, np.arange(5), seq)
    for b in range(5):
        one = build_tree(lp[b:b + 1], ids[b:b + 1], 12, np.array([b]), seq[b:b + 1])
        for name in ("tokens", "parents", "first_child", "next_sibling", "visibility", "scores"):
            assert np.array_equal(getattr(t, name)[b], getattr(one, name)[0]), name


def test_all_reject_and_all_accept_on_worked_example():
    t = _worked_example()
    reject = accept_greedy(t, np.full((1, 7), 5, np.int64))
    assert reject.accept_len.tolist() == [1] and reject.bonus.tolist() == [5]
    assert reject.accept_index.tolist() == [[0, -1, -1, -1, -1, -1, -1]]
    target = np.zeros((1, 7), np.int64)
    target[0, [0, 1, 5, 6]] = [11, 22, 31, 77]  # 0 -> 1 -> 5 -> 6, bonus 77
    a = accept_greedy(t, target)
    assert a.accept_index[0, :4].tolist() == [0, 1, 5, 6] and a.accept_len.tolist() == [4]
    assert a.bonus.tolist() == [77] and a.status.tolist() == [0]


class _T:
    def __init__(self, tokens, first_child, next_sibling, num_nodes=None):
        self.tokens = np.array([tokens], np.int64)
        self.first_child = np.array([first_child], np.int64)
        self.next_sibling = np.array([next_sibling], np.int64)
        self.num_nodes = None if num_nodes is None else np.array([num_nodes], np.int32)


def _accept(tree, target):
    a = accept_greedy(tree, np.array([target], np.int64))
    return a.accept_index[0, : a.accept_len[0]].tolist(), int(a.status[0]), int(a.bonus[0])


def test_accept_out_of_range_link():
    tree = _T([0, 5, 6], [1, 9, -1], [-1, -1, -1])  # node 1's first child is 9
    assert _accept(tree, [5, 6, 0]) == ([0, 1], ddtree.ACCEPT_OUT_OF_RANGE, 6)
    # A link into the unused slots (>= num_nodes) is out of range too; so is 0 (the root).
    tree = _T([0, 5, 6], [1, 2, -1], [-1, -1, -1], num_nodes=2)
    assert _accept(tree, [5, 6, 0]) == ([0, 1], ddtree.ACCEPT_OUT_OF_RANGE, 6)
    tree = _T([0, 5, 6], [1, 0, -1], [-1, -1, -1])
    assert _accept(tree, [5, 6, 0])[1] == ddtree.ACCEPT_OUT_OF_RANGE


def test_accept_sibling_cycle_terminates():
    tree = _T([0, 5, 6], [1, -1, -1], [-1, 2, 1])  # siblings 1 -> 2 -> 1 -> ...
    assert _accept(tree, [9, 0, 0]) == ([0], ddtree.ACCEPT_CYCLE, 9)
    # Meeting the matched node again on the cycle counts as a duplicate (the scan met the
    # matched token twice), as in the native core.
    assert _accept(tree, [5, 0, 0]) == ([0], ddtree.ACCEPT_DUPLICATE, 5)


def test_accept_walk_cycle_terminates():
    tree = _T([0, 5, 6], [1, 2, 1], [-1, -1, -1])  # 1 -> 2 -> 1 -> ... along first children
    path, status, _ = _accept(tree, [5, 6, 5])
    assert path == [0, 1, 2] and status == ddtree.ACCEPT_CYCLE


@pytest.mark.parametrize("num_nodes", [0, 4, -1])
def test_accept_num_nodes_outside_range_is_a_defect(num_nodes):
    tree = _T([0, 5, 6], [1, 2, -1], [-1, -1, -1], num_nodes=num_nodes)
    assert _accept(tree, [5, 6, 0]) == ([0], ddtree.ACCEPT_OUT_OF_RANGE, 5)


def test_accept_duplicate_sibling_token():
    tree = _T([0, 5, 5], [2, -1, -1], [-1, -1, 1])
    assert _accept(tree, [5, 0, 0]) == ([0], ddtree.ACCEPT_DUPLICATE, 5)
    # A duplicate of a token that is not the target is not a defect.
    assert _accept(tree, [4, 0, 0]) == ([0], ddtree.ACCEPT_OK, 4)


def test_accept_first_defect_on_the_walk_wins():
    # Node 1 matches first, then node 3 is out of range before the duplicate 2 is met.
    tree = _T([0, 5, 5, 0], [1, -1, -1, -1], [-1, 9, -1, -1])
    assert _accept(tree, [5, 0, 0, 0])[1] == ddtree.ACCEPT_OUT_OF_RANGE
    tree = _T([0, 5, 5, 0], [1, -1, -1, -1], [-1, 2, 9, -1])
    assert _accept(tree, [5, 0, 0, 0])[1] == ddtree.ACCEPT_DUPLICATE


def test_sglang_mask_layout():
    t = _worked_example()
    m = sglang_mask(t, np.array([3], np.int64))
    assert m.dtype == bool and m.shape == (7 * (3 + 7),)
    block = m.reshape(7, 10)
    assert block[:, :3].all()
    assert np.array_equal(block[:, 3:], unpack_visibility(t)[0])


# ---------------------------------------------------------------- argument validation

def _args():
    return dict(top_logp=np.zeros((2, 3, 4), np.float32), top_ids=np.zeros((2, 3, 4), np.int64),
                budget=5, root_ids=np.zeros(2, np.int64), seq_lens=np.zeros(2, np.int64))


@pytest.mark.parametrize("change, word", [
    (dict(top_logp=np.zeros((2, 3, 4), np.float64)), "top_logp: expected dtype float32"),
    (dict(top_logp=np.zeros((3, 4), np.float32)), "top_logp: expected 3 dimensions"),
    (dict(top_logp=[[[0.0]]]), "top_logp: expected a numpy array"),
    (dict(top_ids=np.zeros((2, 3, 4), np.int32)), "top_ids: expected dtype int64"),
    (dict(top_ids=np.zeros((2, 3, 5), np.int64)), "top_ids: shape"),
    (dict(root_ids=np.zeros(3, np.int64)), "root_ids: shape"),
    (dict(seq_lens=np.zeros((2, 1), np.int64)), "seq_lens: expected 1 dimensions"),
    (dict(seq_lens=np.array([0, -1], np.int64)), "seq_lens: negative"),
    (dict(budget=0), "budget: 0 is outside [1, 1024]"),
    (dict(budget=1025), "budget: 1025 is outside"),
    (dict(budget=2.0), "budget: expected an integer"),
    (dict(budget=True), "budget: expected an integer"),
])
def test_invalid_arguments_name_the_argument(change, word):
    args = _args()
    args.update(change)
    with pytest.raises(ValueError, match=re.escape(word)):
        build_tree(**args)


@pytest.mark.parametrize("shape, word", [((2, 0, 4), "L \\(dimension 1\\) is zero"),
                                         ((2, 3, 0), "K \\(dimension 2\\) is zero")])
def test_zero_l_or_k_rejected(shape, word):
    args = _args()
    args.update(top_logp=np.zeros(shape, np.float32), top_ids=np.zeros(shape, np.int64))
    with pytest.raises(ValueError, match=word):
        build_tree(**args)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_logprob_rejected(value):
    args = _args()
    args["top_logp"][1, 2, 3] = value
    with pytest.raises(ValueError, match=r"top_logp: non-finite value .* at \[1, 2, 3\]"):
        build_tree(**args)


def test_unsorted_row_rejected():
    args = _args()
    args["top_logp"][1, 0] = [-1.0, -0.5, -2.0, -3.0]
    with pytest.raises(ValueError, match=r"top_logp: row \[1, 0\] is not sorted descending"):
        build_tree(**args)


def test_accept_argument_validation():
    t = _worked_example()
    with pytest.raises(ValueError, match="target_argmax: expected dtype int64"):
        accept_greedy(t, np.zeros((1, 7), np.int32))
    with pytest.raises(ValueError, match="target_argmax: shape"):
        accept_greedy(t, np.zeros((1, 6), np.int64))
    with pytest.raises(ValueError, match="tree: has no attribute 'tokens'"):
        accept_greedy(object(), np.zeros((1, 2), np.int64))
