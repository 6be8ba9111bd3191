"""The decode round on the device: drafting, tree build, verify, accept, commit, one copy home.

A `Round` serves one (batch bucket, mode, budget, drafter): `bucket` rows, each either an
active request's slot or the engine's scratch slot (padding). `run(slots)` advances those
slots by one DDTree round (or one AR step: a one-node tree) and returns, per row, the accepted
length and tokens. Every phase works on tensors of the engine's device; nothing of size vocab or
tree leaves it. The round ends with one device-to-host copy (int32 [bucket, n + 2]: the
accepted length, the tree's size, then the new tokens) and one synchronisation, on that copy's
event.

    phase      what runs (B = bucket, n = budget + 1 nodes, L drafted depths, K ranks)
    draft      the drafter's batched forward + top-K        -> top_logp [B, L, K], top_ids
    tree       kdt_tree_build (AR: the root alone)          -> tokens, positions, visibility [B, n]
    verify     kdt_engine_verify (target pass + argmax)     -> argmax [B, n], hidden [B, n, D]
    accept     kdt_tree_accept (AR: the root's argmax)      -> accept_index, accept_len, bonus
    commit     kdt_engine_commit_accepted, the drafters' hidden-state context, the next roots,
               the packed result
    copy       the packed result to pinned host memory, then the one synchronisation

On CUDA a round is captured once as a CUDA graph and replayed: its inputs are the slots
(copied into a static tensor) and state that lives in the engine's buffers (the slots' lengths
on the device, their hidden states, their next root tokens), so joins, leaves and growing
lengths never force a re-capture. `graphs=False` runs the same phases eagerly; the CPU backend
always does. `profile=True` times each phase (CUDA events around per-phase graphs on CUDA, the
monotonic clock on the CPU) instead of one whole-round graph.
"""

from __future__ import annotations

import time

import numpy as np

from . import tree as native_tree
from ._lib import Call, library
from .capture import gc_paused

PHASES = ("draft", "tree", "verify", "accept", "commit", "copy")


def finish(e, rows, prefix, tokens, num_nodes, accept_index, accept_len, bonus, hidden):
    """kdt_round_finish: the accepted nodes' hidden states into e.hidden_ctx, the bonus tokens
    into e.next_root; returns the result rows int32 [B, n + 2] (see Round.run)."""
    B, n = tokens.shape
    D = e.hidden_size
    c = Call(library(), "kdt_round_finish", e.device)
    ins = [c.input("rows", rows, np.int64, (B,)), c.input("prefix", prefix, np.int64, (B,)),
           c.input("tokens", tokens, np.int64, (B, n)),
           None if num_nodes is None else c.input("num_nodes", num_nodes, np.int32, (B,)),
           c.input("accept_index", accept_index, np.int32, (B, n)),
           c.input("accept_len", accept_len, np.int32, (B,)),
           c.input("bonus", bonus, np.int64, (B,)),
           c.input("hidden", hidden, np.float32, (B, n, D)),
           c.input("hidden_ctx", e.hidden_ctx, np.float32, tuple(e.hidden_ctx.shape)),
           c.input("next_root", e.next_root, np.int64, tuple(e.next_root.shape))]
    out = c.output("result", np.int32, (B, n + 2))
    return c.run(c.backend, c.stream, B, n, D, e.max_seq, e.scratch_slot, *ins, out)["result"]


class DraftInput:
    """What a drafter reads in a round (all on the engine's device, no host values):
    rows int64 [B] (slot of each row; the scratch slot for padding), lengths int64 [B] (each
    row's committed length P), roots int64 [B] (the token at position P, not yet in the cache),
    hidden float32 [slots + 1, max_seq, D] (the target's final-norm hidden state of every
    committed token, by slot and position)."""

    def __init__(self, rows, lengths, roots, hidden):
        self.rows, self.lengths, self.roots, self.hidden = rows, lengths, roots, hidden


