"""The noisy ORACLE drafter (the interface: engine.drafters): for mechanics and benchmarks."""

from __future__ import annotations

import numpy as np



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
