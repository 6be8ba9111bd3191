"""The native engine's C ABI (kdt_engine_* in kdtree.h) as methods, host path and device path.

`bind(lib)` sets the kdt_engine_* signatures on the loaded library (the other entry points'
are in _lib.py). `EngineABI` holds the calls that Engine (engine.py) inherits: the host path's
`forward` / `commit` on numpy arrays (the prefill uses it), the device path's `verify` /
`commit_accepted` on torch tensors of the engine's device (the round uses it), `seq_len`, and
the lengths array shared with the library. Engine.__init__ creates the handle and sets what
these read: `_lib`, `_handle`, `device`, `torch_device`, `max_slots`, `vocab_size`,
`hidden_size`.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ._lib import NativeError

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
    "kdt_engine_lengths": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_void_p)]),
    # (engine, stream, n_req, n, slots, tokens, positions, visibility, vis_words, argmax,
    #  hidden, logits)
    "kdt_engine_verify": (ctypes.c_int, [_P, _P, _I32, _I32, _P, _P, _P, _P, _I32, _P, _P, _P]),
    # (engine, stream, n_req, n, slots, accept_index, accept_len)
    "kdt_engine_commit_accepted": (ctypes.c_int, [_P, _P, _I32, _I32, _P, _P, _P]),
}


def bind(lib):
    for name, (res, args) in _SIG.items():
        f = getattr(lib.cdll, name, None)
        if f is None:
            raise NativeError(name, 2, f"{lib.path} has no {name}: rebuild it from this tree "
                                       "(cuda/build.sh)")
        f.restype, f.argtypes = res, args
    return lib


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class _DeviceLengths:
    """The library's int32 [n] lengths in device memory, seen by torch (__cuda_array_interface__)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4", "data": (ptr, False),
                                         "version": 3, "strides": None}


class EngineABI:
    """The kdt_engine_* calls on an Engine's handle (see the module docstring)."""

    def _call(self, fn: str, *args) -> None:
        self._lib.check(fn, getattr(self._lib.cdll, fn)(*args))

    def _dim(self, name: str) -> int:
        v = ctypes.c_int64()
        self._call("kdt_engine_dim", self._handle, name.encode(), ctypes.byref(v))
        return int(v.value)

    def _lengths_view(self, torch):
        """The library's lengths array as a torch tensor sharing its memory."""
        ptr = ctypes.c_void_p()
        self._call("kdt_engine_lengths", self._handle, ctypes.byref(ptr))
        n = self.max_slots + 1
        if self.device == "cuda":
            return torch.as_tensor(_DeviceLengths(ptr.value, n), device=self.torch_device)
        arr = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(ptr.value))
        return torch.from_numpy(arr)

    def _stream(self):
        if self.device != "cuda":
            return None
        import torch

        return torch.cuda.current_stream(self.torch_device).cuda_stream

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

    def verify(self, rows, tokens, positions, visibility):
        """The device path's target pass (kdt_engine_verify) on torch tensors of the engine's
        device: rows int64 [B] (slots; the scratch slot for padding), tokens / positions int64
        [B, n], visibility uint32 [B, n, W]. Returns (argmax int64 [B, n], hidden float32
        [B, n, D]) without synchronising."""
        import torch

        B, n = tokens.shape
        rows32 = rows.to(torch.int32)
        tokens, positions = tokens.contiguous(), positions.contiguous()
        visibility = visibility.contiguous()
        argmax = torch.empty((B, n), dtype=torch.int64, device=self.torch_device)
        hidden = torch.empty((B, n, self.hidden_size), dtype=torch.float32,
                             device=self.torch_device)
        self._call("kdt_engine_verify", self._handle, self._stream(), B, n, rows32.data_ptr(),
                   tokens.data_ptr(), positions.data_ptr(), visibility.data_ptr(),
                   visibility.shape[2], argmax.data_ptr(), hidden.data_ptr(), None)
        return argmax, hidden

    def commit_accepted(self, rows, accept_index, accept_len) -> None:
        """The device path's commit (kdt_engine_commit_accepted): rows int64 [B],
        accept_index int32 [B, n], accept_len int32 [B] as kdt_tree_accept writes them."""
        import torch

        B, n = accept_index.shape
        rows32 = rows.to(torch.int32)
        accept_index, accept_len = accept_index.contiguous(), accept_len.contiguous()
        self._call("kdt_engine_commit_accepted", self._handle, self._stream(), B, n,
                   rows32.data_ptr(), accept_index.data_ptr(), accept_len.data_ptr())
