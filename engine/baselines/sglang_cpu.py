"""SGLang's per-request CPU DDTree build, re-implemented for head-to-head benchmarks.

Written from the description in ../shared/DDTREE.md section 7 (not from SGLang's source). It
keeps the structure and therefore the costs of SGLang's path, per request and per round:
  1. two blocking device-to-host copies of that request's [L, K] top-k rows (`.to("cpu")`),
  2. a Python `heapq` best-first loop of `budget` pops that also writes the two link arrays
     (SGLang's retrieve_next_token / retrieve_next_sibling) through torch CPU scalar indexing,
  3. the O(n^2) visibility loop (row i copies its parent's row, then sets bit i),
  4. per-request host-to-device copies: tokens, positions (fill, copy, add), a ones mask plus its
     tree block, the two link rows,
  5. the final concatenation of the per-request masks.
It produces the same tree as engine.reference.ddtree.build_tree on identical inputs (tests check every
field). Two deliberate differences from SGLang: a tree with fewer nodes than the budget fills the
unused slots with -1 like the reference (SGLang fails on a shape mismatch there), and the
reference's extra fields (parents, depths, scores, packed visibility, num_nodes) are kept on the
host from values the loop computes anyway; packing the visibility happens only when read.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from engine.reference.ddtree import MAX_BUDGET


@dataclass
class SglangTree:
    """The SGLang-side outputs (torch, on `device`) plus the reference's host-side fields."""

    tokens: torch.Tensor  # int64 [bs, n]: SGLang's draft_tokens (slot 0 = root)
    positions: torch.Tensor  # int64 [bs, n]: seq_len + depth
    first_child: torch.Tensor  # int64 [bs, n]: SGLang's retrieve_next_token
    next_sibling: torch.Tensor  # int64 [bs, n]: SGLang's retrieve_next_sibling
    retrieve_index: torch.Tensor  # int64 [bs, n]: arange(bs * n), SGLang's flat row ids
    custom_mask: torch.Tensor  # bool [sum_b n * (seq_len_b + n)]: SGLang's flattened mask
    parents: np.ndarray  # int32 [bs, n]
    depths: np.ndarray  # int32 [bs, n]
    scores: np.ndarray  # float64 [bs, n]
    num_nodes: np.ndarray  # int32 [bs]
    vis_bool: list  # per request: bool [n, n], the visibility the loop built

    @property
    def visibility(self) -> np.ndarray:
        """Packed uint32 [bs, n, ceil(n / 32)] as in engine.reference.ddtree (computed on access)."""
        bs, n = self.parents.shape
        words = np.zeros((bs, n, (n + 31) // 32), np.uint32)
        for b, vis in enumerate(self.vis_bool):
            for j in range(n):
                words[b, :, j // 32] |= vis[:, j].astype(np.uint32) << np.uint32(j % 32)
        return words


def _as_tensor(name: str, a, dtype: torch.dtype, ndim: int, device: str) -> torch.Tensor:
    """numpy or torch input -> torch tensor of `dtype` on `device` (numpy inputs are uploaded:
    in SGLang the drafter's top-k already lives on the device)."""
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(np.ascontiguousarray(a))
    if not isinstance(a, torch.Tensor):
        raise ValueError(f"{name}: expected a numpy array or torch tensor, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {a.dtype}")
    if a.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(a.shape)}")
    return a.to(device)


def build_tree(top_logp, top_ids, budget, root_ids, seq_lens, device="cpu") -> SglangTree:
    """SGLang-style batched build. Arguments as engine.reference.ddtree.build_tree (numpy arrays, or torch
    tensors already on `device`); device "cpu" or "cuda"."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r}, expected 'cpu' or 'cuda'")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"budget: expected an integer, got {type(budget).__name__}")
    if not 1 <= int(budget) <= MAX_BUDGET:
        raise ValueError(f"budget: {budget} is outside [1, {MAX_BUDGET}]")
    budget = int(budget)
    top_logp = _as_tensor("top_logp", top_logp, torch.float32, 3, device)
    top_ids = _as_tensor("top_ids", top_ids, torch.int64, 3, device)
    root_ids = _as_tensor("root_ids", root_ids, torch.int64, 1, device)
    seq_lens = _as_tensor("seq_lens", seq_lens, torch.int64, 1, device)
    bs, L, K = top_logp.shape
    if L == 0 or K == 0:
        raise ValueError(f"top_logp: L and K must be >= 1, got shape {tuple(top_logp.shape)}")
    if top_ids.shape != top_logp.shape or root_ids.shape != (bs,) or seq_lens.shape != (bs,):
        raise ValueError(f"top_ids / root_ids / seq_lens: shapes {tuple(top_ids.shape)} / "
                         f"{tuple(root_ids.shape)} / {tuple(seq_lens.shape)} do not match "
                         f"top_logp {tuple(top_logp.shape)}")
    n = budget + 1
    # SGLang keeps a host mirror of seq_lens; one copy stands for it here.
    seq_lens_cpu = seq_lens.cpu().tolist()
    draft_tokens = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    draft_tokens[:, 0] = root_ids
    positions = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    retrieve_index = torch.arange(bs * n, dtype=torch.int64, device=device).view(bs, n)
    retrieve_next_token = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    retrieve_next_sibling = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    parents = np.full((bs, n), -1, np.int32)
    depths = np.full((bs, n), -1, np.int32)
    scores = np.zeros((bs, n), np.float64)
    num_nodes = np.zeros(bs, np.int32)
    masks, vis_all = [], []
    for b in range(bs):
        # 1. Two blocking device-to-host copies of this request's rows.
        lp = top_logp[b].to("cpu").numpy()
        ids = top_ids[b].to("cpu").numpy()
        # 2. The heap loop, writing the links through torch CPU scalar indexing.
        node_ids, node_depths, node_parents, node_scores, next_token, next_sibling = \
            _heap_loop(lp, ids, budget)
        m = len(node_ids)
        # 3. The O(n^2) visibility loop.
        vis = _visibility(node_parents, n)
        # 4. Per-request host-to-device copies.
        if m:
            draft_tokens[b, 1:m + 1].copy_(torch.tensor(node_ids, dtype=torch.int64).to(device))
        pos = torch.zeros(m + 1, dtype=torch.int64, device=device)
        pos[1:].copy_(torch.tensor(node_depths, dtype=torch.int64).to(device))
        positions[b, : m + 1] = pos + seq_lens_cpu[b]
        mask = torch.ones((n, seq_lens_cpu[b] + n), dtype=torch.bool, device=device)
        mask[:, seq_lens_cpu[b]:].copy_(torch.from_numpy(vis).to(device))
        masks.append(mask.flatten())
        retrieve_next_token[b].copy_(next_token.to(device))
        retrieve_next_sibling[b].copy_(next_sibling.to(device))
        # The reference's host-side fields, from values the loop already has.
        parents[b, : m + 1] = [-1] + node_parents
        depths[b, : m + 1] = [0] + node_depths
        scores[b, 1: m + 1] = node_scores
        num_nodes[b] = m + 1
        vis_all.append(vis)
    # 5. The final concatenation of the masks.
    custom_mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool, device=device)
    return SglangTree(draft_tokens, positions, retrieve_next_token, retrieve_next_sibling,
                      retrieve_index, custom_mask, parents, depths, scores, num_nodes, vis_all)


def _heap_loop(lp: np.ndarray, ids: np.ndarray, budget: int):
    """One request's best-first loop. lp float32 [L, K], ids int64 [L, K] (host numpy).

    Returns node ids, depths, parents, scores (lists, node order 1..m) and the two link rows
    (torch CPU int64 [budget + 1]) built by prepending each node to its parent's list.
    """
    L, K = lp.shape
    next_token = torch.full((budget + 1,), -1, dtype=torch.int64)
    next_sibling = torch.full((budget + 1,), -1, dtype=torch.int64)
    # Heap entry: (-score, rank_path, parent, depth, rank, score); float() widens exactly, and
    # Python float arithmetic is IEEE double, in the reference's operation order.
    first = float(lp[0, 0])
    heap = [(-first, (0,), 0, 1, 0, first)]
    node_ids, node_depths, node_parents, node_scores = [], [], [], []
    while heap and len(node_ids) < budget:
        _, path, parent, depth, rank, score = heapq.heappop(heap)
        node_ids.append(int(ids[depth - 1, rank]))
        node_depths.append(depth)
        node_parents.append(parent)
        node_scores.append(score)
        i = len(node_ids)
        # Link writes through torch scalar indexing, as SGLang's builder does them.
        if next_token[parent].item() == -1:
            next_token[parent] = i
        else:
            next_sibling[i] = next_token[parent]
            next_token[parent] = i
        if rank + 1 < K:
            s = (score - float(lp[depth - 1, rank])) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-s, path[:-1] + (rank + 1,), parent, depth, rank + 1, s))
        if depth < L:
            s = score + float(lp[depth, 0])
            heapq.heappush(heap, (-s, path + (0,), i, depth + 1, 0, s))
    return node_ids, node_depths, node_parents, node_scores, next_token, next_sibling


def _visibility(node_parents: list, n: int) -> np.ndarray:
    """bool [n, n]: row i = its parent's row (first i entries) plus entry i; unused rows False."""
    vis = np.zeros((n, n), dtype=bool)
    vis[0, 0] = True
    for i, p in enumerate(node_parents, start=1):
        vis[i, :i] = vis[p, :i]
        vis[i, i] = True
    return vis
