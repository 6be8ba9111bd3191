"""Native greedy accept on hostile trees, every algorithm (KDT_TREE_ACCEPT walk / parallel) on
every device, against the reference (engine.reference.ddtree.accept_greedy).

Trees are not the builder's: node labels are a random permutation, child lists in random order,
shapes from a star (one list of n - 1 nodes, the longest the pointer jumping meets) to a chain
(a walk of n nodes), with nodes off the root's tree on sibling and child cycles, and garbage links
on the slots at or after num_nodes (which the walk never reads). Those trees are well formed in
the sense of cuda/src/tree_accept_parallel.h, so they also run under "parallel-strict", which
fails where the parallel phases would fall back to the walk: the parallel path itself is checked.
Then one defect at a time is injected (an out-of-range, negative, huge or self link, a second
link into a node, num_nodes outside [1, n]) and the statuses must still be the reference's.
"""

from __future__ import annotations


import numpy as np
import pytest

from engine.reference import ddtree

from native_helpers import (  # noqa: F401 (fixtures)
    DEVICES, FIELDS_ACCEPT, Links, assert_same, native, skip_cuda_without_gpu)

pytestmark = pytest.mark.native
INT64_MAX = np.iinfo(np.int64).max
# n around the warp and block sizes of the parallel kernel; 1025 is above its limit (walk).
SIZES = [1, 2, 3, 31, 32, 33, 64, 255, 256, 1023, 1024, 1025]


def _one_tree(rng, n: int, shape: str, alphabet: int, full: bool):
    """tokens, first_child, next_sibling [n], num_nodes and target_argmax [n] of one request: a
    tree on a random subset of [0, num_nodes) rooted at 0, well formed (see the module doc);
    num_nodes is n when `full`, else random in [1, n]."""
    nn = n if full or rng.integers(0, 2) else int(rng.integers(1, n + 1))
    m = int(rng.integers(1, nn + 1)) if shape == "random" else nn  # nodes of the root's tree
    labels = np.r_[0, 1 + rng.permutation(nn - 1)]  # labels[k]: the k-th node of the tree
    tree_nodes, off = labels[:m], labels[m:]
    parent = np.full(m, -1, np.int64)
    for k in range(1, m):
        parent[k] = {"star": 0, "chain": k - 1}.get(shape, int(rng.integers(0, k)))
    fc = np.full(n, -1, np.int64)
    ns = np.full(n, -1, np.int64)
    kids = {}
    for k in rng.permutation(np.arange(1, m)):  # random sibling order
        kids.setdefault(int(parent[k]), []).append(int(tree_nodes[k]))
    for p, cs in kids.items():
        fc[tree_nodes[p]] = cs[0]
        for a, b in zip(cs, cs[1:]):
            ns[a] = b
    # Off the root's tree: sibling cycles, child cycles and detached lists (in-degree <= 1).
    rest = [int(x) for x in rng.permutation(off)]
    while len(rest) >= 2:
        k = int(rng.integers(2, min(len(rest), 40) + 1))
        grp, rest = rest[:k], rest[k:]
        kind = rng.integers(0, 3)
        for a, b in zip(grp, grp[1:] + ([grp[0]] if kind < 2 else [])):
            (ns if kind != 1 else fc)[a] = b
    # Slots at or after num_nodes: anything (the walk never reads them).
    junk = np.array([-1, 0, 1, n - 1, n, n + 7, -2, INT64_MAX, -INT64_MAX], np.int64)
    fc[nn:] = rng.choice(junk, size=n - nn)
    ns[nn:] = rng.choice(junk, size=n - nn)
    tokens = rng.integers(0, alphabet, size=n).astype(np.int64)
    # Targets: mostly a random child's token (deep walks), else a random token.
    tgt = rng.integers(0, alphabet, size=n).astype(np.int64)
    for p, cs in kids.items():
        if rng.random() < 0.9:
            tgt[tree_nodes[p]] = tokens[cs[int(rng.integers(0, len(cs)))]]
    return tokens, fc, ns, nn, tgt


def _trees(rng, n: int, bs: int):
    """bs requests of _one_tree; num_nodes absent (every request n) one time in four."""
    given = bool(rng.integers(0, 4))
    rows = [_one_tree(rng, n, str(rng.choice(["random", "star", "chain"])),
                      int(rng.choice([2, 3, 1 << 20])), not given) for _ in range(bs)]
    tokens, fc, ns, nn, tgt = (np.array(x) for x in zip(*rows))
    return Links(tokens, fc, ns, nn.astype(np.int32) if given else None), tgt


