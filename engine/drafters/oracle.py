"""The noisy ORACLE drafter (the interface: engine.drafters): for mechanics and benchmarks."""

from __future__ import annotations

import math

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


# ---------------------------------------------------------------- the batched oracle (device)

_M32 = 0xFFFFFFFF


def _mix(x):
    """A 32-bit integer hash (lowbias32-like, multipliers < 2^31 so int64 never overflows) of an
    int64 tensor whose values are in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x4F6CDD1D) & _M32
    return x ^ (x >> 16)


def _hash(*parts):
    """Hash of several int64 tensors (broadcast), in [0, 2^32)."""
    h = parts[0] & _M32
    for p in parts[1:]:
        h = _mix(h ^ (p & _M32))
    return _mix(h)


class OracleDrafter:
    """The noisy ORACLE, batched on the engine's device (torch, CPU or CUDA): the round's
    drafter interface (`depth`, `draft_batch(DraftInput, k)`, engine/native/round.py).

    Same noise model as NoisyOracleDrafter, with a counter-based hash of (request seed, P,
    depth) instead of numpy generators, so that a whole batch drafts in a few tensor ops and a
    CUDA graph can capture it: the true token truth[P + d] is at rank 0 with probability
    `quality`, at a rank in [1, K) with probability (1 - quality) * quality, else outside the
    top K; the other ranks hold distinct wrong tokens. Rank 0 has probability
    0.05 + 0.9 * quality; the others share the rest by exp(spread * z) with z roughly standard
    normal (so a better oracle is a more confident one and the best-first tree grows deeper).

    Truths live in a table [slots + 1, max_seq] on the device, filled per slot by assign()
    (OracleBatch.assign does it for a generate); past a truth's end the table holds hashed
    random tokens."""

    def __init__(self, vocab_size: int, depth: int = 15, quality: float = 0.8,
                 spread: float = 1.0):
        if not 0.0 <= quality <= 1.0:
            raise ValueError(f"OracleDrafter: quality = {quality}, expected in [0, 1]")
        if depth < 1:
            raise ValueError(f"OracleDrafter: depth = {depth}, expected >= 1")
        self.vocab_size, self.depth, self.quality = int(vocab_size), int(depth), float(quality)
        self.spread = float(spread)
        self.table = None   # int64 [slots + 1, max_seq] the true tokens by slot and position
        self.seeds = None   # int64 [slots + 1] each slot's request seed
        self.version = 0    # bumped when the buffers are replaced (a captured round re-captures)

    def assign(self, engine, slot: int, truth, seed: int) -> None:
        """Hand slot `slot` of `engine` its request's true sequence (prompt + continuation)."""
        import torch

        S, T = engine.max_slots + 1, engine.max_seq
        if self.table is None or tuple(self.table.shape) != (S, T) or \
                self.table.device != engine.torch_device:
            # New buffers: rounds captured on the old ones see `version` change and re-capture.
            self.table = torch.zeros((S, T), dtype=torch.int64, device=engine.torch_device)
            self.seeds = torch.zeros(S, dtype=torch.int64, device=engine.torch_device)
            self.version += 1
        truth = np.asarray(truth, np.int64)[:T]
        row = np.empty(T, np.int64)
        row[:len(truth)] = truth
        tail = np.arange(len(truth), T, dtype=np.int64)  # past the truth: hashed random tokens
        row[len(truth):] = (tail * 2654435761 + seed * 40503 + 12345) % self.vocab_size
        self.table[slot] = torch.from_numpy(row).to(engine.torch_device)
        self.seeds[slot] = int(seed) & _M32

    def constants(self) -> dict:
        """The row's scalar constants, computed once in Python doubles (the native kernel,
        kdt_oracle_draft, takes them as they are, so both round identically)."""
        q, V, p0 = self.quality, self.vocab_size, 0.05 + 0.9 * self.quality
        return {"quality": q, "q_mid": q + (1 - q) * q, "log_p0": math.log(p0),
                "rest_c": math.log(max(1.0 - p0, 1e-12)) - math.log(max(V - 1, 1))
                - self.spread ** 2 / 2, "spread": self.spread}

    def draft_batch(self, inp, k: int):
        """The reference implementation, in torch ops (the engine's NativeOracleDrafter runs
        the same arithmetic as one kernel)."""
        import torch

        c = self.constants()
        V, L = self.vocab_size, self.depth
        K = min(int(k), V)
        dev = inp.rows.device
        d = torch.arange(1, L + 1, device=dev)                                  # [L]
        P = inp.lengths[:, None]                                                 # [B, 1]
        seed = self.seeds[inp.rows][:, None]                                     # [B, 1]
        pos = (P + d[None, :]).clamp(max=self.table.shape[1] - 1)               # [B, L]
        true_tok = self.table[inp.rows[:, None], pos]                           # [B, L]
        base = _hash(seed, P, d[None, :])                                        # [B, L]
        u = (_mix(base ^ 1) >> 8).double() / float(1 << 24)
        r_mid = 1 + (_mix(base ^ 2) % max(K - 1, 1))
        rank = torch.where(u < c["quality"], torch.zeros_like(r_mid),
                           torch.where((u < c["q_mid"]) & (K > 1), r_mid,
                                       torch.full_like(r_mid, K)))               # [B, L]
        # K - 1 distinct wrong tokens: true + 1 + (a + j) mod (V - 1), j = 0 .. K - 1.
        j = torch.arange(K, device=dev)
        a = (_mix(base ^ 3) % max(V - 1, 1))[..., None]
        others = (true_tok[..., None] + 1 + (a + j) % max(V - 1, 1)) % V         # [B, L, K]
        jj = j[None, None, :]
        rk = rank[..., None]
        shifted = torch.cat([others[..., :1], others[..., :-1]], -1)            # others[j - 1]
        ids = torch.where(jj < rk, others, torch.where(jj == rk, true_tok[..., None], shifted))
        # Log-probabilities: rank 0 gets p0, ranks 1.. share 1 - p0 by exp(spread * z), z a
        # centred Irwin-Hall(4) draw scaled to variance 1.
        z = sum(((_mix(base[..., None] ^ (4 + 4 * jj + t)) >> 8).double() / float(1 << 24))
                for t in range(4)) * 2.0 - 4.0
        z = z * 1.7320508075688772
        rest = c["rest_c"] + c["spread"] * z[..., 1:]
        rest = torch.sort(rest, dim=-1, descending=True).values.clamp(max=c["log_p0"])
        top_logp = torch.cat([torch.full_like(rest[..., :1], c["log_p0"]), rest], -1)
        return top_logp.float().contiguous(), ids.contiguous()


class OracleBatch:
    """One generate's oracle: the engine's OracleDrafter, and per prompt its true sequence and
    seed (Engine.oracle_drafters builds it; Engine.generate assigns it to the prompts' slots)."""

    def __init__(self, drafter: OracleDrafter, truths: list, seeds: list):
        self.drafter, self.truths, self.seeds = drafter, list(truths), list(seeds)

    def assign(self, engine, slots) -> None:
        for slot, truth, seed in zip(slots, self.truths, self.seeds):
            self.drafter.assign(engine, slot, truth, seed)
