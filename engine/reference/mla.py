"""Float64 reference of the absorbed-MLA tree-verify attention (DDTREE.md section 6).

Per (query, head): score_j = (q_lat . c_kv[j] + q_pe . k_pe[j]) * softmax_scale over the keys j
the query may see (every committed prefix row, plus the tree rows whose visibility bit is set);
out = softmax-weighted sum of c_kv (d_latent wide; W_UV is applied later), lse = natural-log
log-sum-exp of the scores.

One online-softmax state concept, used by the prefix pass, the tree pass and their merge (the
kernels mirror it): a state over a set of keys is (o, lse) with o the normalised weighted sum and
lse the log-sum-exp. The *empty* state (no visible key: a zero-length prefix, or an all-zero
visibility row) is o = 0, lse = -inf; merging with it returns the other state unchanged. Inputs
must be finite, so a NaN never enters a state (checked); lse = +inf cannot occur.

Sizes are parameters; the Kimi K2 shape is H = 64, d_latent = 512, d_rope = 64.
"""

from __future__ import annotations

import numpy as np


def _f64(name: str, a, ndim: int) -> np.ndarray:
    """A float numpy array, or a torch tensor (e.g. bfloat16), as finite float64 of rank ndim."""
    if type(a).__module__.startswith("torch"):
        import torch

        a = a.detach().to("cpu", torch.float64).numpy()
    if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
        raise ValueError(f"{name}: expected a float numpy array or torch tensor, got "
                         f"{getattr(a, 'dtype', type(a).__name__)}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        raise ValueError(f"{name}: non-finite value {a[idx]} at {list(idx)}")
    return a


def attention_state(q_lat, q_pe, ckv, kpe, softmax_scale, mask=None):
    """The state of queries over one set of keys, all float64.

    q_lat [n, H, Dl], q_pe [n, H, Dr]; ckv [m, Dl], kpe [m, Dr]; mask [n, m] bool or None (all
    visible). Returns o [n, H, Dl], lse [n, H]; rows with no visible key get the empty state.
    """
    n, H, Dl = q_lat.shape
    scores = (np.einsum("nhd,md->nhm", q_lat, ckv) + np.einsum("nhd,md->nhm", q_pe, kpe))
    scores = scores * float(softmax_scale)  # [n, H, m]
    if mask is not None:
        scores = np.where(mask[:, None, :], scores, -np.inf)
    o = np.zeros((n, H, Dl))
    lse = np.full((n, H), -np.inf)
    if scores.shape[2] == 0:
        return o, lse  # zero keys: the empty state everywhere
    top = scores.max(axis=2)  # [n, H]; -inf exactly where a row sees no key
    seen = np.isfinite(top)
    # Subtracting the row max keeps exp() in range; empty rows are skipped (-inf - -inf = NaN).
    shift = np.where(seen, top, 0.0)
    p = np.exp(scores - shift[:, :, None])  # masked entries: exp(-inf) = 0
    denom = p.sum(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(seen[:, :, None], (p @ ckv) / denom[:, :, None], 0.0)
        lse = np.where(seen, shift + np.log(denom), -np.inf)
    return o, lse


def merge_states(o1, lse1, o2, lse2):
    """Exact merge of two states over disjoint key sets: o [..., D], lse [...] (float64).

    lse = log(e^lse1 + e^lse2); o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), computed
    relative to max(lse1, lse2). Both empty -> empty (o = 0, lse = -inf); one empty -> the other.
    """
    o1, o2 = np.asarray(o1, np.float64), np.asarray(o2, np.float64)
    lse1, lse2 = np.asarray(lse1, np.float64), np.asarray(lse2, np.float64)
    top = np.maximum(lse1, lse2)
    both_empty = np.isneginf(top)
    top = np.where(both_empty, 0.0, top)  # avoids -inf - -inf = NaN; weights are then 0
    w1, w2 = np.exp(lse1 - top), np.exp(lse2 - top)
    total = w1 + w2
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(both_empty[..., None], 0.0,
                     (w1[..., None] * o1 + w2[..., None] * o2) / total[..., None])
        lse = np.where(both_empty, -np.inf, top + np.log(total))
    return o, lse


def unpack_rows(visibility: np.ndarray, n: int) -> np.ndarray:
    """uint32 [rows, W] -> bool [rows, n]: bit j % 32 of word j // 32."""
    j = np.arange(n)
    return ((visibility[:, j // 32] >> (j % 32).astype(np.uint32)) & 1).astype(bool)


def _check_visibility(visibility, rows: int, n: int) -> np.ndarray:
    if not isinstance(visibility, np.ndarray) or visibility.dtype != np.uint32:
        raise ValueError(f"visibility: expected a uint32 numpy array, got "
                         f"{getattr(visibility, 'dtype', type(visibility).__name__)}")
    if visibility.ndim != 2 or visibility.shape[0] != rows or visibility.shape[1] * 32 < n:
        raise ValueError(f"visibility: shape {visibility.shape}, expected [{rows}, W] with "
                         f"W >= ceil({n} / 32)")
    return visibility


def tree_verify_attention(q_lat, q_pe, prefix_ckv, prefix_kpe, tree_ckv, tree_kpe,
                          visibility, softmax_scale):
    """One request: n tree queries over P prefix rows (unmasked) and n tree rows (masked).

    q_lat [n, H, Dl], q_pe [n, H, Dr], prefix_ckv [P, Dl], prefix_kpe [P, Dr] (P may be 0),
    tree_ckv [n, Dl], tree_kpe [n, Dr], visibility uint32 [n, W], softmax_scale a float.
    Returns out [n, H, Dl], lse [n, H] (float64). Computed as the production kernel splits it:
    a prefix state and a tree state, merged by their log-sum-exps.
    """
    q_lat, q_pe = _f64("q_lat", q_lat, 3), _f64("q_pe", q_pe, 3)
    n, H, Dl = q_lat.shape
    Dr = q_pe.shape[2]
    if q_pe.shape[:2] != (n, H):
        raise ValueError(f"q_pe: shape {q_pe.shape} does not match q_lat {q_lat.shape}")
    shapes = {"prefix_ckv": Dl, "prefix_kpe": Dr, "tree_ckv": Dl, "tree_kpe": Dr}
    arrs = {}
    for name, a in zip(shapes, (prefix_ckv, prefix_kpe, tree_ckv, tree_kpe)):
        arrs[name] = _f64(name, a, 2)
        if arrs[name].shape[1] != shapes[name]:
            raise ValueError(f"{name}: width {arrs[name].shape[1]}, expected {shapes[name]}")
    if arrs["prefix_ckv"].shape[0] != arrs["prefix_kpe"].shape[0]:
        raise ValueError(f"prefix_kpe: {arrs['prefix_kpe'].shape[0]} rows, prefix_ckv has "
                         f"{arrs['prefix_ckv'].shape[0]}")
    for name in ("tree_ckv", "tree_kpe"):
        if arrs[name].shape[0] != n:
            raise ValueError(f"{name}: {arrs[name].shape[0]} rows, expected n = {n}")
    mask = unpack_rows(_check_visibility(visibility, n, n), n)
    pre = attention_state(q_lat, q_pe, arrs["prefix_ckv"], arrs["prefix_kpe"], softmax_scale)
    tree = attention_state(q_lat, q_pe, arrs["tree_ckv"], arrs["tree_kpe"], softmax_scale,
                           mask)
    return merge_states(*pre, *tree)


def verify_attention_ragged(q_lat, q_pe, kv_cache, q_indptr, kv_indptr, visibility,
                            softmax_scale):
    """The kernel's ragged layout (kdtree.h, kdt_verify_attention), float64.

    q_lat [total_q, H, Dl], q_pe [total_q, H, Dr], kv_cache [total_kv, Dl + Dr] (c_kv then
    k_pe per row), q_indptr / kv_indptr int [bs + 1], visibility uint32 [total_q, W].
    Request b: queries q_indptr[b]..q_indptr[b+1] (n_b nodes); cache rows kv_indptr[b]..
    kv_indptr[b+1], the last n_b of which are its tree rows, the rest its prefix.
    Returns out [total_q, H, Dl], lse [total_q, H].
    """
    q_lat, q_pe = _f64("q_lat", q_lat, 3), _f64("q_pe", q_pe, 3)
    kv = _f64("kv_cache", kv_cache, 2)
    total_q, H, Dl = q_lat.shape
    if q_pe.shape[:2] != (total_q, H):
        raise ValueError(f"q_pe: shape {q_pe.shape} does not match q_lat {q_lat.shape}")
    Dr = q_pe.shape[2]
    if kv.shape[1] != Dl + Dr:
        raise ValueError(f"kv_cache: width {kv.shape[1]}, expected d_latent + d_rope = "
                         f"{Dl + Dr}")
    qi = np.asarray(q_indptr).astype(np.int64)
    ki = np.asarray(kv_indptr).astype(np.int64)
    if qi.ndim != 1 or ki.shape != qi.shape or len(qi) < 1:
        raise ValueError(f"q_indptr / kv_indptr: shapes {qi.shape} / {ki.shape}, expected "
                         "[bs + 1] each")
    for name, ptr, total in (("q_indptr", qi, total_q), ("kv_indptr", ki, kv.shape[0])):
        if ptr[0] != 0 or ptr[-1] != total or (np.diff(ptr) < 0).any():
            raise ValueError(f"{name}: {ptr.tolist()} must rise from 0 to {total}")
    n_b, kv_b = np.diff(qi), np.diff(ki)
    if (kv_b < n_b).any():
        b = int(np.argmax(kv_b < n_b))
        raise ValueError(f"kv_indptr: request {b} has {kv_b[b]} cache rows for {n_b[b]} "
                         "tree nodes")
    max_n = int(n_b.max()) if len(n_b) else 0
    vis = _check_visibility(visibility, total_q, max_n)
    out = np.zeros((total_q, H, Dl))
    lse = np.full((total_q, H), -np.inf)
    for b in range(len(n_b)):
        q0, q1, k1 = int(qi[b]), int(qi[b + 1]), int(ki[b + 1])
        n, t0 = q1 - q0, k1 - (q1 - q0)  # t0: first tree row in the cache
        rows = kv[int(ki[b]):k1]
        pre, tree = rows[: t0 - int(ki[b])], rows[t0 - int(ki[b]):]
        out[q0:q1], lse[q0:q1] = tree_verify_attention(
            q_lat[q0:q1], q_pe[q0:q1], pre[:, :Dl], pre[:, Dl:], tree[:, :Dl], tree[:, Dl:],
            vis[q0:q1], softmax_scale)
    return out, lse
