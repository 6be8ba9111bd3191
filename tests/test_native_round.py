"""The decode round on the device (engine/native/round.py and kdt_engine_verify /
kdt_engine_commit_accepted): the device path computes exactly what the host path computes,
requests that join and leave between rounds decode the same tokens as AR, every drafter keeps
DDTree == AR, CUDA graphs change nothing, a round synchronises with the host once, and the
per-phase profile covers every phase.

Fresh random weights, prompts and trees every run; failure messages carry the seeds.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from native_helpers import (  # noqa: F401
    DEVICES, cuda_ready, fresh_tiny_weights, native, skip_cuda_without_gpu)

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny target with a fresh seed and a seeded random block drafter beside it."""
    return fresh_tiny_weights(tmp_path_factory, "weights", drafter=True)


def engine(weights, device, **kw):
    native()
    from engine.native.engine import Engine

    return Engine(weights[0], device=device, **kw)


def prompts_for(rng, n, vocab, lo=1, hi=40):
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1))).astype(np.int64)
            for _ in range(n)]


def _causal(n):
    out = np.zeros((n, (n + 31) // 32), np.uint32)
    for i in range(n):
        for j in range(i + 1):
            out[i, j // 32] |= np.uint32(1 << (j % 32))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_device_path_equals_host_path(weights, device):
    """kdt_engine_verify on padded trees (with a padding row on the scratch slot) gives the host
    path's argmax and hidden states bit for bit; kdt_engine_commit_accepted leaves the same cache
    as kdt_engine_commit (the next logits are bit-identical); the scratch slot stays empty."""
    import torch

    nat = native()
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    ctx = f"weights seed {weights[1]}, seed {seed}, {device}"
    eng = engine(weights, device, max_slots=4, max_seq=256)
    V, S, dev = eng.vocab_size, eng.scratch_slot, eng.torch_device
    prompts = prompts_for(rng, 2, V, 3, 60)
    for p in prompts + prompts:  # slots 0, 1 (device path) and 2, 3 (host path), same prompts
        eng.add(p)
    budget, L, K = 23, 6, 5
    top_logp = -np.sort(rng.exponential(1.0, (3, L, K)), axis=-1).astype(np.float32)
    top_ids = rng.integers(0, V, (3, L, K)).astype(np.int64)
    roots = torch.tensor([int(rng.integers(V)) for _ in range(2)] + [0], device=dev)
    rows = torch.tensor([0, 1, S], device=dev)
    P = eng.lengths[rows].long()
    tree = nat.build_tree(torch.from_numpy(top_logp).to(dev), torch.from_numpy(top_ids).to(dev),
                          budget, roots, P, device=device)
    argmax, hidden = eng.verify(rows, tree.tokens, tree.positions, tree.visibility)
    argmax, hidden = argmax.cpu().numpy(), hidden.cpu().numpy()
    nn = tree.num_nodes.cpu().numpy()
    toks, pos, vis = (t.cpu().numpy() for t in (tree.tokens, tree.positions, tree.visibility))
    for b, host_slot in [(0, 2), (1, 3)]:
        n = int(nn[b])
        logits, h = eng.forward([host_slot], [toks[b, :n]], [pos[b, :n]], [vis[b, :n]],
                                [eng.num_layers + 1])
        want = np.argmax(logits, axis=-1)
        assert np.array_equal(argmax[b, :n], want), f"{ctx}: row {b}: argmax differs"
        assert (argmax[b, n:] == -1).all(), f"{ctx}: row {b}: padding nodes' argmax is not -1"
        assert np.array_equal(hidden[b, :n], h[:, 0]), f"{ctx}: row {b}: hidden states differ"
    acc = nat.accept_greedy(tree, torch.from_numpy(argmax).to(dev), device=device)
    eng.commit_accepted(rows, acc.accept_index, acc.accept_len)
    ai, al = acc.accept_index.cpu().numpy(), acc.accept_len.cpu().numpy()
    for b, host_slot in [(0, 2), (1, 3)]:
        eng.commit(host_slot, ai[b, :al[b]])
        assert eng.seq_len(b) == eng.seq_len(host_slot) == len(prompts[b]) + al[b], ctx
    assert eng.seq_len(0) > 0 and int(eng.lengths[S]) == 0, f"{ctx}: the scratch slot grew"
    probe = [np.array([int(rng.integers(V))])] * 4
    at = [[eng.seq_len(s)] for s in range(4)]
    logits, _ = eng.forward([0, 1, 2, 3], probe, at, [np.ones((1, 1), np.uint32)] * 4)
    assert np.array_equal(logits[0], logits[2]) and np.array_equal(logits[1], logits[3]), \
        f"{ctx}: the device commit left another cache than the host commit"


def _ar_tokens(eng, prompts, n):
    return [t.tolist() for t in eng.generate(prompts, n, mode="ar").tokens]


def _drive(eng, prompts, drafter_for, schedule):
    """Joins and leaves: `schedule` is a list of ("add", i) / ("step", mode, budget) /
    ("leave", i); returns {prompt index: tokens streamed by step()}."""
    slot_of, streams = {}, {}
    for ev in schedule:
        if ev[0] == "add":
            i = ev[1]
            slot_of[i] = eng.add(prompts[i])
            streams[i] = []
            drafter_for(slot_of[i], i, "assign")
        elif ev[0] == "leave":
            eng.release(slot_of.pop(ev[1]))
        else:
            _, mode, budget = ev
            out = eng.step(mode, budget, drafter_for(None, None, mode))
            for i, s in slot_of.items():
                streams[i].extend(out[s])
    return streams


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("drafter", ["block", "oracle"])
@pytest.mark.parametrize("device", DEVICES)
def test_joins_and_leaves_mid_generation(weights, device, drafter, graphs):
    """Requests join and leave between rounds (batch buckets 1, 2, 4 and back), AR steps and
    DDTree rounds of two budgets interleave: every request's stream equals its AR tokens."""
    if device == "cpu" and graphs:
        pytest.skip("the CPU backend has no graphs (same code path as eager)")
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    ctx = f"weights seed {weights[1]}, seed {seed}, {device}, {drafter}, graphs {graphs}"
    eng = engine(weights, device, max_slots=6, max_seq=320, graphs=graphs)
    prompts = prompts_for(rng, 6, eng.vocab_size)
    want = _ar_tokens(eng, prompts, 90)
    oracle = eng.oracle_drafters(prompts, 90, 0.7, seed=seed) if drafter == "oracle" else None

    def drafter_for(slot, i, what):
        if what == "assign":
            if oracle is not None:
                oracle.drafter.assign(eng, slot, oracle.truths[i], oracle.seeds[i])
            return None
        return None if what == "ar" else (oracle.drafter if oracle else None)

    dd = ("step", "ddtree", 15)
    schedule = [("add", 0), dd, dd, ("add", 1), dd, ("step", "ar", 0), ("add", 2), dd,
                ("step", "ddtree", 7), ("leave", 0), dd, ("add", 3), ("add", 4), dd, dd,
                ("leave", 2), ("step", "ar", 0), dd, ("leave", 1), ("leave", 3), dd,
                ("add", 5), dd, dd]
    streams = _drive(eng, prompts, drafter_for, schedule)
    for i, got in streams.items():
        assert len(got) >= 2, f"{ctx}: prompt {i} streamed {got}"
        n = min(len(got), 90)
        assert got[:n] == want[i][:n], \
            f"{ctx}: prompt {i}: {got[:n]} != AR {want[i][:n]}"


@pytest.mark.parametrize("device", DEVICES)
def test_every_drafter_keeps_ddtree_equal_to_ar_in_batches(weights, device):
    """generate() in one batch of 5 (bucket 8: three padding rows): the block drafter and
    oracles of three qualities decode the AR tokens; tau rises with the oracle's quality."""
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    ctx = f"weights seed {weights[1]}, seed {seed}, {device}"
    eng = engine(weights, device, max_slots=6, max_seq=300)
    prompts = prompts_for(rng, 5, eng.vocab_size)
    ar = _ar_tokens(eng, prompts, 48)
    taus = []
    for drafter, budget in [("block", 15), ("oracle:0.2", 15), ("oracle:0.6", 31), ("oracle:0.95", 63)]:
        r = eng.generate(prompts, 48, mode="ddtree", budget=budget, drafter=drafter,
                         oracle_seed=seed)
        assert [t.tolist() for t in r.tokens] == ar, f"{ctx}: {drafter} B={budget}: != AR"
        taus.append(r.stats.mean_accept_length)
    assert taus[1] < taus[2] < taus[3], f"{ctx}: tau does not rise with quality: {taus}"
    assert taus[3] > 3.0, f"{ctx}: the 0.95 oracle accepts only {taus[3]:.2f} per round"


@pytest.mark.parametrize("device", DEVICES)
def test_profile_times_every_phase_and_changes_nothing(weights, device):
    from engine.native.round import PHASES

    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    prompts = prompts_for(rng, 3, 512)
    plain = engine(weights, device, max_slots=4, max_seq=200)
    prof = engine(weights, device, max_slots=4, max_seq=200, profile=True)
    for mode in ("ar", "ddtree"):
        a = plain.generate(prompts, 24, mode=mode, budget=15)
        b = prof.generate(prompts, 24, mode=mode, budget=15)
        assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens], f"seed {seed}"
        assert set(b.stats.phase_seconds) == set(PHASES), b.stats.phase_seconds
        assert all(v > 0 for v in b.stats.phase_seconds.values()), b.stats.phase_seconds
        assert not a.stats.phase_seconds, "the plain engine times no phases"


class _CollectsWhileCapturing:
    """A drafter that runs the cyclic collector inside a CUDA graph capture whenever automatic
    collection is on: what a busy process's collector may do at that moment (the test keeps it
    from running anywhere else)."""

    def __init__(self, inner):
        self.inner, self.depth = inner, inner.depth

    def draft_batch(self, inp, k):
        import gc

        import torch

        if torch.cuda.is_current_stream_capturing() and gc.isenabled():
            gc.collect()
        return self.inner.draft_batch(inp, k)


@pytest.mark.cuda
def test_an_engine_left_to_the_collector_does_not_break_a_capture(weights, cuda_ready):
    """An Engine held only by a reference cycle is freed when the cyclic collector runs; its
    cudaFree inside another engine's graph capture invalidated that capture (on the H200, the
    seventh engine of one process failed that way). The round's capture collects first and
    keeps the collector off (engine.native.capture): here a collection is offered inside the
    capture, with such an engine waiting, and the captured rounds still decode AR's tokens."""
    import gc

    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    ctx = f"weights seed {weights[1]}, seed {seed}"
    eng = engine(weights, "cuda", max_slots=2, max_seq=200, graphs=True)
    prompts = prompts_for(rng, 2, eng.vocab_size)
    want = _ar_tokens(eng, prompts, 30)
    drafter = _CollectsWhileCapturing(eng.block_drafter())
    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(10**9)  # no automatic collection from here but the drafter's
    try:
        dead = engine(weights, "cuda", max_slots=1, max_seq=64)
        dead.cycle = dead
        del dead
        slots = [eng.add(p) for p in prompts]
        got = {s: [] for s in slots}
        while min(len(v) for v in got.values()) < 30:
            for s, toks in eng.step("ddtree", 15, drafter).items():
                got[s].extend(toks)
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    for s, w in zip(slots, want):
        assert got[s][:30] == w[:30], f"{ctx}: slot {s}: DDTree differs from AR"


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_round_synchronises_once(weights, cuda_ready, graphs, monkeypatch):
    """On CUDA, a round (DDTree or AR) makes exactly one host synchronisation, on its result's
    copy: none inside libkdtree (kdt_sync_count), none implicit in torch (sync debug mode
    "error" raises on any), and one explicit one (counted at torch's synchronise calls)."""
    import torch

    nat = native()
    lib = nat.library()
    eng = engine(weights, "cuda", max_slots=4, max_seq=400, graphs=graphs)
    rng = np.random.default_rng(secrets.randbelow(2**31))
    for p in prompts_for(rng, 3, eng.vocab_size):
        eng.add(p)
    for mode in ("ddtree", "ar"):
        eng.step(mode, 15)  # capture (graphs) and warm up
    explicit = []
    real = {"event": torch.cuda.Event.synchronize, "stream": torch.cuda.Stream.synchronize}

    def counted(kind):
        def sync(self):
            explicit.append(kind)
            torch.cuda.set_sync_debug_mode(0)
            try:
                return real[kind](self)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        return sync

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted("event"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counted("stream"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: explicit.append("device"))
    before = lib.sync_count()
    rounds = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mode in ("ddtree", "ar", "ddtree", "ddtree", "ar"):
            eng.step(mode, 15)
            rounds += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert lib.sync_count() == before, "libkdtree synchronised inside a round"
    assert len(explicit) == rounds, f"{len(explicit)} explicit synchronisations in {rounds} rounds: {explicit}"


def _finish_reference(rows, prefix, tokens, num_nodes, index, length, bonus, hidden, ctx, root,
                      scratch, max_seq):
    """numpy kdt_round_finish (kdtree.h): the drafters' context, the next roots, the result."""
    B, n = tokens.shape
    res = np.zeros((B, n + 2), np.int32)
    for b in range(B):
        a = min(max(int(length[b]), 0), n)
        res[b, 0], res[b, 1] = a, 1 if num_nodes is None else num_nodes[b]
        for k in range(1, a):
            res[b, 1 + k] = tokens[b, index[b, k]]
        if a >= 1:  # a malformed row (a = 0) has no bonus column
            res[b, 1 + a] = bonus[b]
        if 0 <= rows[b] < scratch:
            root[rows[b]] = bonus[b]
            for k in range(a):
                if prefix[b] + k < max_seq:
                    ctx[rows[b] * max_seq + prefix[b] + k] = hidden[b, index[b, k]]
    return res


@pytest.mark.parametrize("device", DEVICES)
def test_round_finish_equals_numpy_reference(device):
    import torch

    native()
    from engine.native.round import finish

    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    S, max_seq, D, B, n = 5, 30, 12, 6, 9

    class E:  # the engine fields finish() reads
        pass

    e = E()
    e.device, e.hidden_size, e.max_seq, e.scratch_slot = device, D, max_seq, S
    ctx0 = rng.standard_normal(((S + 1) * max_seq, D)).astype(np.float32)
    root0 = rng.integers(0, 100, S + 1)
    e.hidden_ctx = torch.from_numpy(ctx0.copy()).to(dev)
    e.next_root = torch.from_numpy(root0.copy()).to(dev)
    rows = rng.permutation(S + 1)[:B].astype(np.int64)          # distinct slots, one padding
    prefix = rng.integers(0, max_seq, B).astype(np.int64)       # some past max_seq - n
    tokens = rng.integers(0, 500, (B, n)).astype(np.int64)
    length = rng.integers(0, n + 1, B).astype(np.int32)
    index = np.full((B, n), -1, np.int32)
    for b in range(B):
        index[b, :length[b]] = np.sort(rng.choice(n, length[b], replace=False))
    num_nodes = rng.integers(1, n + 1, B).astype(np.int32)
    bonus = rng.integers(0, 500, B).astype(np.int64)
    hidden = rng.standard_normal((B, n, D)).astype(np.float32)
    for nn in (num_nodes, None):
        e.hidden_ctx.copy_(torch.from_numpy(ctx0))
        e.next_root.copy_(torch.from_numpy(root0))
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        got = finish(e, t(rows), t(prefix), t(tokens), None if nn is None else t(nn), t(index),
                     t(length), t(bonus), t(hidden))
        ctx, root = ctx0.copy(), root0.copy()
        want = _finish_reference(rows, prefix, tokens, nn, index, length, bonus, hidden, ctx, root,
                                 S, max_seq)
        ctx_msg = f"seed {seed}, {device}, num_nodes {'given' if nn is not None else 'NULL'}"
        assert np.array_equal(got.cpu().numpy(), want), ctx_msg
        assert np.array_equal(e.hidden_ctx.cpu().numpy(), ctx), ctx_msg
        assert np.array_equal(e.next_root.cpu().numpy(), root), ctx_msg
