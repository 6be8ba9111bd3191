"""The drafters' batched interface (`draft_batch(DraftInput, k)`, engine/native/round.py): the
block drafter's batched forward equals its one-request forward row by row, and the batched
oracle keeps the interface contract and its quality knob."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the batched drafters run on torch")

from engine.drafters import block as BD  # noqa: E402
from engine.drafters.oracle import OracleDrafter  # noqa: E402
from engine.native.round import DraftInput  # noqa: E402


class _Eng:
    """The two things OracleDrafter.assign reads of an engine."""

    def __init__(self, slots, max_seq):
        self.max_slots, self.max_seq, self.torch_device = slots, max_seq, torch.device("cpu")


def _contract(top_logp, top_ids, B, L, K, V):
    assert top_logp.shape == (B, L, K) and top_ids.shape == (B, L, K)
    assert top_logp.dtype == torch.float32 and top_ids.dtype == torch.int64
    assert torch.isfinite(top_logp).all() and (top_logp <= 0).all()
    assert (top_logp[..., 1:] <= top_logp[..., :-1]).all(), "rows are not sorted descending"
    assert ((top_ids >= 0) & (top_ids < V)).all()
    for row in top_ids.reshape(-1, K):
        assert len(set(row.tolist())) == K, f"repeated ids in a row: {row.tolist()}"


def test_block_drafter_batch_equals_one_request_forward():
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    V, Dt = 300, 48
    cfg = BD.DrafterConfig(vocab_size=V, target_hidden_size=Dt, hidden_size=32, num_heads=4,
                           intermediate_size=64, block_size=6, context_size=8)
    d = BD.BlockDrafter(cfg, BD.init_weights(cfg, seed), backend="torch")
    slots, max_seq, K = 5, 40, 7
    hidden = torch.from_numpy(rng.standard_normal((slots + 1, max_seq, Dt)).astype(np.float32))
    rows = torch.tensor([3, 0, 5, 1])            # slot 5 = the scratch slot (padding)
    lengths = torch.tensor([20, 3, 0, 8])        # shorter and longer than the context (8)
    roots = torch.tensor([int(x) for x in rng.integers(0, V, 4)])
    with torch.no_grad():
        lp, ids = d.draft_batch(DraftInput(rows, lengths, roots, hidden), K)
    _contract(lp, ids, 4, cfg.depth, K, V)
    for b in range(4):
        h = hidden[int(rows[b]), :int(lengths[b])]
        lp1, ids1 = d.draft(None, int(roots[b]), h, K)
        np.testing.assert_allclose(lp[b].numpy(), lp1, rtol=1e-5, atol=1e-5,
                                   err_msg=f"seed {seed}: row {b}")
        same = (ids[b].numpy() == ids1).mean()
        assert same > 0.9, f"seed {seed}: row {b}: top-K ids agree on {same:.0%} only"


@pytest.mark.parametrize("quality", [0.0, 0.4, 1.0])
def test_batched_oracle_contract_and_quality(quality):
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    V, L, K, slots, max_seq = 97, 6, 9, 3, 128
    o = OracleDrafter(V, depth=L, quality=quality)
    eng = _Eng(slots, max_seq)
    truths = [rng.integers(0, V, int(rng.integers(30, 100))) for _ in range(slots)]
    for s, t in enumerate(truths):
        o.assign(eng, s, t, seed + s)
    hits = ranks = 0
    for P in range(1, 25):
        rows = torch.tensor([0, 1, 2, slots])
        lengths = torch.tensor([P, P + 3, P + 7, 0])
        lp, ids = o.draft_batch(DraftInput(rows, lengths, torch.zeros(4, dtype=torch.int64),
                                           None), K)
        _contract(lp, ids, 4, L, K, V)
        for b in range(3):
            for dd in range(L):
                pos = int(lengths[b]) + dd + 1
                if pos >= len(truths[b]):
                    continue
                true = int(truths[b][pos])
                row = ids[b, dd].tolist()
                ranks += 1
                hits += row[0] == true
                if quality == 1.0:
                    assert row[0] == true, f"seed {seed}: quality 1 missed at P {P}"
                if quality == 0.0:
                    assert true not in row, f"seed {seed}: quality 0 drafted the truth"
    if 0 < quality < 1:
        assert abs(hits / ranks - quality) < 0.12, f"seed {seed}: rank-0 rate {hits / ranks:.2f}"
    again = OracleDrafter(V, depth=L, quality=quality)
    for s, t in enumerate(truths):
        again.assign(eng, s, t, seed + s)
    inp = DraftInput(torch.tensor([0, 2]), torch.tensor([5, 9]), torch.zeros(2, dtype=torch.int64), None)
    a, b = o.draft_batch(inp, K), again.draft_batch(inp, K)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]), "the oracle is not deterministic"


def test_batched_oracle_refuses_bad_settings():
    with pytest.raises(ValueError, match="quality"):
        OracleDrafter(10, quality=1.5)
    with pytest.raises(ValueError, match="depth"):
        OracleDrafter(10, depth=0)
