"""DDTree reference: best-first tree build, its outputs, and the bounded greedy accept walk.

This module is the spec in code form for `../shared/DDTREE.md` sections 2-4; the CPU backend
and the CUDA kernels in `cuda/` must reproduce it bit for bit (checked through KDTR bundles).

Conventions (bs requests, n = budget + 1 slots per request, W = ceil(n / 32)):
  top_logp   float32 [bs, L, K]  each row sorted descending, ties allowed, finite
  top_ids    int64   [bs, L, K]
  root_ids   int64   [bs]        slot 0 token (the previous round's bonus)
  seq_lens   int64   [bs]        committed prefix length; positions = seq_lens + depths
Scores are float64 with the exact operation order of DDTREE.md section 2; ties in score fall
to the rank path (lexicographic, a proper prefix first). Python floats are IEEE doubles, so the
heap below computes in float64 by construction.
"""

from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass

import numpy as np

MAX_BUDGET = 1024

# Accept status codes: the same numbers as `kdt_accept_status` in cuda/include/kdtree/kdtree.h.
ACCEPT_OK = 0
ACCEPT_OUT_OF_RANGE = 1  # a followed link outside [1, num_nodes), or num_nodes outside [1, n]
ACCEPT_CYCLE = 2  # a child scan visited more than n links, or the walk more than n nodes
ACCEPT_DUPLICATE = 3  # the scan met the matched token a second time


@dataclass
class Tree:
    """DDTREE.md section 3 arrays. Unused slots: -1 (ints), 0.0 (scores), zero bits."""

    tokens: np.ndarray  # int64 [bs, n]
    parents: np.ndarray  # int32 [bs, n]
    depths: np.ndarray  # int32 [bs, n]
    positions: np.ndarray  # int64 [bs, n]
    first_child: np.ndarray  # int64 [bs, n]
    next_sibling: np.ndarray  # int64 [bs, n]
    visibility: np.ndarray  # uint32 [bs, n, W]
    num_nodes: np.ndarray  # int32 [bs]
    scores: np.ndarray  # float64 [bs, n]


@dataclass
class Accept:
    """DDTREE.md section 4 outputs plus the per-request defect status."""

    accept_index: np.ndarray  # int32 [bs, n]: accepted node indices, root first, then -1
    accept_len: np.ndarray  # int32 [bs]: accepted nodes including the root (>= 1)
    bonus: np.ndarray  # int64 [bs]: target_argmax at the last accepted node
    status: np.ndarray  # int32 [bs]: ACCEPT_* code


# ---------------------------------------------------------------- validation helpers


def _check_array(name: str, a, dtype, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    return a


def _check_int(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name}: expected an integer, got {type(v).__name__}")
    v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name}: {v} is outside [{lo}, {hi}]")
    return v


def _check_build_args(top_logp, top_ids, budget, root_ids, seq_lens) -> int:
    """Validate build_tree's arguments in order (dtype/rank, shape, values); return budget."""
    _check_array("top_logp", top_logp, np.float32, 3)
    _check_array("top_ids", top_ids, np.int64, 3)
    _check_array("root_ids", root_ids, np.int64, 1)
    _check_array("seq_lens", seq_lens, np.int64, 1)
    budget = _check_int("budget", budget, 1, MAX_BUDGET)
    bs, L, K = top_logp.shape
    if L == 0:
        raise ValueError(f"top_logp: L (dimension 1) is zero in shape {top_logp.shape}")
    if K == 0:
        raise ValueError(f"top_logp: K (dimension 2) is zero in shape {top_logp.shape}")
    if top_ids.shape != top_logp.shape:
        raise ValueError(f"top_ids: shape {top_ids.shape} != top_logp shape {top_logp.shape}")
    if root_ids.shape != (bs,):
        raise ValueError(f"root_ids: shape {root_ids.shape} != ({bs},) (bs from top_logp)")
    if seq_lens.shape != (bs,):
        raise ValueError(f"seq_lens: shape {seq_lens.shape} != ({bs},) (bs from top_logp)")
    bad = np.argwhere(~np.isfinite(top_logp))
    if len(bad):
        b, d, r = (int(x) for x in bad[0])
        raise ValueError(f"top_logp: non-finite value {top_logp[b, d, r]} at [{b}, {d}, {r}]")
    rising = np.argwhere(np.diff(top_logp, axis=2) > 0)
    if len(rising):
        b, d, r = (int(x) for x in rising[0])
        raise ValueError(
            f"top_logp: row [{b}, {d}] is not sorted descending "
            f"({top_logp[b, d, r]} < {top_logp[b, d, r + 1]} at ranks {r}, {r + 1})"
        )
    neg = np.argwhere(seq_lens < 0)
    if len(neg):
        b = int(neg[0][0])
        raise ValueError(f"seq_lens: negative length {seq_lens[b]} at [{b}]")
    return budget


# ---------------------------------------------------------------- tree build