class Round:
    def __init__(self, engine, bucket: int, mode: str, budget: int, drafter, graphs: bool,
                 profile: bool = False):
        import torch

        self.torch = torch
        self.eng = engine
        self.bucket, self.mode, self.drafter = int(bucket), mode, drafter
        self.budget = int(budget) if mode == "ddtree" else 0
        self.n = self.budget + 1
        self.cuda = engine.device == "cuda"
        self.graphs = bool(graphs) and self.cuda
        self.profile = bool(profile)
        dev = engine.torch_device
        self.rows = torch.full((self.bucket,), engine.scratch_slot, dtype=torch.int64, device=dev)
        self.host_rows = torch.empty((self.bucket,), dtype=torch.int64,
                                     pin_memory=self.cuda)
        self.result_host = torch.empty((self.bucket, self.n + 2), dtype=torch.int32,
                                       pin_memory=self.cuda)
        self.k = min(self.budget, engine.vocab_size) if mode == "ddtree" else 0
        # The one-node tree's constant parts (AR).
        self._ar_visibility = torch.ones((self.bucket, 1, 1), dtype=torch.uint32, device=dev)
        self._ar_index = torch.zeros((self.bucket, 1), dtype=torch.int32, device=dev)
        self._ar_len = torch.ones((self.bucket,), dtype=torch.int32, device=dev)
        self._graphs = None  # [(phase names, CUDAGraph)]
        self._captured_version = None  # the drafter's `version` when captured
        if self.cuda:
            self._done = torch.cuda.Event()
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        self.last_phase_seconds: dict | None = None  # the last profiled round's, per phase

    # ------------------------------------------------------------ the phases

    def _draft(self):
        e = self.eng
        self.P = e.lengths[self.rows].long()
        self.roots = e.next_root[self.rows]
        if self.mode == "ddtree":
            inp = DraftInput(self.rows, self.P, self.roots, e.hidden_ctx)
            self.top_logp, self.top_ids = self.drafter.draft_batch(inp, self.k)
        else:
            self.top_logp = self.top_ids = None

    def _tree(self):
        if self.mode == "ddtree":
            self.tree = native_tree.build_tree(self.top_logp, self.top_ids, self.budget,
                                               self.roots, self.P, device=self.eng.device)
            self.tokens, self.positions = self.tree.tokens, self.tree.positions
            self.visibility = self.tree.visibility
        else:
            self.tree = None
            self.tokens = self.roots[:, None].contiguous()
            self.positions = self.P[:, None].contiguous()
            self.visibility = self._ar_visibility

    def _verify(self):
        self.argmax, self.hidden = self.eng.verify(self.rows, self.tokens, self.positions,
                                                   self.visibility)

    def _accept(self):
        if self.mode == "ddtree":
            acc = native_tree.accept_greedy(self.tree, self.argmax, device=self.eng.device)
            self.accept_index, self.accept_len, self.bonus = acc.accept_index, acc.accept_len, acc.bonus
        else:  # the accept walk of a one-node tree: the root, then its argmax
            self.accept_index, self.accept_len = self._ar_index, self._ar_len
            self.bonus = self.argmax[:, 0].contiguous()

    def _commit(self):
        e = self.eng
        e.commit_accepted(self.rows, self.accept_index, self.accept_len)
        self.result = finish(e, self.rows, self.P, self.tokens,
                             None if self.tree is None else self.tree.num_nodes,
                             self.accept_index, self.accept_len, self.bonus, self.hidden)

    def _copy(self):
        self.result_host.copy_(self.result, non_blocking=self.cuda)

    _PHASE_FNS = {"draft": _draft, "tree": _tree, "verify": _verify, "accept": _accept,
                  "commit": _commit, "copy": _copy}

    def _run_phases(self, names):
        for name in names:
            self._PHASE_FNS[name](self)

    # ------------------------------------------------------------ capture and run

    def _capture(self):
        """Warm up on padding rows only (the scratch slot: nothing is committed), then capture
        the whole round, or each phase on its own when profiling."""
        torch = self.torch
        self.rows.fill_(self.eng.scratch_slot)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run_phases(PHASES)  # reserves the native scratch, warms torch's kernels
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        groups = [(p,) for p in PHASES] if self.profile else [PHASES]
        self._graphs = []
        for names in groups:
            g = torch.cuda.CUDAGraph()
            with gc_paused(), torch.cuda.graph(g, pool=self.eng.graph_pool):
                self._run_phases(names)
            self._graphs.append((names, g))

    def run(self, slots):
        """One round for `slots` (at most `bucket`; the other rows are padding). Returns the
        host int32 array [bucket, n + 2]: row i = [accepted length a, tree nodes, a - 1 accepted
        tokens, the bonus token] for slots[i]. Its only synchronisation is on the result's copy."""
        if len(slots) > self.bucket:
            raise ValueError(f"Round.run: {len(slots)} slots for a bucket of {self.bucket}")
        hr = self.host_rows.numpy()
        hr[:] = self.eng.scratch_slot
        hr[:len(slots)] = slots
        if not self.cuda:
            self.rows.copy_(self.host_rows)
            return self._run_cpu()
        version = getattr(self.drafter, "version", 0)
        if self.graphs and (self._graphs is None or version != self._captured_version):
            self._capture()  # first use, or the drafter replaced the buffers a graph reads
            self._captured_version = version
        self.rows.copy_(self.host_rows, non_blocking=True)
        if self.profile:
            return self._run_profiled()
        if self.graphs:
            self._graphs[0][1].replay()
        else:
            self._run_phases(PHASES)
        self._done.record()
        self._done.synchronize()
        return self.result_host.numpy()

    def _run_profiled(self):
        """CUDA events between the phases (per-phase graphs, or eager without graphs)."""
        ev = self._events
        ev[0].record()
        if self.graphs:
            for i, (_, g) in enumerate(self._graphs):
                g.replay()
                ev[i + 1].record()
        else:
            for i, p in enumerate(PHASES):
                self._PHASE_FNS[p](self)
                ev[i + 1].record()
        ev[-1].synchronize()
        self.last_phase_seconds = {p: ev[i].elapsed_time(ev[i + 1]) / 1e3
                                   for i, p in enumerate(PHASES)}
        return self.result_host.numpy()

    def _run_cpu(self):
        if not self.profile:
            self._run_phases(PHASES)
            return self.result_host.numpy()
        t = [time.perf_counter()]
        for p in PHASES:
            self._PHASE_FNS[p](self)
            t.append(time.perf_counter())
        self.last_phase_seconds = {p: t[i + 1] - t[i] for i, p in enumerate(PHASES)}
        return self.result_host.numpy()
