"""The native engine: an FP32 MLA + MoE target (libkdtree) decoding greedily with AR or DDTree.

    eng = Engine("weights/tiny", device="cpu")          # or device="cuda"
    r = eng.generate(prompt_ids, 64, mode="ddtree", budget=63, drafter="oracle:0.8")
    r.tokens, r.stats.mean_accept_length, r.stats.target_forwards

The weights folder is the one `python -m engine.cli.model init --out DIR` writes (docs/MODEL.md);
the library reads it itself (cuda/src/model_load.cpp). One code path serves both modes: an AR
step is the verify of a one-node tree (the root alone), a DDTree round the verify of the
drafted tree; the library computes each token's row with arithmetic that does not depend on
the batch, so DDTree output equals AR output token for token.

A round (engine/native/round.py) runs on the engine's device from drafting to commit and ends
with one small copy home; on CUDA it is a CUDA graph per (batch bucket, mode, budget, drafter).
The slots' state lives on the device: their committed lengths (the library's), the final-norm
hidden states of their committed tokens (the drafters' context) and their next root tokens.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from ._lib import BACKEND_CPU, BACKEND_CUDA, NativeError, library
from .engine_abi import EngineABI, bind
from .round import Round

DEFAULT_ORACLE_QUALITY = 0.8


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
    prefill_seconds: float = 0.0  # the prompts' batched forward + their state on the device
    round_seconds: float = 0.0  # the decode rounds (each ends with its one host sync)
    # Per phase of the round (round.PHASES), summed over the rounds; only with profile=True
    # (CUDA events around per-phase graphs on CUDA, the monotonic clock on the CPU).
    phase_seconds: dict = dataclasses.field(default_factory=dict)

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
    length: int  # committed rows in the cache (prompt + accepted); the device holds the same
    out: list  # generated tokens so far; out[-1] is the root (not yet in the cache)
    reported: int = 0  # how many of `out` step() has returned already
    accept_lengths: list = dataclasses.field(default_factory=list)
    tree_sizes: list = dataclasses.field(default_factory=list)


def _bucket(n: int) -> int:
    """The batch bucket of n requests: the next power of two (rows past n are padding)."""
    b = 1
    while b < n:
        b *= 2
    return b


class Engine(EngineABI):
    """FP32 target model in libkdtree with a latent KV cache per request slot.

    Engine(weights_dir, device="cpu"|"cuda", max_slots=32, max_seq=1024, graphs=None,
           profile=False)
      max_slots requests at once, each with up to max_seq cache rows (prompt + generated +
      budget + 1 must fit; positions must be < max_seq). graphs: capture each round as a CUDA
      graph (default: on for CUDA, unless KDTREE_GRAPHS=0; the CPU backend never does).
      profile: time every phase of every round (EngineStats.phase_seconds; slower).

    Whole generations:
      generate(prompt_ids, max_new_tokens, mode="ar"|"ddtree", budget=63, drafter=None)
        prompt_ids: one list of token ids, or a list of lists (a batch decoded together).
        drafter: None or "block" = the block drafter stored with the weights
          (engine.drafters.block, batched on the engine's device); "oracle" or
          "oracle:<quality>" = the noisy ORACLE (engine.drafters.oracle.OracleDrafter, handed
          the true greedy continuation, which this engine computes first by AR and does not
          count in the stats); an OracleBatch from oracle_drafters() (build it before timing);
          or any object with `depth` and `draft_batch(DraftInput, k)` (engine/native/round.py).
        Returns GenerateResult(tokens, stats): tokens int64 [max_new_tokens] (a list of them for
        a batch), stats an EngineStats (accepted lengths per round, target forwards, seconds).

    Step level (for a server; one batched round per step):
      add(prompt_ids) -> slot        prefills the prompt; the first new token (the prefill's
                                     argmax) is returned by the slot's next step()
      step(mode, budget, drafter) -> {slot: [new tokens]}
                                     advances every active slot (or `slots`) by one AR step or
                                     one DDTree round; drafter None/"block" or an object as in
                                     generate; K = min(budget, vocab)
      release(slot)                  frees the slot for reuse
      tokens(slot)                   every token generated for the slot so far

    Low level (engine_abi.EngineABI): forward(...) and commit(...) mirror kdt_engine_forward /
    kdt_engine_commit (the host path, which the prefill uses); verify(...) and
    commit_accepted(...) mirror the device path's kdt_engine_verify / kdt_engine_commit_accepted
    on torch tensors.
    """

    def __init__(self, weights_dir, device: str = "cpu", max_slots: int = 32,
                 max_seq: int = 1024, graphs: bool | None = None, profile: bool = False):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"Engine: device={device!r} must be 'cpu' or 'cuda'")
        import torch

        self.weights_dir = Path(weights_dir)
        self.device = device
        self._lib = bind(library())
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
        self._oracles: dict = {}
        self._rounds: dict = {}
        # The slots' state on the device; slot max_slots is the scratch slot (padding rows).
        self.torch_device = torch.device("cuda", torch.cuda.current_device()) \
            if device == "cuda" else torch.device("cpu")
        self.scratch_slot = self.max_slots
        self.lengths = self._lengths_view(torch)                    # int32 [slots + 1]
        self.hidden_ctx = torch.zeros((self.max_slots + 1, self.max_seq, self.hidden_size),
                                      dtype=torch.float32, device=self.torch_device)
        self.next_root = torch.zeros(self.max_slots + 1, dtype=torch.int64,
                                     device=self.torch_device)
        if graphs is None:
            graphs = os.environ.get("KDTREE_GRAPHS", "1") != "0"
        self.graphs = bool(graphs) and device == "cuda"
        self.profile = bool(profile)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._rounds.clear()  # graphs first: they point into the library's buffers
            self._lib.cdll.kdt_engine_destroy(self._handle)
            self._handle = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ step level

    def add(self, prompt_ids) -> int:
        """Prefill one prompt into a free slot; returns the slot."""
        return self._add_many([prompt_ids])[0]

    def _add_many(self, prompts) -> list:
        import torch

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
        roots = []
        for s, p in zip(slots, prompts):
            n = len(p)
            self.commit(s, np.arange(n))
            self.hidden_ctx[s, :n] = torch.from_numpy(hidden[start:start + n, 0]).to(self.torch_device)
            root = int(np.argmax(logits[start + n - 1]))
            roots.append(root)
            self._slots[s] = _Slot(length=n, out=[root])
            start += n
        self.next_root[torch.tensor(slots, device=self.torch_device)] = torch.tensor(
            roots, dtype=torch.int64, device=self.torch_device)
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
        batched round; returns {slot: tokens generated since the last step}."""
        slots = sorted(self._slots) if slots is None else list(slots)
        for s in slots:
            if s not in self._slots:
                raise KeyError(f"Engine.step: slot {s} is not active")
        if slots:
            self._round(slots, mode, budget, self._step_drafter(drafter, mode), None)
        out = {}
        for s in slots:
            st = self._slots[s]
            out[s] = st.out[st.reported:]
            st.reported = len(st.out)
        return out

    def _step_drafter(self, drafter, mode):
        if mode != "ddtree":
            return None
        if drafter is None or drafter == "block":
            return self.block_drafter()
        if isinstance(drafter, str):
            raise ValueError(f"Engine.step: drafter {drafter!r}: the oracle needs the true "
                             "continuation; use generate(), or pass an OracleBatch's drafter "
                             "after assigning its slots")
        return _check_drafter(drafter, "Engine.step")

    def block_drafter(self):
        """The block drafter stored with the weights (loaded once), batched on the engine's
        device (torch, CPU or CUDA)."""
        if self._block_drafter is None:
            from engine.drafters.block import BlockDrafter  # lazily: torch and the weights

            self._block_drafter = BlockDrafter.from_dir(self.weights_dir, backend="torch",
                                                        device=self.device)
        return self._block_drafter

    def _round_for(self, n: int, mode: str, budget: int, drafter) -> Round:
        key = (_bucket(n), mode, int(budget) if mode == "ddtree" else 0, id(drafter))
        r = self._rounds.get(key)
        if r is None or r.drafter is not drafter:
            r = Round(self, key[0], mode, key[2], drafter, self.graphs, self.profile)
            self._rounds[key] = r
        return r

    def _round(self, slots, mode, budget, drafter, stats) -> None:
        """One AR step (a one-node tree) or DDTree round for `slots` (buckets of at most the
        largest bucket; one round each)."""
        import torch

        if mode not in ("ar", "ddtree"):
            raise ValueError(f"Engine: mode={mode!r} must be 'ar' or 'ddtree'")
        width = int(budget) + 1 if mode == "ddtree" else 1
        if mode == "ddtree" and not 1 <= int(budget) <= 1024:
            raise ValueError(f"Engine: budget {budget} is outside [1, 1024]")
        for s in slots:
            if self._slots[s].length + width > self.max_seq:
                raise RuntimeError(f"Engine: slot {s} holds {self._slots[s].length} rows; a tree "
                                   f"of {width} nodes overflows max_seq {self.max_seq} (raise "
                                   "max_seq)")
        cap = _bucket(self.max_slots)
        with torch.no_grad():
            for i in range(0, len(slots), cap):
                chunk = slots[i:i + cap]
                rnd = self._round_for(len(chunk), mode, budget, drafter)
                t0 = time.perf_counter()
                res = rnd.run(chunk)
                if stats is not None:
                    stats.round_seconds += time.perf_counter() - t0
                    stats.target_forwards += 1
                    stats.rounds += 1
                    for p, sec in (rnd.last_phase_seconds or {}).items():
                        stats.phase_seconds[p] = stats.phase_seconds.get(p, 0.0) + sec
                for row, s in enumerate(chunk):
                    st = self._slots[s]
                    a, nodes = int(res[row, 0]), int(res[row, 1])
                    st.out.extend(int(t) for t in res[row, 2:2 + a])
                    st.length += a
                    st.accept_lengths.append(a)
                    st.tree_sizes.append(nodes)

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
        oracle = None
        drafter_obj = None
        if mode == "ddtree":
            drafter_obj, oracle = self._resolve_drafter(drafter, prompts, max_new_tokens,
                                                        oracle_seed)
        stats = EngineStats(mode=mode, device=self.device, budget=int(budget) if mode == "ddtree" else 0)
        t0 = time.perf_counter()
        slots = self._add_many(prompts)
        if oracle is not None:
            oracle.assign(self, slots)
        stats.target_forwards += 1
        stats.prefill_seconds = time.perf_counter() - t0
        try:
            while True:
                active = [s for s in slots if len(self._slots[s].out) < max_new_tokens]
                if not active:
                    break
                self._round(active, mode, budget, drafter_obj, stats)
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

    def _resolve_drafter(self, drafter, prompts, max_new_tokens, seed):
        """(the drafter object, the OracleBatch to assign to the slots or None)."""
        from engine.drafters.oracle import OracleBatch  # lazily: another area's module

        if drafter is None or drafter == "block":
            return self.block_drafter(), None
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
            drafter = self.oracle_drafters(prompts, max_new_tokens, quality, seed)
        if isinstance(drafter, OracleBatch):
            if len(drafter.truths) != len(prompts):
                raise ValueError(f"Engine.generate: the OracleBatch holds {len(drafter.truths)} "
                                 f"truths for {len(prompts)} prompts")
            return drafter.drafter, drafter
        return _check_drafter(drafter, "Engine.generate"), None

    def oracle_drafters(self, prompts, max_new_tokens: int, quality: float, seed: int = 0,
                        depth: int = 15):
        """An OracleBatch for these prompts: the engine's oracle of this quality (one per
        quality and depth, so that its rounds' graphs are reused) and each prompt's true greedy
        continuation (computed here by AR, max_new_tokens + depth + 1 tokens), seeded seed + i.
        Build it before timing a generate."""
        from engine.drafters.oracle import OracleBatch  # lazily: another area's module

        from .oracle import NativeOracleDrafter  # the oracle as one kernel

        prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        truth = self.generate(prompts, max_new_tokens + depth + 1, mode="ar").tokens
        key = (float(quality), int(depth))
        if key not in self._oracles:
            self._oracles[key] = NativeOracleDrafter(self.vocab_size, depth=depth, quality=quality)
        return OracleBatch(self._oracles[key], [np.concatenate([p, t]) for p, t in zip(prompts, truth)],
                           [seed + i for i in range(len(prompts))])


def _check_drafter(drafter, where: str):
    if not (hasattr(drafter, "draft_batch") and hasattr(drafter, "depth")):
        raise TypeError(f"{where}: drafter {type(drafter).__name__} has no depth and "
                        "draft_batch(DraftInput, k) (engine/native/round.py): the round drafts "
                        "every request at once on the engine's device")
    return drafter