def _check(tree, tgt, device, ctx):
    ref = ddtree.accept_greedy(tree, tgt)
    got = native().accept_greedy(tree, tgt, device=device)
    assert_same(got, ref, FIELDS_ACCEPT, ctx)
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["walk", "parallel-strict"])
@pytest.mark.parametrize("n", SIZES)
def test_accept_well_formed_hostile_trees(device, algo, n, rng, monkeypatch):
    monkeypatch.setenv("KDT_TREE_ACCEPT", algo)
    seen = set()
    for trial in range(12 if n < 256 else 3):
        tree, tgt = _trees(rng, n, int(rng.integers(1, 6)))
        seen.update(_check(tree, tgt, device, f"trial={trial} n={n} {algo} {device}").status.tolist())
    assert seen <= {0, 3}, f"well-formed trees gave statuses {sorted(seen)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["walk", "parallel-strict"])
def test_accept_chain_walks_every_node(device, algo, rng, monkeypatch):
    # A chain of 1024 (the parallel kernel's largest n) whose targets all match: accept_len n,
    # every node in chain order.
    monkeypatch.setenv("KDT_TREE_ACCEPT", algo)
    n = 1024
    labels = np.r_[0, 1 + rng.permutation(n - 1)]
    fc = np.full((1, n), -1, np.int64)
    fc[0, labels[:-1]] = labels[1:]
    tokens = rng.integers(0, 1 << 40, size=(1, n)).astype(np.int64)
    tgt = np.full((1, n), -5, np.int64)
    tgt[0, labels[:-1]] = tokens[0, labels[1:]]
    tree = Links(tokens, fc, np.full((1, n), -1, np.int64), None)
    ref = _check(tree, tgt, device, f"{algo} {device}")  # the native result equals ref
    assert ref.accept_len[0] == n and (ref.accept_index[0] == labels).all(), algo


def _inject(rng, tree, tgt):
    """One defect in one random request, at a node of its accepted path half of the time
    (returns a description)."""
    bs, n = tree.tokens.shape
    b = int(rng.integers(0, bs))
    nn = n if tree.num_nodes is None else int(tree.num_nodes[b])
    nn = nn if 1 <= nn <= n else n  # a num_nodes defect injected before
    path = ddtree.accept_greedy(tree, tgt).accept_index[b]
    path = path[path >= 0]
    i = int(rng.choice(path)) if rng.integers(0, 2) else int(rng.integers(0, nn))
    fc, ns = tree.first_child[b], tree.next_sibling[b]
    kind = str(rng.choice(["link", "second-in", "cross", "self", "num_nodes"]))
    arr = fc if rng.integers(0, 2) else ns
    if kind == "link":
        arr[i] = rng.choice([0, nn, n, n + 5, -2, INT64_MAX, -INT64_MAX])
    elif kind == "second-in" and nn > 1:
        arr[i] = int(rng.integers(1, nn))  # often a node that has an incoming link already
    elif kind == "cross":
        # a first child becomes also a next sibling, or a next sibling also a first child
        heads = fc[:nn][(fc[:nn] >= 1) & (fc[:nn] < nn)]
        later = ns[:nn][(ns[:nn] >= 1) & (ns[:nn] < nn)]
        if heads.size and rng.integers(0, 2):
            ns[i] = rng.choice(heads)
        elif later.size:
            fc[i] = rng.choice(later)
    elif kind == "self":
        arr[i] = i
    else:
        if tree.num_nodes is None:
            tree.num_nodes = np.full(bs, n, np.int32)
        tree.num_nodes[b] = rng.choice([0, -1, n + 1, 2**31 - 1])
    return f"{kind} at b={b} i={i}"


def _inject_cycle(rng, tree, tgt):
    """A sibling cycle the walk must meet: the root's first child c links to itself and does not
    match the root's target, so the scan of the root's children runs until its bound (status 2).
    Random defects meet a cycle only by chance (one seed in many saw none in 120 trials)."""
    bs, n = tree.tokens.shape
    b = int(rng.integers(0, bs))
    if tree.num_nodes is not None and not 2 <= tree.num_nodes[b] <= n:
        tree.num_nodes[b] = n
    nn = n if tree.num_nodes is None else int(tree.num_nodes[b])
    c = int(rng.integers(1, nn))
    tree.first_child[b, 0] = c
    tree.next_sibling[b, c] = c
    tgt[b, 0] = tree.tokens[b, c] + 1
    return f"sibling cycle at b={b} c={c}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["walk", "parallel"])
def test_accept_one_defect_at_a_time(device, algo, rng, monkeypatch):
    monkeypatch.setenv("KDT_TREE_ACCEPT", algo)
    seen = set()
    for trial in range(120):
        n = int(rng.choice(SIZES[:8])) if trial % 10 else int(rng.choice(SIZES[8:]))
        tree, tgt = _trees(rng, n, int(rng.integers(1, 4)))
        for _ in range(int(rng.integers(1, 3))):
            what = _inject(rng, tree, tgt)
        if trial % 40 == 0:  # n >= 256 here
            what = _inject_cycle(rng, tree, tgt)
        seen.update(_check(tree, tgt, device, f"trial={trial} n={n} {what} {algo} {device}")
                    .status.tolist())
    assert seen >= {0, 1, 2, 3}, f"statuses seen {sorted(seen)}: the defects are too weak"
