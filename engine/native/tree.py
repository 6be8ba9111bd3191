"""Native tree build and greedy accept: the reference's signatures plus `device`.

`build_tree(top_logp, top_ids, budget, root_ids, seq_lens, device="cpu")` and
`accept_greedy(tree, target_argmax, device="cpu")` return `engine.reference.ddtree.Tree` / `Accept`
with the same arrays as the reference (DDTREE.md sections 3-4), bit for bit. numpy inputs give
numpy outputs (device="cuda" copies through the library's device helpers); torch tensors give
torch tensors on the inputs' device.

Differences from the reference, on purpose:
- Value checks (finite, rows sorted descending, 0 <= seq_lens <= INT64_MAX - L so that every
  position seq_len + depth fits int64) run for numpy and torch CPU inputs only: on CUDA tensors
  they would synchronise the host. The kernels never hang or read out of bounds on bad values,
  but the tree is unspecified.
- A malformed tree given to accept_greedy (links out of range, cycles, duplicate sibling tokens,
  num_nodes outside [1, n]) is a status per request, as in the reference and the C ABI, never
  an exception. Arguments that are not numpy arrays or torch tensors (lists, tuples, other
  array-likes) are a TypeError naming the argument; wrong shapes or dtypes a ValueError.
- K > budget is accepted like in the reference: ranks >= budget can never be selected (rank r
  needs its r lower siblings first), so the first `budget` columns are passed to the kernel.
"""

from __future__ import annotations

import numpy as np

from engine.reference.ddtree import MAX_BUDGET, Accept, Tree

from ._lib import Call, _is_torch, library


INT64_MAX = np.iinfo(np.int64).max


def _shape(x) -> tuple:
    return tuple(x.shape)


def _require_array(fn: str, name: str, x) -> None:
    """numpy arrays and torch tensors only: an array-like would be converted silently (and a
    list has no shape to check), so it is refused by name."""
    if not (isinstance(x, np.ndarray) or _is_torch(x)):
        raise TypeError(f"{fn}: {name}: expected a numpy array or a torch tensor, got {type(x).__name__}")


def _check_values_build(top_logp, seq_lens) -> None:
    lp = top_logp.numpy() if _is_torch(top_logp) else top_logp
    sl = seq_lens.numpy() if _is_torch(seq_lens) else seq_lens
    bad = np.argwhere(~np.isfinite(lp))
    if len(bad):
        b, d, r = (int(v) for v in bad[0])
        raise ValueError(f"build_tree: top_logp: non-finite value {lp[b, d, r]} at [{b}, {d}, {r}]")
    rising = np.argwhere(np.diff(lp, axis=2) > 0)
    if len(rising):
        b, d, r = (int(v) for v in rising[0])
        raise ValueError(f"build_tree: top_logp: row [{b}, {d}] is not sorted descending "
                         f"(ranks {r}, {r + 1}: {lp[b, d, r]} < {lp[b, d, r + 1]})")
    neg = np.argwhere(sl < 0)
    if len(neg):
        b = int(neg[0][0])
        raise ValueError(f"build_tree: seq_lens: negative length {sl[b]} at [{b}]")
    L = lp.shape[1]
    big = np.argwhere(sl > INT64_MAX - L)
    if len(big):
        b = int(big[0][0])
        raise ValueError(f"build_tree: seq_lens: {sl[b]} at [{b}] would overflow int64 positions "
                         f"(seq_len + depth, depth <= {L}; at most {INT64_MAX - L})")


def _on_host(x) -> bool:
    return not _is_torch(x) or x.device.type == "cpu"


