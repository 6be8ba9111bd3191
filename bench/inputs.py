"""Random benchmark inputs with the structure real decoding gives them (fresh on every run).

- `tree_inputs`: drafter top-K rows as DDTREE.md section 1 describes them: log-probs of bf16
  logits (so exact ties are common, as on real inputs), sorted descending, distinct token ids.
- `accept_target`: a target argmax that follows the tree for a random number of steps.
- `attention_inputs`: one ragged verify-attention batch in the kdt_verify_attention layout
  (DDTREE.md section 6), with random ancestor trees, made directly on the timed device.
"""

from __future__ import annotations

import numpy as np

__all__ = ["round_bf16", "tree_inputs", "accept_target", "random_parents", "pack_visibility",
           "attention_inputs", "KIMI_K2"]

# Kimi K2 attention shape (absorbed MLA): 64 heads, kv_lora_rank 512, rope 64; the softmax
# scale is the head-dim one, 1/sqrt(128 + 64) (YaRN's mscale factor is left out: it only
# rescales scores and does not change the work).
KIMI_K2 = {"heads": 64, "d_latent": 512, "d_rope": 64, "softmax_scale": 1.0 / np.sqrt(192.0)}


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 value (round to nearest even), kept as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def tree_inputs(rng: np.random.Generator, bs: int, L: int, K: int, vocab: int = 163840,
                seq_len: int | None = None) -> dict:
    """top_logp f32 [bs, L, K] (rows sorted descending, ties), top_ids i64 [bs, L, K],
    root_ids i64 [bs], seq_lens i64 [bs] (all `seq_len` when given, else random in [1, 32k))."""
    V = max(2 * K, 256)  # the candidate row: the K best of V bf16 logits
    logits = round_bf16(rng.standard_normal((bs, L, V), dtype=np.float32) * 3.0)
    m = logits.max(axis=2, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=2, keepdims=True))
    logp = np.sort(logits - lse, axis=2)[:, :, ::-1][:, :, :K]
    # bf16 logits minus a shared lse keep the ties of the logits (equal logits, equal log-probs)
    top_logp = np.ascontiguousarray(logp, dtype=np.float32)
    top_ids = np.empty((bs, L, K), np.int64)
    for b in range(bs):
        for d in range(L):
            top_ids[b, d] = rng.choice(vocab, size=K, replace=False)
    return {
        "top_logp": top_logp,
        "top_ids": top_ids,
        "root_ids": rng.integers(0, vocab, bs, dtype=np.int64),
        "seq_lens": (np.full(bs, seq_len, np.int64) if seq_len is not None
                     else rng.integers(1, 32768, bs, dtype=np.int64)),
    }


def accept_target(rng: np.random.Generator, tree, p_follow: float = 0.9,
                  vocab: int = 163840) -> np.ndarray:
    """target_argmax i64 [bs, n]: at each node, with probability p_follow the token of one of
    its children chosen at random (so walks go several levels deep), else a random token."""
    tokens = np.asarray(tree.tokens)
    parents = np.asarray(tree.parents)
    bs, n = tokens.shape
    target = rng.integers(0, vocab, (bs, n), dtype=np.int64)
    follow = rng.random((bs, n)) < p_follow
    for b in range(bs):
        kids = np.flatnonzero(parents[b] >= 0)  # every non-root node, grouped by its parent
        if kids.size == 0:
            continue
        keys = rng.random(kids.size)
        order = kids[np.lexsort((keys, parents[b, kids]))]
        par = parents[b, order]
        last = np.r_[par[1:] != par[:-1], True]  # the max-key child of each parent
        chosen, chosen_par = order[last], par[last]
        use = follow[b, chosen_par]
        target[b, chosen_par[use]] = tokens[b, chosen[use]]
    return target


def random_parents(rng: np.random.Generator, n: int) -> np.ndarray:
    """parents i32 [n] of a random tree in DDTree order: the root is -1, parent[i] < i, with a
    bias to recent nodes so that depths resemble a drafted tree."""
    parents = np.full(n, -1, np.int32)
    for i in range(1, n):
        parents[i] = int(rng.integers(max(0, i - 8), i)) if rng.random() < 0.7 else int(rng.integers(0, i))
    return parents


def pack_visibility(parents: np.ndarray, words: int) -> np.ndarray:
    """uint32 [n, words]: bit j of row i set iff j == i or j is an ancestor of i."""
    n = parents.size
    vis = np.zeros((n, words), np.uint32)
    for i in range(n):
        if parents[i] >= 0:
            vis[i] = vis[parents[i]]
        vis[i, i // 32] |= np.uint32(1 << (i % 32))
    return vis


def attention_inputs(seed: int, bs: int, prefix: int, tree: int, dtype: str, device: str,
                     heads: int = KIMI_K2["heads"], d_latent: int = KIMI_K2["d_latent"],
                     d_rope: int = KIMI_K2["d_rope"]) -> dict:
    """One verify-attention batch: every request has `prefix` committed rows and a `tree`-node
    tree. Tensors (torch, on `device`, `dtype` float32 | bfloat16):
      q_lat [bs*tree, H, Dl], q_pe [bs*tree, H, Dr], kv_cache [bs*(prefix+tree), Dl+Dr],
      q_indptr, kv_indptr i32 [bs+1], visibility u32 [bs*tree, ceil(tree/32)] (as int32 bits).
    Also `visible` (python int): sum over query rows of the keys each one sees (FLOP count).
    """
    import torch

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    total_q, total_kv = bs * tree, bs * (prefix + tree)
    # q and kv ~ N(0, 1): scores ~ N(0, 3) at scale 1/sqrt(192), a softmax that is neither flat
    # nor one-hot.
    q_lat = torch.randn(total_q, heads, d_latent, generator=gen, device=device, dtype=torch.float32).to(tdt)
    q_pe = torch.randn(total_q, heads, d_rope, generator=gen, device=device, dtype=torch.float32).to(tdt)
    kv_cache = torch.empty(total_kv, d_latent + d_rope, device=device, dtype=tdt)
    chunk = 1 << 16  # fill in chunks: no float32 temporary the size of the whole cache
    for s in range(0, total_kv, chunk):
        e = min(total_kv, s + chunk)
        kv_cache[s:e] = torch.randn(e - s, d_latent + d_rope, generator=gen, device=device,
                                    dtype=torch.float32).to(tdt)
    rng = np.random.default_rng(seed)
    words = (tree + 31) // 32
    vis = np.concatenate([pack_visibility(random_parents(rng, tree), words) for _ in range(bs)])
    visible = int(bs * tree * prefix + sum(bin(int(w)).count("1") for w in vis.ravel()))
    q_indptr = torch.arange(0, total_q + 1, tree, dtype=torch.int32)
    kv_indptr = torch.arange(0, total_kv + 1, prefix + tree, dtype=torch.int32)
    return {
        "q_lat": q_lat, "q_pe": q_pe, "kv_cache": kv_cache,
        "q_indptr": q_indptr.to(device), "kv_indptr": kv_indptr.to(device),
        "visibility": torch.from_numpy(vis.view(np.int32)).to(device),
        "visibility_np": vis, "softmax_scale": float(KIMI_K2["softmax_scale"]),
        "visible": visible, "words": words,
    }
