"""Drafters: per request and round, the top-K draft distribution for the next L positions.

The interface (what `engine.model_decode.generate` and the native engine call):

    drafter.depth                                  # L, the number of drafted positions
    top_logp, top_ids = drafter.draft(committed, root, hidden, k)
        committed  int64 [P]      the committed tokens (prompt + accepted so far)
        root       int            the root token b at position P (not yet in the target's cache)
        hidden     float [P, D]   the target's hidden states (after its final norm) at the
                                  committed positions; row j predicted token j + 1
        k          int            K, the number of ranks per depth
        top_logp   float32 [L, K] log-probabilities, each row sorted descending
        top_ids    int64   [L, K] token ids; row d-1 is depth d (position P + d)

Two drafters ship:
- `NoisyOracleDrafter`: an ORACLE for mechanics and benchmarks. It is handed the target's true
  greedy continuation and puts the true token at rank 0 with probability `quality`, at a rank in
  [1, K) with probability (1 - quality) * quality, and outside the top K otherwise; seeded, so
  quality 1 is always right and quality 0 always wrong.
- `BlockDrafter`: a real drafter that never sees the target's future (engine.block_drafter):
  a small network reading the target's last hidden states and predicting the L positions in one
  pass from mask tokens; weights in `drafter.safetensors` + `drafter_config.json` beside the
  target's.

    python -m engine.drafters train --weights DIR [--steps N]   # trains the block drafter briefly
"""

from __future__ import annotations

import numpy as np

from engine import block_drafter
from engine.block_drafter import BlockDrafter


def topk_from_logits(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [L, V] -> (top_logp float32 [L, K], top_ids int64 [L, K]) with K = min(k, V);
    log-prob = logit - logsumexp(row) in float64, rows sorted descending (ties: lower id first)."""
    logits = np.asarray(logits, dtype=np.float64)
    k = min(k, logits.shape[1])
    m = logits.max(axis=1, keepdims=True)
    logp = logits - (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))
    ids = np.argsort(-logp, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(logp, ids, axis=1).astype(np.float32), ids.astype(np.int64)


class NoisyOracleDrafter:
    """ORACLE drafter: knows the target's true greedy sequence (`truth` = prompt + continuation).

    For depth d of a round at committed length P, the true token is truth[P + d] (random past the
    end of truth). A generator seeded by (seed, P, d) decides its rank: 0 with probability
    quality, uniform in [1, K) with probability (1 - quality) * quality, else it is left out of
    the top K. The other ranks hold distinct random tokens. Rank 0 has probability
    0.05 + 0.9 * quality; the rest share the remainder by a softmax of Gaussian logits with std
    `spread` (so a better oracle is also a more confident one and the tree grows deeper)."""

    def __init__(self, truth, vocab_size: int, depth: int = 15, quality: float = 0.8,
                 seed: int = 0, spread: float = 1.0):
        if not 0.0 <= quality <= 1.0:
            raise ValueError(f"NoisyOracleDrafter: quality = {quality}, expected in [0, 1]")
        if depth < 1:
            raise ValueError(f"NoisyOracleDrafter: depth = {depth}, expected >= 1")
        self.truth = np.asarray(truth, dtype=np.int64)
        self.vocab_size, self.depth, self.quality = int(vocab_size), int(depth), float(quality)
        self.seed, self.spread = int(seed), float(spread)

    def draft(self, committed, root, hidden, k):
        P, V = len(committed), self.vocab_size
        k = min(int(k), V)
        top_logp = np.empty((self.depth, k), np.float32)
        top_ids = np.empty((self.depth, k), np.int64)
        for d in range(1, self.depth + 1):
            rng = np.random.default_rng([self.seed, P, d])
            pos = P + d
            true_tok = int(self.truth[pos]) if pos < len(self.truth) else int(rng.integers(V))
            u = rng.random()
            if u < self.quality:
                rank = 0
            elif u < self.quality + (1 - self.quality) * self.quality and k > 1:
                rank = int(rng.integers(1, k))
            else:
                rank = k  # outside the top K
            others = rng.permutation(V)
            others = others[others != true_tok]
            ids = np.insert(others, min(rank, V - 1), true_tok)  # [V]: a ranking of every token
            # Probabilities: rank 0 gets p0 (confident when the oracle is good, so the best-first
            # tree grows deep), the rest share 1 - p0 by a softmax of Gaussian noise.
            p0 = 0.05 + 0.9 * self.quality
            rest = np.exp(rng.standard_normal(V - 1) * self.spread)
            probs = np.sort(np.concatenate([[p0], (1 - p0) * rest / rest.sum()]))[::-1]
            top_logp[d - 1] = np.log(probs[:k]).astype(np.float32)
            top_ids[d - 1] = ids[:k]
        return top_logp, top_ids


def load_block_drafter(weights_dir, backend: str = "torch", device: str = "cpu") -> BlockDrafter:
    """The block drafter stored beside the target's weights (drafter.safetensors)."""
    return BlockDrafter.from_dir(weights_dir, backend=backend, device=device)


def init_block_drafter(weights_dir, seed: int = 1):
    """Writes seeded random block-drafter weights beside the target's; returns the two paths."""
    return block_drafter.init_block_drafter(weights_dir, seed=seed)


def main(argv=None) -> int:
    import argparse
    import json
    import sys

    from engine.model import limit_blas_threads

    ap = argparse.ArgumentParser(prog="python -m engine.drafters",
                                 description="Drafters; `train` trains the block drafter briefly.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train DIR's block drafter on the target's greedy outputs")
    t.add_argument("--weights", required=True, help="folder with the target and drafter weights")
    t.add_argument("--steps", type=int, default=800)
    t.add_argument("--sequences", type=int, default=192, help="greedy training sequences")
    t.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per sequence")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:i]")
    args = ap.parse_args(argv)
    limit_blas_threads(1)
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)  # small matrices: extra threads only spin on a shared machine
    from engine.drafter_train import train

    try:
        result = train(args.weights, steps=args.steps, sequences=args.sequences,
                       new_tokens=args.new_tokens, seed=args.seed, device=args.device)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 5
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