def build_tree(top_logp, top_ids, budget, root_ids, seq_lens, device: str = "cpu") -> Tree:
    """Best-first DDTree build for every request (see engine.reference.ddtree.build_tree).

    top_logp float32 [bs, L, K], top_ids int64 [bs, L, K], root_ids int64 [bs], seq_lens int64
    [bs]; 1 <= budget <= 1024, 1 <= L <= 32. Raises ValueError / TypeError naming the argument,
    NativeError when the library refuses the call.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"build_tree: budget: expected an integer, got {type(budget).__name__}")
    budget = int(budget)
    for name, x in (("top_logp", top_logp), ("top_ids", top_ids), ("root_ids", root_ids), ("seq_lens", seq_lens)):
        _require_array("build_tree", name, x)
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"build_tree: budget: {budget} is outside [1, {MAX_BUDGET}]")
    if len(_shape(top_logp)) != 3:
        raise ValueError(f"build_tree: top_logp: expected [bs, L, K], got shape {_shape(top_logp)}")
    bs, L, K = _shape(top_logp)
    if _shape(top_ids) != (bs, L, K):
        raise ValueError(f"build_tree: top_ids: shape {_shape(top_ids)} != top_logp shape "
                         f"{(bs, L, K)}")
    if K > budget:  # ranks >= budget are never selected; the kernel requires K <= budget
        top_logp, top_ids, K = top_logp[:, :, :budget], top_ids[:, :, :budget], budget
        if _is_torch(top_logp):
            top_logp, top_ids = top_logp.contiguous(), top_ids.contiguous()
        else:
            top_logp, top_ids = np.ascontiguousarray(top_logp), np.ascontiguousarray(top_ids)
    if _shape(seq_lens) != (bs,):
        raise ValueError(f"build_tree: seq_lens: shape {_shape(seq_lens)}, expected {(bs,)}")
    if _on_host(top_logp) and _on_host(seq_lens) and bs > 0 and L > 0 and K > 0:
        _check_values_build(top_logp, seq_lens)

    lib = library()
    c = Call(lib, "kdt_tree_build", device)
    n = budget + 1
    W = (n + 31) // 32
    ins = [
        c.input("top_logp", top_logp, np.float32, (bs, L, K)),
        c.input("top_ids", top_ids, np.int64, (bs, L, K)),
        c.input("root_ids", root_ids, np.int64, (bs,)),
        c.input("seq_lens", seq_lens, np.int64, (bs,)),
    ]
    outs = [
        c.output("tokens", np.int64, (bs, n)),
        c.output("parents", np.int32, (bs, n)),
        c.output("depths", np.int32, (bs, n)),
        c.output("positions", np.int64, (bs, n)),
        c.output("first_child", np.int64, (bs, n)),
        c.output("next_sibling", np.int64, (bs, n)),
        c.output("visibility", np.uint32, (bs, n, W)),
        c.output("num_nodes", np.int32, (bs,)),
        c.output("scores", np.float64, (bs, n)),
    ]
    r = c.run(c.backend, c.stream, bs, L, K, budget, *ins, *outs)
    return Tree(**r)


def accept_greedy(tree, target_argmax, device: str = "cpu") -> Accept:
    """Bounded greedy accept walk for every request (see engine.reference.ddtree.accept_greedy).

    tree: an object with `tokens`, `first_child`, `next_sibling` int64 [bs, n] and optionally
    `num_nodes` int32 [bs]; target_argmax int64 [bs, n]. Malformed trees give a nonzero
    status per request, never an exception or a hang.
    """
    for name in ("tokens", "first_child", "next_sibling"):
        _require_array("accept_greedy", f"tree.{name}", getattr(tree, name, None))
    num_nodes = getattr(tree, "num_nodes", None)
    if num_nodes is not None:
        _require_array("accept_greedy", "tree.num_nodes", num_nodes)
    _require_array("accept_greedy", "target_argmax", target_argmax)
    tokens = tree.tokens
    if len(_shape(tokens)) != 2 or _shape(tokens)[1] < 1:
        raise ValueError("accept_greedy: tree.tokens: expected shape [bs, n] with n >= 1, got "
                         f"{_shape(tokens)}")
    bs, n = _shape(tokens)
    # num_nodes outside [1, n] is a malformed tree: the kernel reports it as status 1 per request.

    lib = library()
    c = Call(lib, "kdt_tree_accept", device)
    ins = [
        c.input("tree.tokens", tokens, np.int64, (bs, n)),
        c.input("tree.first_child", tree.first_child, np.int64, (bs, n)),
        c.input("tree.next_sibling", tree.next_sibling, np.int64, (bs, n)),
        None if num_nodes is None else c.input("tree.num_nodes", num_nodes, np.int32, (bs,)),
        c.input("target_argmax", target_argmax, np.int64, (bs, n)),
    ]
    outs = [
        c.output("accept_index", np.int32, (bs, n)),
        c.output("accept_len", np.int32, (bs,)),
        c.output("bonus", np.int64, (bs,)),
        c.output("status", np.int32, (bs,)),
    ]
    r = c.run(c.backend, c.stream, bs, n, *ins, *outs)
    return Accept(**r)