def _pop_order(lp: list, ids: list, budget: int):
    """Best-first heap over rank paths for one request (DDTREE.md section 2).

    lp, ids: [L][K] nested lists (lp of Python floats, exact widenings of the float32 inputs).
    Returns a list of (token, depth, parent, score) in node order 1..; len <= budget.
    """
    L, K = len(lp), len(lp[0])
    # Entry: (-score, rank_path, parent, depth, rank, score). rank_path is unique per entry, so
    # the key never reaches the later fields; depth is 1-based, rank 0-based.
    heap = [(-lp[0][0], (0,), 0, 1, 0, lp[0][0])]
    nodes = []
    while heap and len(nodes) < budget:
        _, path, parent, depth, rank, score = heapq.heappop(heap)
        nodes.append((ids[depth - 1][rank], depth, parent, score))
        i = len(nodes)
        if rank + 1 < K:
            # The exact order of DDTREE.md: (score - lp[d-1][r]) + lp[d-1][r+1].
            s = (score - lp[depth - 1][rank]) + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-s, path[:-1] + (rank + 1,), parent, depth, rank + 1, s))
        if depth < L:
            s = score + lp[depth][0]
            heapq.heappush(heap, (-s, path + (0,), i, depth + 1, 0, s))
    return nodes


def build_tree(top_logp, top_ids, budget, root_ids, seq_lens) -> Tree:
    """Build one DDTree per request. See the module docstring for argument shapes.

    Raises ValueError naming the argument on a wrong dtype, rank or shape, L or K of zero, a
    budget outside [1, 1024], a NaN or infinite log-prob, an unsorted row or a negative length.
    K > budget is allowed (ranks >= budget can never be selected); the native ABI requires
    K <= budget.
    """
    budget = _check_build_args(top_logp, top_ids, budget, root_ids, seq_lens)
    bs = top_logp.shape[0]
    n = budget + 1
    W = (n + 31) // 32
    tokens = np.full((bs, n), -1, np.int64)
    parents = np.full((bs, n), -1, np.int32)
    depths = np.full((bs, n), -1, np.int32)
    positions = np.full((bs, n), -1, np.int64)
    first_child = np.full((bs, n), -1, np.int64)
    next_sibling = np.full((bs, n), -1, np.int64)
    visibility = np.zeros((bs, n, W), np.uint32)
    num_nodes = np.zeros(bs, np.int32)
    scores = np.zeros((bs, n), np.float64)
    for b in range(bs):
        # float32 -> float64 widening is exact; tolist() gives Python floats (doubles).
        lp = top_logp[b].astype(np.float64).tolist()
        nodes = _pop_order(lp, top_ids[b].tolist(), budget)
        count = len(nodes) + 1
        tokens[b, 0], depths[b, 0] = root_ids[b], 0
        if nodes:
            tok, dep, par, sc = zip(*nodes)
            tokens[b, 1:count], depths[b, 1:count] = tok, dep
            parents[b, 1:count], scores[b, 1:count] = par, sc
        fc, ns = [-1] * count, [-1] * count
        rows = [1]  # visibility rows as Python ints: bit j set iff j is i or an ancestor of i
        for i, (_, _, parent, _) in enumerate(nodes, start=1):
            # SGLang's prepend: each child list runs in descending node index.
            ns[i], fc[parent] = fc[parent], i
            # Row i = the parent's row (its ancestors) plus bit i.
            rows.append(rows[parent] | (1 << i))
        first_child[b, :count], next_sibling[b, :count] = fc, ns
        for i, row in enumerate(rows):  # pack: bit j % 32 of little-endian word j // 32
            visibility[b, i] = np.frombuffer(row.to_bytes(4 * W, "little"), "<u4")
        num_nodes[b] = count
        positions[b, :count] = seq_lens[b] + depths[b, :count]
    return Tree(tokens, parents, depths, positions, first_child, next_sibling, visibility,
                num_nodes, scores)


# ---------------------------------------------------------------- greedy accept


def _tree_array(tree, name: str, bs_n) -> np.ndarray:
    a = getattr(tree, name, None)
    if a is None:
        raise ValueError(f"tree: has no attribute {name!r}")
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        raise ValueError(f"tree.{name}: expected an integer dtype, got {a.dtype}")
    if bs_n is not None and a.shape != bs_n:
        raise ValueError(f"tree.{name}: shape {a.shape} != {bs_n} (from tree.tokens)")
    return a.astype(np.int64)


