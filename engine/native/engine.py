"""The native engine: an FP32 MLA + MoE target (libkdtree) decoding greedily with AR or DDTree.

    eng = Engine("weights/tiny", device="cpu")          # or device="cuda"
    r = eng.generate(prompt_ids, 64, mode="ddtree", budget=63, drafter="oracle:0.8")
    r.tokens, r.stats.mean_accept_length, r.stats.target_forwards

The weights folder is the one `python -m engine.cli.model init --out DIR` writes (docs/MODEL.md);
the library reads it itself (cuda/src/model_load.cpp). One code path serves both modes: an AR
step is the verify of a one-node tree (the root alone), a DDTree round the verify of the
drafted tree; the library computes each token's row with arithmetic that does not depend on
the batch, so DDTree output equals AR output token for token.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from ._lib import BACKEND_CPU, BACKEND_CUDA, NativeError, library

_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_SIG = {
    "kdt_engine_create": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, _I32, _I32,
                                         ctypes.POINTER(ctypes.c_void_p)]),
    "kdt_engine_destroy": (None, [_P]),
    "kdt_engine_dim": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]),
    "kdt_engine_seq_len": (ctypes.c_int, [_P, _I32, ctypes.POINTER(_I32)]),
    "kdt_engine_reset_slot": (ctypes.c_int, [_P, _I32]),
    # (engine, n_req, slots, q_indptr, tokens, positions, visibility, vis_words, n_capture,
    #  capture_layers, logits, hidden)
    "kdt_engine_forward": (ctypes.c_int, [_P, _I32, _P, _P, _P, _P, _P, _I32, _I32, _P, _P, _P]),
    "kdt_engine_commit": (ctypes.c_int, [_P, _I32, _I32, _P]),
}

DEFAULT_ORACLE_QUALITY = 0.8


def _bind(lib):
    for name, (res, args) in _SIG.items():
        f = getattr(lib.cdll, name, None)
        if f is None:
            raise NativeError(name, 2, f"{lib.path} has no {name}: rebuild it from this tree "
                                       "(cuda/build.sh)")
        f.restype, f.argtypes = res, args
    return lib


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@dataclasses.dataclass
class EngineStats:
    """What one `generate` did. Rounds are batched: one target forward advances every request."""

    mode: str
    device: str
    budget: int
    target_forwards: int = 0  # batched target passes, the prefill included (as in model_decode)
    rounds: int = 0  # decode rounds after the prefill (AR: steps)
    accept_lengths: list = dataclasses.field(default_factory=list)  # [request][round], root included
    tree_sizes: list = dataclasses.field(default_factory=list)  # [request][round], nodes verified
    new_tokens: int = 0  # tokens returned, all requests
    seconds: float = 0.0  # wall time of generate (oracle truth excluded)
    draft_seconds: float = 0.0  # drafting + tree build
    forward_seconds: float = 0.0  # target forwards (prefill included)

    @property
    def mean_accept_length(self) -> float:
        """tau: mean accepted nodes per round over all requests (root included)."""
        flat = [a for req in self.accept_lengths for a in req]
        return float(np.mean(flat)) if flat else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class GenerateResult:
    tokens: object  # int64 [max_new_tokens] for one prompt, else a list of such arrays
    stats: EngineStats


@dataclasses.dataclass
class _Slot:
    committed: list  # tokens in the cache (prompt + accepted)
    hidden_buf: np.ndarray  # [max_seq, D]; rows [0, len(committed)) are the final-norm hidden
    #                         states of the committed tokens (the drafters' input)
    out: list  # generated tokens so far; out[-1] is the root (not yet in the cache)
    reported: int = 0  # how many of `out` step() has returned already
    accept_lengths: list = dataclasses.field(default_factory=list)
    tree_sizes: list = dataclasses.field(default_factory=list)

    @property
    def hidden(self) -> np.ndarray:
        return self.hidden_buf[:len(self.committed)]


@dataclasses.dataclass
class _OneNodeTree:
    """The AR step as a tree: the root alone (the shapes of engine.reference.ddtree.Tree, n = 1)."""

    tokens: np.ndarray
    first_child: np.ndarray
    next_sibling: np.ndarray
    num_nodes: np.ndarray
    positions: np.ndarray
    visibility: np.ndarray

    @classmethod
    def make(cls, roots, seq_lens):
        bs = len(roots)
        return cls(tokens=np.asarray(roots, np.int64).reshape(bs, 1),
                   first_child=np.full((bs, 1), -1, np.int64),
                   next_sibling=np.full((bs, 1), -1, np.int64),
                   num_nodes=np.ones(bs, np.int32),
                   positions=np.asarray(seq_lens, np.int64).reshape(bs, 1),
                   visibility=np.ones((bs, 1, 1), np.uint32))


class Engine:
    """FP32 target model in libkdtree with a latent KV cache per request slot.

    Engine(weights_dir, device="cpu"|"cuda", max_slots=32, max_seq=1024)
      max_slots requests at once, each with up to max_seq cache rows (prompt + generated +
      budget + 1 must fit; positions must be < max_seq).

    Whole generations:
      generate(prompt_ids, max_new_tokens, mode="ar"|"ddtree", budget=63, drafter=None)
        prompt_ids: one list of token ids, or a list of lists (a batch decoded together).
        drafter: None = the block drafter stored with the weights (engine.drafters);
          "oracle" or "oracle:<quality>" = the noisy ORACLE (engine.drafters.oracle.NoisyOracleDrafter,
          handed the true greedy continuation, which this engine computes first by AR and does
          not count in the stats); or any object with `depth` and `draft(committed, root,
          hidden, k)`, or a list of such objects, one per prompt (see oracle_drafters()).
        Returns GenerateResult(tokens, stats): tokens int64 [max_new_tokens] (a list of them for
        a batch), stats an EngineStats (accepted lengths per round, target forwards, seconds).

    Step level (for a server; one batched target forward per step):
      add(prompt_ids) -> slot        prefills the prompt; the first new token (the prefill's
                                     argmax) is returned by the slot's next step()
      step(mode, budget, drafter) -> {slot: [new tokens]}
                                     advances every active slot by one AR step or one DDTree
                                     round; drafter as in generate (an object, or a dict slot ->
                                     object; a string only "block"/None), K = min(budget, vocab)
      release(slot)                  frees the slot for reuse
      tokens(slot)                   every token generated for the slot so far

    Low level: forward(...) and commit(...) mirror kdt_engine_forward / kdt_engine_commit.
    """

    def __init__(self, weights_dir, device: str = "cpu", max_slots: int = 32,
                 max_seq: int = 1024):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"Engine: device={device!r} must be 'cpu' or 'cuda'")
        self.weights_dir = Path(weights_dir)
        self.device = device
        self._lib = _bind(library())
        if device == "cuda" and not self._lib.has_cuda:
            raise NativeError("kdt_engine_create", 2, f"device='cuda' but {self._lib.path} is a "
                              "CPU-only build (cuda/build.sh --arch sm_90 or native)")
        handle = ctypes.c_void_p()
        self._handle = None
        self._call("kdt_engine_create", BACKEND_CUDA if device == "cuda" else BACKEND_CPU,
                   str(self.weights_dir).encode(), int(max_slots), int(max_seq),
                   ctypes.byref(handle))
        self._handle = handle.value
        self.config = json.loads((self.weights_dir / "config.json").read_text())
        self.vocab_size = self._dim("vocab_size")
        self.hidden_size = self._dim("hidden_size")
        self.num_layers = self._dim("num_hidden_layers")
        self.max_slots, self.max_seq = int(max_slots), int(max_seq)
        self._final_hidden = np.array([self.num_layers + 1], np.int32)  # capture index
        self._slots: dict[int, _Slot] = {}
        self._block_drafter = None

    # ------------------------------------------------------------ plumbing

    def _call(self, fn: str, *args) -> None:
        self._lib.check(fn, getattr(self._lib.cdll, fn)(*args))

    def _dim(self, name: str) -> int:
        v = ctypes.c_int64()
        self._call("kdt_engine_dim", self._handle, name.encode(), ctypes.byref(v))
        return int(v.value)

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.cdll.kdt_engine_destroy(self._handle)
            self._handle = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def seq_len(self, slot: int) -> int:
        v = ctypes.c_int32()
        self._call("kdt_engine_seq_len", self._handle, int(slot), ctypes.byref(v))
        return int(v.value)

    def forward(self, slots, tokens, positions, visibility, capture=None):
        """One target pass (kdt_engine_forward). slots [n_req]; tokens / positions: one int
        array per request (n_b >= 1 each); visibility: one uint32 [n_b, W] per request (same W);
        capture: layer indices for hidden states (num_layers + 1 = final-norm output).
        Returns (logits float32 [total, V], hidden float32 [total, len(capture), D] or None)."""
        n_req = len(slots)
        counts = [len(t) for t in tokens]
        q_indptr = np.zeros(n_req + 1, np.int32)
        q_indptr[1:] = np.cumsum(counts)
        tok = np.ascontiguousarray(np.concatenate([np.asarray(t, np.int64) for t in tokens]))
        pos = np.ascontiguousarray(np.concatenate([np.asarray(p, np.int64) for p in positions]))
        vis = np.ascontiguousarray(np.concatenate([np.asarray(v, np.uint32) for v in visibility]))
        if vis.ndim != 2 or vis.shape[0] != tok.shape[0]:
            raise ValueError(f"Engine.forward: visibility rows {vis.shape} do not match "
                             f"{tok.shape[0]} tokens")
        sl = np.ascontiguousarray(np.asarray(slots, np.int32))
        total = int(q_indptr[-1])
        logits = np.empty((total, self.vocab_size), np.float32)
        cap = None if capture is None else np.ascontiguousarray(np.asarray(capture, np.int32))
        hidden = None
        if cap is not None:
            hidden = np.empty((total, len(cap), self.hidden_size), np.float32)
        self._call("kdt_engine_forward", self._handle, n_req, _ptr(sl), _ptr(q_indptr), _ptr(tok),
                   _ptr(pos), _ptr(vis), vis.shape[1], 0 if cap is None else len(cap),
                   None if cap is None else _ptr(cap), _ptr(logits),
                   None if hidden is None else _ptr(hidden))
        return logits, hidden

    def commit(self, slot: int, keep) -> None:
        """Keep the last forward's rows `keep` (node indices, ascending) of `slot` in order."""
        keep = np.ascontiguousarray(np.asarray(keep, np.int32))
        self._call("kdt_engine_commit", self._handle, int(slot), len(keep),
                   _ptr(keep) if len(keep) else None)

    # ------------------------------------------------------------ step level

    def add(self, prompt_ids) -> int:
        """Prefill one prompt into a free slot; returns the slot."""
        return self._add_many([prompt_ids])[0]

    def _add_many(self, prompts) -> list:
        prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        free = [s for s in range(self.max_slots) if s not in self._slots]
        if len(prompts) > len(free):
            raise RuntimeError(f"Engine.add: {len(prompts)} prompts but only {len(free)} of "
                               f"{self.max_slots} slots are free (raise max_slots)")
        for i, p in enumerate(prompts):
            if len(p) < 1:
                raise ValueError(f"Engine.add: prompt {i} is empty (need at least one token)")
            if len(p) >= self.max_seq:
                raise ValueError(f"Engine.add: prompt {i} has {len(p)} tokens, max_seq is "
                                 f"{self.max_seq}")
        slots = free[:len(prompts)]
        for s in slots:
            self._call("kdt_engine_reset_slot", self._handle, s)
        n_max = max(len(p) for p in prompts)
        W = (n_max + 31) // 32
        vis = []
        for p in prompts:  # causal: row i sees 0..i
            bits = np.tril(np.ones((len(p), len(p)), bool))
            v = np.zeros((len(p), W), np.uint32)
            for j in range(len(p)):
                v[bits[:, j], j // 32] |= np.uint32(1 << (j % 32))
            vis.append(v)
        logits, hidden = self.forward(slots, prompts, [np.arange(len(p)) for p in prompts], vis,
                                      self._final_hidden)
        start = 0
        for s, p in zip(slots, prompts):
            n = len(p)
            self.commit(s, np.arange(n))
            buf = np.empty((self.max_seq, self.hidden_size), np.float32)
            buf[:n] = hidden[start:start + n, 0]
            self._slots[s] = _Slot(committed=p.tolist(), hidden_buf=buf,
                                   out=[int(np.argmax(logits[start + n - 1]))])
            start += n
        return slots

    def release(self, slot: int) -> None:
        if slot not in self._slots:
            raise KeyError(f"Engine.release: slot {slot} is not active")
        del self._slots[slot]
        self._call("kdt_engine_reset_slot", self._handle, int(slot))

    def tokens(self, slot: int) -> list:
        return list(self._slots[slot].out)

    def step(self, mode: str = "ar", budget: int = 63, drafter=None, slots=None) -> dict:
        """Advance every active slot (or `slots`) by one AR step or one DDTree round in one
        batched target forward; returns {slot: tokens generated since the last step}."""
        slots = sorted(self._slots) if slots is None else list(slots)
        for s in slots:
            if s not in self._slots:
                raise KeyError(f"Engine.step: slot {s} is not active")
        if slots:
            self._round(slots, mode, budget, self._drafters_for(drafter, slots, mode), None)
        out = {}
        for s in slots:
            st = self._slots[s]
            out[s] = st.out[st.reported:]
            st.reported = len(st.out)
        return out

    def _drafters_for(self, drafter, slots, mode) -> dict:
        if mode != "ddtree":
            return {}
        if isinstance(drafter, dict):
            missing = [s for s in slots if s not in drafter]
            if missing:
                raise ValueError(f"Engine.step: no drafter for slots {missing}")
            return drafter
        if drafter is None or drafter == "block":
            drafter = self.block_drafter()
        elif isinstance(drafter, str):
            raise ValueError(f"Engine.step: drafter {drafter!r}: the oracle needs the true "
                             "continuation; use generate(), or pass drafter objects per slot")
        return {s: drafter for s in slots}

    def block_drafter(self):
        """The block drafter stored with the weights (loaded once): its numpy backend for the CPU
        engine (about 1 ms per draft here, against about 0.5 s for the torch backend on this
        loaded 2-core machine), its torch backend on the GPU for the CUDA engine."""
        if self._block_drafter is None:
            from engine.drafters.block import BlockDrafter  # lazily: another area's module

            if self.device == "cpu":
                self._block_drafter = BlockDrafter.from_dir(self.weights_dir, backend="numpy")
            else:
                self._block_drafter = BlockDrafter.from_dir(self.weights_dir, backend="torch",
                                                            device="cuda")
        return self._block_drafter

    def _round(self, slots, mode, budget, drafters, stats) -> None:
        """One AR step (a one-node tree) or DDTree round for `slots`, in one target forward."""
        from . import tree as native_tree  # the native tree build / accept kernels (CPU)

        t0 = time.perf_counter()
        states = [self._slots[s] for s in slots]
        roots = [st.out[-1] for st in states]
        seq_lens = np.array([len(st.committed) for st in states], np.int64)
        if mode == "ar":
            tree = _OneNodeTree.make(roots, seq_lens)
        elif mode == "ddtree":
            k = min(int(budget), self.vocab_size)
            drafts = [drafters[s].draft(np.asarray(st.committed, np.int64), st.out[-1],
                                        st.hidden, k) for s, st in zip(slots, states)]
            shapes = {np.asarray(lp).shape for lp, _ in drafts}
            if len(shapes) != 1:
                raise ValueError(f"Engine.step: drafters returned different [L, K] shapes {shapes}")
            top_logp = np.ascontiguousarray(np.stack([np.asarray(lp, np.float32) for lp, _ in drafts]))
            top_ids = np.ascontiguousarray(np.stack([np.asarray(i, np.int64) for _, i in drafts]))
            tree = native_tree.build_tree(top_logp, top_ids, int(budget),
                                          np.asarray(roots, np.int64), seq_lens, device="cpu")
        else:
            raise ValueError(f"Engine: mode={mode!r} must be 'ar' or 'ddtree'")
        nn = np.asarray(tree.num_nodes)
        for s, P, n in zip(slots, seq_lens, nn):
            if P + n > self.max_seq:
                raise RuntimeError(f"Engine: slot {s} holds {P} rows; a tree of {n} nodes "
                                   f"overflows max_seq {self.max_seq} (raise max_seq)")
        t1 = time.perf_counter()
        logits, hidden = self.forward(
            slots, [tree.tokens[b, :n] for b, n in enumerate(nn)],
            [tree.positions[b, :n] for b, n in enumerate(nn)],
            [tree.visibility[b, :n] for b, n in enumerate(nn)], self._final_hidden)
        t2 = time.perf_counter()
        n_slots = tree.tokens.shape[1]
        target_argmax = np.full((len(slots), n_slots), -1, np.int64)
        start = 0
        for b, n in enumerate(nn):
            target_argmax[b, :n] = np.argmax(logits[start:start + n], axis=-1)
            start += int(n)
        acc = native_tree.accept_greedy(tree, target_argmax, device="cpu")
        if np.any(acc.status != 0):
            raise RuntimeError(f"Engine: accept walk status {acc.status.tolist()} on trees built "
                               "by kdt_tree_build (a bug)")
        start = 0
        for b, (s, st) in enumerate(zip(slots, states)):
            length = int(acc.accept_len[b])
            path = acc.accept_index[b, :length].astype(np.int64)
            self.commit(s, path)
            P = len(st.committed)
            st.hidden_buf[P:P + length] = hidden[start + path, 0]
            st.committed.extend(int(t) for t in tree.tokens[b, path])
            st.out.extend(int(t) for t in tree.tokens[b, path[1:]])
            st.out.append(int(acc.bonus[b]))
            st.accept_lengths.append(length)
            st.tree_sizes.append(int(nn[b]))
            start += int(nn[b])
        if stats is not None:
            stats.target_forwards += 1
            stats.rounds += 1
            stats.draft_seconds += t1 - t0
            stats.forward_seconds += t2 - t1

    # ------------------------------------------------------------ whole generations

    def generate(self, prompt_ids, max_new_tokens: int, mode: str = "ar", budget: int = 63,
                 drafter=None, oracle_seed: int = 0) -> GenerateResult:
        """Greedy decode of max_new_tokens new tokens per prompt (see the class docstring)."""
        single = len(prompt_ids) > 0 and np.isscalar(prompt_ids[0])
        prompts = [np.asarray(p, np.int64).reshape(-1) for p in ([prompt_ids] if single else prompt_ids)]
        if not prompts:
            raise ValueError("Engine.generate: prompt_ids is empty")
        if max_new_tokens < 1:
            raise ValueError(f"Engine.generate: max_new_tokens = {max_new_tokens}, need >= 1")
        if mode not in ("ar", "ddtree"):
            raise ValueError(f"Engine.generate: mode={mode!r} must be 'ar' or 'ddtree'")
        width = 1 if mode == "ar" else int(budget) + 1
        need = max(len(p) for p in prompts) + max_new_tokens + width
        if need > self.max_seq:
            raise ValueError(f"Engine.generate: longest prompt + max_new_tokens + tree width = "
                             f"{need} exceeds max_seq {self.max_seq} (raise max_seq)")
        per_request = None
        if mode == "ddtree":
            per_request = self._resolve_drafter(drafter, prompts, max_new_tokens, oracle_seed)
        stats = EngineStats(mode=mode, device=self.device, budget=int(budget) if mode == "ddtree" else 0)
        t0 = time.perf_counter()
        slots = self._add_many(prompts)
        stats.target_forwards += 1
        stats.forward_seconds += time.perf_counter() - t0
        try:
            drafters = {} if per_request is None else dict(zip(slots, per_request))
            while True:
                active = [s for s in slots if len(self._slots[s].out) < max_new_tokens]
                if not active:
                    break
                self._round(active, mode, budget, drafters, stats)
            stats.seconds = time.perf_counter() - t0
            tokens = [np.array(self._slots[s].out[:max_new_tokens], np.int64) for s in slots]
            stats.accept_lengths = [list(self._slots[s].accept_lengths) for s in slots]
            stats.tree_sizes = [list(self._slots[s].tree_sizes) for s in slots]
            stats.new_tokens = sum(len(t) for t in tokens)
        finally:
            for s in slots:
                if s in self._slots:
                    self.release(s)
        return GenerateResult(tokens=tokens[0] if single else tokens, stats=stats)

    def _resolve_drafter(self, drafter, prompts, max_new_tokens, seed) -> list:
        if drafter is None or drafter == "block":
            return [self.block_drafter()] * len(prompts)
        if isinstance(drafter, str):
            name, _, q = drafter.partition(":")
            if name != "oracle":
                raise ValueError(f"Engine.generate: drafter={drafter!r}: expected None, 'block', "
                                 "'oracle' or 'oracle:<quality in [0, 1]>'")
            try:
                quality = float(q) if q else DEFAULT_ORACLE_QUALITY
            except ValueError:
                raise ValueError(f"Engine.generate: drafter={drafter!r}: quality {q!r} is not a "
                                 "number") from None
            if not 0.0 <= quality <= 1.0:
                raise ValueError(f"Engine.generate: drafter={drafter!r}: quality outside [0, 1]")
            return self.oracle_drafters(prompts, max_new_tokens, quality, seed)
        if isinstance(drafter, (list, tuple)):
            if len(drafter) != len(prompts) or not all(hasattr(d, "draft") for d in drafter):
                raise ValueError(f"Engine.generate: a list of drafters needs one object with "
                                 f"draft() per prompt ({len(prompts)}), got {len(drafter)}")
            return list(drafter)
        if not hasattr(drafter, "draft"):
            raise TypeError(f"Engine.generate: drafter {type(drafter).__name__} has no draft()")
        return [drafter] * len(prompts)

    def oracle_drafters(self, prompts, max_new_tokens: int, quality: float, seed: int = 0,
                        depth: int = 15) -> list:
        """One NoisyOracleDrafter per prompt, handed the true greedy continuation (computed here
        by AR, max_new_tokens + depth + 1 tokens): build them before timing a generate."""
        from engine.drafters.oracle import NoisyOracleDrafter  # lazily: another area's module

        prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        truth = self.generate(prompts, max_new_tokens + depth + 1, mode="ar").tokens
        return [NoisyOracleDrafter(np.concatenate([p, t]), self.vocab_size, depth=depth,
                                   quality=quality, seed=seed + i)
                for i, (p, t) in enumerate(zip(prompts, truth))]
