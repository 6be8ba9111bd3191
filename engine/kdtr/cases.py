"""The golden KDTR cases: inputs for tree_build, tree_accept and verify_attention, with the
expected outputs of the float64 reference (engine.reference.ddtree, engine.reference.mla).

`generate(out_dir, quick, seed)` writes out_dir/<kernel>/<case>.kdtr and out_dir/index.json.
Inputs are fresh random on every generation unless a seed is given; the seed is recorded in
every bundle's metadata and in index.json, so any bundle can be regenerated bit for bit.
Every case name says what it covers (exact ties, L = 1, K = 1, budget 1, a budget over the
candidate space, bs 17, B = 1024 with K = B, all-accept / all-reject targets, malformed trees).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from engine.kdtr import bundle as kdtr
from engine.reference import ddtree, mla


# ---------------------------------------------------------------- input makers


def bf16_round(x) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def drafter_topk(rng, bs: int, L: int, K: int, vocab: int = 4096, temp: float = 3.0):
    """Realistic top-K rows: bf16 logits over a vocab (so equal log-probs are common), float32
    log-softmax, sorted descending with ties by token id. Returns top_logp [bs,L,K] float32,
    top_ids [bs,L,K] int64."""
    vocab = max(vocab, K)
    logits = bf16_round(rng.standard_normal((bs, L, vocab)) * temp)
    m = logits.max(axis=2, keepdims=True)
    lse = (m + np.log(np.exp(logits - m, dtype=np.float32).sum(axis=2, keepdims=True)))
    logp = (logits - lse).astype(np.float32)
    order = np.argsort(-logp, axis=2, kind="stable")[:, :, :K]
    return np.take_along_axis(logp, order, axis=2), order.astype(np.int64)


def tied_topk(rng, bs: int, L: int, K: int, pool_size: int = 3):
    """Log-probs drawn from a pool of pool_size values (exact ties everywhere), random ids."""
    pool = -rng.choice(np.arange(1, 64), pool_size, replace=False).astype(np.float32) / 8
    lp = -np.sort(-rng.choice(pool, (bs, L, K)), axis=2).astype(np.float32)
    ids = np.stack([np.stack([rng.permutation(10 * K)[:K] for _ in range(L)])
                    for _ in range(bs)])
    return lp, ids.astype(np.int64)


def worked_example():
    probs = np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])
    ids = np.array([[11, 12, 13], [21, 22, 23], [31, 32, 33]], np.int64)
    return np.log(probs).astype(np.float32)[None], ids[None]


# ---------------------------------------------------------------- tree_build


def _build_case(rng, name, lp, ids, budget):
    bs = lp.shape[0]
    roots = rng.integers(0, 100000, bs).astype(np.int64)
    seq = rng.integers(0, 5000, bs).astype(np.int64)
    tree = ddtree.build_tree(lp, ids, budget, roots, seq)
    tensors = {"top_logp": lp, "top_ids": ids, "root_ids": roots, "seq_lens": seq,
               "budget": np.array([budget], np.int64)}
    for field in ("tokens", "parents", "depths", "positions", "first_child", "next_sibling",
                  "visibility", "num_nodes", "scores"):
        tensors["expected." + field] = getattr(tree, field)
    params = {"name": name, "bs": bs, "L": lp.shape[1], "K": lp.shape[2], "budget": budget}
    return ("tree_build", name, params, tensors), tree


def tree_build_cases(rng, quick: bool):
    """Yields ((kernel, name, params, tensors), tree) for each tree_build case."""
    lp, ids = worked_example()
    yield _build_case(rng, "worked_example", lp, ids, 6)
    yield _build_case(rng, "small", *drafter_topk(rng, 1, 4, 4, vocab=16), 10)
    yield _build_case(rng, "exact_ties_bs17", *tied_topk(rng, 17, 6, 8), 40)
    yield _build_case(rng, "all_equal_ties", np.zeros((2, 4, 3), np.float32),
                      rng.integers(0, 50, (2, 4, 3)).astype(np.int64), 30)
    yield _build_case(rng, "l1", *drafter_topk(rng, 3, 1, 8), 8)
    yield _build_case(rng, "k1", *drafter_topk(rng, 2, 15, 1), 15)
    yield _build_case(rng, "budget1", *drafter_topk(rng, 2, 15, 1), 1)
    yield _build_case(rng, "budget_over_space", *drafter_topk(rng, 3, 2, 3), 20)
    yield _build_case(rng, "bs17_b16", *drafter_topk(rng, 17, 15, 16), 16)
    yield _build_case(rng, "bf16_b64", *drafter_topk(rng, 4, 15, 64, temp=6.0), 64)
    yield _build_case(rng, "bs12_b37", *drafter_topk(rng, 12, 15, 37), 37)
    if not quick:
        yield _build_case(rng, "b255", *drafter_topk(rng, 4, 15, 255), 255)
        yield _build_case(rng, "b1024", *drafter_topk(rng, 2, 15, 1024, vocab=8192), 1024)
        yield _build_case(rng, "b1024_ties", *tied_topk(rng, 2, 15, 1024, pool_size=4), 1024)
        yield _build_case(rng, "bs17_b512", *drafter_topk(rng, 17, 15, 512), 512)


# ---------------------------------------------------------------- tree_accept


def follow_targets(rng, tree, follow: float, junk: int = -7):
    """target_argmax [bs, n]: at each node, with probability `follow` the token of a random
    child, else `junk` (a token no node carries)."""
    bs, n = tree.tokens.shape
    target = np.full((bs, n), junk, np.int64)
    for b in range(bs):
        for i in range(int(tree.num_nodes[b])):
            kids = np.flatnonzero(tree.parents[b] == i)
            if len(kids) and rng.random() < follow:
                target[b, i] = tree.tokens[b, rng.choice(kids)]
    return target


def deepest_path_targets(tree, junk: int = -7):
    """target_argmax that accepts the path to the deepest (then lowest-index) node: all-accept
    for a chain."""
    bs, n = tree.tokens.shape
    target = np.full((bs, n), junk, np.int64)
    for b in range(bs):
        i = int(np.argmax(tree.depths[b]))
        while i > 0:
            p = int(tree.parents[b, i])
            target[b, p] = tree.tokens[b, i]
            i = p
    return target


def _accept_case(name, tree, target, **params):
    acc = ddtree.accept_greedy(tree, target)
    tensors = {"tokens": np.asarray(tree.tokens, np.int64),
               "first_child": np.asarray(tree.first_child, np.int64),
               "next_sibling": np.asarray(tree.next_sibling, np.int64),
               "num_nodes": np.asarray(tree.num_nodes, np.int32), "target_argmax": target,
               "expected.accept_index": acc.accept_index, "expected.accept_len": acc.accept_len,
               "expected.bonus": acc.bonus, "expected.status": acc.status}
    bs, n = target.shape
    return "tree_accept", name, {"name": name, "bs": bs, "n": n, **params}, tensors


class _Links:
    """A tree given by raw arrays (for malformed cases)."""

    def __init__(self, tokens, first_child, next_sibling, num_nodes):
        self.tokens, self.first_child = tokens, first_child
        self.next_sibling, self.num_nodes = next_sibling, num_nodes


def malformed_trees(rng, bs: int = 17):
    """One defect per request, built from the worked-example tree (n = 7): each kind of
    status, the first-defect-wins orders, and random junk links."""
    lp, ids = worked_example()
    base = ddtree.build_tree(np.repeat(lp, bs, 0), np.repeat(ids, bs, 0), 6,
                             np.full(bs, 7, np.int64), np.zeros(bs, np.int64))
    tok, fc, ns = base.tokens.copy(), base.first_child.copy(), base.next_sibling.copy()
    nn = base.num_nodes.copy()
    target = np.full(tok.shape, -7, np.int64)
    target[:, [0, 1, 5]] = [11, 22, 31]  # the valid walk: 0 -> 1 -> 5 -> 6
    ns[0, 1] = 3                 # root's list 3 -> 1 -> 3 -> ...: a sibling cycle
    fc[1, 6] = 1                 # 6's first child is 1 (target 11 at 6): the walk cycles
    target[1, 6] = 11
    fc[2, 1] = 9                 # out of range (>= n)
    ns[3, 5] = -2                # a negative link other than -1
    nn[4] = 6                    # node 6 now lies beyond num_nodes
    fc[5, 0] = 0                 # a link to the root
    tok[6, 2] = 22               # 2 and 5 both carry 22 under node 1: duplicate
    tok[7, 3] = 11               # duplicate at the root (3 -> 1)
    tok[8, 3] = 11               # 3 matches, then its next link 9 is out of range before
    ns[8, 3] = 9                 # the duplicate 1 is met: status 1 (first defect wins)
    ns[9, 2] = 2                 # 2 loops on itself while scanning 1's list 5 -> 2 -> 2
    tok[10, 2] = 99              # a duplicate of a token that is not wanted: no defect
    tok[10, 5] = 99
    for b in range(11, bs):      # random links and tokens
        fc[b] = rng.integers(-2, 9, 7)
        ns[b] = rng.integers(-2, 9, 7)
        tok[b] = rng.choice([11, 21, 22, 31], 7)
        target[b] = rng.choice([11, 21, 22, 31], 7)
        nn[b] = rng.integers(1, 8)
    return _Links(tok, fc, ns, nn), target


def tree_accept_cases(rng, trees: dict, quick: bool):
    t = trees["worked_example"]
    tok = np.repeat(t.tokens, 5, 0)
    tree5 = _Links(tok, np.repeat(t.first_child, 5, 0), np.repeat(t.next_sibling, 5, 0),
                   np.repeat(t.num_nodes, 5, 0))
    target = np.full((5, 7), -7, np.int64)
    target[1, 0] = 12                       # root -> 3, then stop
    target[2, [0, 1, 2]] = [11, 21, 31]     # 0 -> 1 -> 2 -> 4
    target[3, [0, 1, 5]] = [11, 22, 31]     # 0 -> 1 -> 5 -> 6
    target[4, [0, 1]] = [11, 23]            # 23 is not in the tree: stop at 1
    yield _accept_case("worked_example", tree5, target)
    for name in ("bs17_b16", "exact_ties_bs17", "bf16_b64", "bs12_b37", "budget_over_space"):
        for follow in (0.5, 0.9):
            tree = trees[name]
            yield _accept_case(f"{name}_follow{int(follow * 100)}", tree,
                               follow_targets(rng, tree, follow), follow=follow)
    for name in ("k1", "bs17_b16", "l1"):
        yield _accept_case(f"{name}_all_accept", trees[name], deepest_path_targets(trees[name]))
        bs, n = trees[name].tokens.shape
        yield _accept_case(f"{name}_all_reject", trees[name], np.full((bs, n), -7, np.int64))
    yield _accept_case("budget1", trees["budget1"], deepest_path_targets(trees["budget1"]))
    yield _accept_case("malformed_bs17", *malformed_trees(rng))
    if not quick:
        for name in ("b1024", "b1024_ties", "bs17_b512"):
            yield _accept_case(f"{name}_deepest", trees[name], deepest_path_targets(trees[name]))
            yield _accept_case(f"{name}_follow90", trees[name],
                               follow_targets(rng, trees[name], 0.9), follow=0.9)


# ---------------------------------------------------------------- verify_attention


def _attention_case(rng, name, prefix_lens, budgets, H, Dl, Dr, bf16):
    """Requests with prefix P_b and a tree built with budget B_b (n_b = B_b + 1 nodes; a
    budget of 0 stands for a root-only tree)."""
    vis_rows, n_list = [], []
    for budget in budgets:
        if budget == 0:  # a root-only tree: one node that sees itself
            n_list.append(1)
            vis_rows.append(np.ones((1, 1), np.uint32))
            continue
        lp, ids = drafter_topk(rng, 1, 15, min(budget, 64), vocab=256)
        tree = ddtree.build_tree(lp, ids, budget, np.zeros(1, np.int64), np.zeros(1, np.int64))
        n_list.append(int(tree.num_nodes[0]))
        vis_rows.append(tree.visibility[0, : n_list[-1]])
    W = max(1, math.ceil(max(n_list) / 32))
    visibility = np.zeros((sum(n_list), W), np.uint32)
    q_indptr = np.concatenate([[0], np.cumsum(n_list)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(np.add(prefix_lens, n_list))]).astype(np.int32)
    for b, rows in enumerate(vis_rows):
        visibility[q_indptr[b]:q_indptr[b + 1], : rows.shape[1]] = rows
    total_q, total_kv = int(q_indptr[-1]), int(kv_indptr[-1])
    q_lat = rng.standard_normal((total_q, H, Dl)).astype(np.float32)
    q_pe = rng.standard_normal((total_q, H, Dr)).astype(np.float32)
    kv = rng.standard_normal((total_kv, Dl + Dr)).astype(np.float32)
    scale = np.array([1.0 / math.sqrt(Dl + Dr)], np.float32)
    tensors = {"q_indptr": q_indptr, "kv_indptr": kv_indptr, "visibility": visibility,
               "softmax_scale": scale}
    if bf16:  # the reference reads the stored, already-rounded values
        for key, a in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_cache", kv)):
            tensors[key] = kdtr.to_bf16(a)
    else:
        tensors.update(q_lat=q_lat, q_pe=q_pe, kv_cache=kv)
    out, lse = mla.verify_attention_ragged(tensors["q_lat"], tensors["q_pe"],
                                           tensors["kv_cache"], q_indptr, kv_indptr,
                                           visibility, float(scale[0]))
    tensors["expected.out"], tensors["expected.lse"] = out, lse
    params = {"name": name, "bs": len(budgets), "num_heads": H, "d_latent": Dl, "d_rope": Dr,
              "dtype": "bf16" if bf16 else "f32", "prefix_lens": list(map(int, prefix_lens)),
              "tree_sizes": n_list, "max_tree": max(n_list), "max_kv": int(np.diff(kv_indptr).max())}
    return "verify_attention", name, params, tensors


def verify_attention_cases(rng, quick: bool):
    for bf16 in (False, True):
        dt = "bf16" if bf16 else "f32"
        yield _attention_case(rng, f"small_{dt}", [5], [6], 2, 16, 8, bf16)
        yield _attention_case(rng, f"empty_prefix_{dt}", [0, 0], [3, 9], 2, 16, 8, bf16)
        # 16 random requests plus one with an empty prefix and a single-node tree.
        yield _attention_case(rng, f"ragged_bs17_h3_{dt}", rng.integers(0, 70, 16).tolist()
                              + [0], rng.integers(1, 40, 16).tolist() + [0], 3, 32, 16, bf16)
        yield _attention_case(rng, f"long_prefix_{dt}", [1000, 37], [15, 16], 4, 64, 16, bf16)
        yield _attention_case(rng, f"kimi_shape_{dt}", [200, 17], [15, 7], 64, 512, 64, bf16)
    if not quick:
        yield _attention_case(rng, "prefix_4096_f32", [4096, 1], [63, 15], 8, 64, 32, False)
        yield _attention_case(rng, "tree_1024_bf16", [50], [1023], 2, 32, 8, True)
        yield _attention_case(rng, "tree_1025_f32", [3], [1024], 2, 32, 8, False)
        yield _attention_case(rng, "kimi_b63_bf16", [512], [63], 64, 512, 64, True)


# ---------------------------------------------------------------- driver


def all_cases(rng, quick: bool):
    trees = {}
    for case, tree in tree_build_cases(rng, quick):
        trees[case[1]] = tree
        yield case
    yield from tree_accept_cases(rng, trees, quick)
    yield from verify_attention_cases(rng, quick)


def generate(out_dir: Path, quick: bool = False, seed: int | None = None) -> dict:
    """Write every case to out_dir/<kernel>/<case>.kdtr and out_dir/index.json."""
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (1 << 63))
    rng = np.random.default_rng(seed)
    out_dir = Path(out_dir)
    index = {"format": kdtr.FORMAT, "version": kdtr.VERSION, "seed": seed, "quick": quick,
             "regenerate": f"python -m engine.kdtr generate --out DIR --seed {seed}"
                           + (" --quick" if quick else ""),
             "cases": []}
    for kernel, name, params, tensors in all_cases(rng, quick):
        rel = f"{kernel}/{name}.kdtr"
        kdtr.save(out_dir / rel, tensors, {"kernel": kernel, "case": params, "seed": str(seed)})
        index["cases"].append({"kernel": kernel, "case": name, "path": rel, "params": params,
                               "bytes": (out_dir / rel).stat().st_size})
    (out_dir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return index
