"""kdt_oracle_draft (engine/native/oracle.py) against its reference, the torch OracleDrafter,
on fresh random truths, slots, lengths and settings: ids equal, log-probabilities equal bit for
bit (the kernel rounds every double as torch does)."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from native_helpers import DEVICES, native, skip_cuda_without_gpu  # noqa: F401

pytestmark = pytest.mark.native
torch = pytest.importorskip("torch", reason="the oracle's reference is torch")


class _Eng:
    def __init__(self, slots, max_seq, device):
        self.max_slots, self.max_seq, self.torch_device = slots, max_seq, device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V,L,K", [(512, 15, 15), (97, 6, 63), (3000, 3, 255), (2, 1, 1),
                                   (50, 64, 50), (1200, 4, 1024)])
def test_native_oracle_equals_torch_reference(device, V, L, K):
    native()
    from engine.drafters.oracle import OracleDrafter
    from engine.native.oracle import NativeOracleDrafter
    from engine.native.round import DraftInput

    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    slots, max_seq = 5, 200
    q = float(rng.choice([0.0, 1.0, rng.random()]))
    spread = float(rng.uniform(0.2, 2.0))
    ref = OracleDrafter(V, depth=L, quality=q, spread=spread)
    nat = NativeOracleDrafter(V, depth=L, quality=q, spread=spread)
    eng = _Eng(slots, max_seq, dev)
    for s in range(slots + 1):
        truth = rng.integers(0, V, int(rng.integers(1, 150)))
        ref.assign(eng, s, truth, seed + s)
        nat.assign(eng, s, truth, seed + s)
    B = 7
    rows = torch.from_numpy(rng.integers(0, slots + 1, B)).to(dev)
    lengths = torch.from_numpy(rng.integers(0, max_seq + 20, B)).to(dev)  # past the table too
    inp = DraftInput(rows, lengths, torch.zeros(B, dtype=torch.int64, device=dev), None)
    lp_r, ids_r = ref.draft_batch(inp, K)
    lp_n, ids_n = nat.draft_batch(inp, K)
    ctx = f"seed {seed}, {device}, V {V} L {L} K {K} q {q:.3f} spread {spread:.3f}"
    assert ids_n.shape == ids_r.shape == (B, L, min(K, V)), ctx
    bad = torch.nonzero(ids_n != ids_r)
    assert not len(bad), f"{ctx}: ids differ first at {bad[0].tolist()}"
    bad = torch.nonzero(lp_n != lp_r)
    assert not len(bad), (f"{ctx}: log-probabilities differ first at {bad[0].tolist()}: "
                          f"{lp_n[tuple(bad[0])].item()} != {lp_r[tuple(bad[0])].item()}")


def test_native_oracle_refuses_bad_arguments():
    nat_mod = native()
    from engine.native.oracle import NativeOracleDrafter
    from engine.native.round import DraftInput

    o = NativeOracleDrafter(10, depth=3, quality=0.5)
    o.assign(_Eng(1, 20, torch.device("cpu")), 0, [1, 2, 3], 0)
    inp = DraftInput(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), None, None)
    with pytest.raises(nat_mod.NativeError, match="K="):
        o.draft_batch(inp, 0)
    with pytest.raises(ValueError, match="rows"):
        o.draft_batch(DraftInput(torch.zeros(1, dtype=torch.int32), inp.lengths, None, None), 3)