def accept_greedy(tree, target_argmax) -> Accept:
    """Bounded greedy accept walk (DDTREE.md section 4) for every request.

    tree: any object with `tokens`, `first_child`, `next_sibling` (integer [bs, n]) and
    optionally `num_nodes` (integer [bs]; n when absent; outside [1, n] it is a defect: status 1,
    only the root accepted).
    target_argmax: int64 [bs, n], the target's greedy token at each node.

    The walk, exactly (the native backends implement the same steps):
      cur = 0; accepted = [0]
      loop:
        want = target_argmax[cur]; match = none; c = first_child[cur]; visited = 0
        while c != -1:                         # scan the whole child list, in list order
          c outside [1, num_nodes)  -> status 1, stop
          visited += 1; visited > n -> status 2, stop
          tokens[c] == want: if match is set -> status 3, stop; else match = c
          c = next_sibling[c]
        no match -> stop (status 0)
        len(accepted) == n -> status 2, stop   # the walk would exceed n nodes
        accepted.append(match); cur = match
    A stop with a defect keeps the nodes accepted before it; bonus = target_argmax[cur].
    Malformed trees never raise; malformed arguments (shapes, dtypes) raise ValueError.
    """
    tokens = _tree_array(tree, "tokens", None)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tree.tokens: expected shape [bs, n] with n >= 1, got {tokens.shape}")
    bs, n = tokens.shape
    first_child = _tree_array(tree, "first_child", (bs, n))
    next_sibling = _tree_array(tree, "next_sibling", (bs, n))
    if getattr(tree, "num_nodes", None) is None:
        num_nodes = np.full(bs, n, np.int64)
    else:
        num_nodes = _tree_array(tree, "num_nodes", (bs,))
    _check_array("target_argmax", target_argmax, np.int64, 2)
    if target_argmax.shape != (bs, n):
        raise ValueError(f"target_argmax: shape {target_argmax.shape} != {(bs, n)} (tree)")

    accept_index = np.full((bs, n), -1, np.int32)
    accept_len = np.zeros(bs, np.int32)
    bonus = np.zeros(bs, np.int64)
    status = np.zeros(bs, np.int32)
    for b in range(bs):
        path, st = _walk(tokens[b].tolist(), first_child[b].tolist(),
                         next_sibling[b].tolist(), int(num_nodes[b]),
                         target_argmax[b].tolist(), n)
        accept_index[b, : len(path)] = path
        accept_len[b] = len(path)
        bonus[b] = target_argmax[b, path[-1]]
        status[b] = st
    return Accept(accept_index, accept_len, bonus, status)


def _walk(tokens, first_child, next_sibling, num_nodes, target, n):
    """One request's walk (see accept_greedy). Returns (accepted node indices, status)."""
    accepted = [0]
    cur = 0
    if not 1 <= num_nodes <= n:
        return accepted, ACCEPT_OUT_OF_RANGE
    while True:
        want = target[cur]
        match = -1
        c = first_child[cur]
        visited = 0
        while c != -1:
            if not 1 <= c < num_nodes:
                return accepted, ACCEPT_OUT_OF_RANGE
            visited += 1
            if visited > n:
                return accepted, ACCEPT_CYCLE
            if tokens[c] == want:
                # Any second match is a duplicate, also a revisit of `match` on a cycle (the
                # native core in cuda/src/tree_accept_core.h counts it the same way).
                if match != -1:
                    return accepted, ACCEPT_DUPLICATE
                match = c
            c = next_sibling[c]
        if match == -1:
            return accepted, ACCEPT_OK
        if len(accepted) == n:
            return accepted, ACCEPT_CYCLE
        accepted.append(match)
        cur = match


# ---------------------------------------------------------------- derived views


def unpack_visibility(tree) -> np.ndarray:
    """Packed uint32 [bs, n, W] -> bool [bs, n, n]: out[b, i, j] is bit j of row i."""
    vis = np.asarray(tree.visibility)
    bs, n = np.asarray(tree.tokens).shape
    j = np.arange(n)
    words = vis[:, :, j // 32]  # [bs, n, n]: the word holding bit j
    return ((words >> (j % 32).astype(np.uint32)) & 1).astype(bool)


def sglang_mask(tree, seq_lens) -> np.ndarray:
    """SGLang's flattened bool custom mask (DDTREE.md section 3), for compatibility checks.

    Per request b: a [n, seq_lens[b] + n] block, rows = query slots, prefix columns True, the
    last n columns the unpacked visibility (unused slots: all-False tree block). The blocks are
    flattened row-major and concatenated in batch order: total sum_b n * (seq_lens[b] + n).
    """
    _check_array("seq_lens", seq_lens, np.int64, 1)
    vis = unpack_visibility(tree)
    bs, n, _ = vis.shape
    if seq_lens.shape != (bs,):
        raise ValueError(f"seq_lens: shape {seq_lens.shape} != ({bs},) (from tree)")
    if (seq_lens < 0).any():
        raise ValueError(f"seq_lens: negative length at [{int(np.argmax(seq_lens < 0))}]")
    blocks = []
    for b in range(bs):
        block = np.ones((n, int(seq_lens[b]) + n), bool)
        block[:, int(seq_lens[b]):] = vis[b]
        blocks.append(block.reshape(-1))
    return np.concatenate(blocks) if blocks else np.zeros(0, bool)
