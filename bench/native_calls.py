"""Prepared native calls: the C ABI (cuda/include/kdtree/kdtree.h) called with every buffer
allocated beforehand, so a timed call is the kernel and nothing else.

`engine.native`'s wrappers check arguments and allocate outputs on every call, and the
attention wrapper reads the index pointers on the host (a device sync). That is right for an
API and wrong for a microbenchmark, so here each `prepare_*` returns a `Prepared`: `run()` is
one bare `kdt_*` call on the chosen backend (CUDA: torch's current stream, no sync) and `outputs`
are the buffers it writes, which the suites validate against the reference before timing.
Arrays are numpy on "cpu" and torch CUDA tensors on "cuda".
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

__all__ = ["Prepared", "prepare_tree_build", "prepare_tree_accept", "prepare_verify_attention",
           "to_numpy", "to_device"]

_BACKEND = {"cpu": 0, "cuda": 1}


@dataclass
class Prepared:
    run: object        # () -> None: one kdt_* call
    outputs: dict      # name -> array written by run()
    keep: tuple = ()   # inputs that must stay alive while run() may be called


def to_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    t = x.detach().cpu()
    if str(t.dtype) == "torch.uint32":
        return t.view(__import__("torch").int32).numpy().view(np.uint32)
    if str(t.dtype) == "torch.bfloat16":
        return t.float().numpy()
    return t.numpy()


def to_device(a: np.ndarray, device: str):
    """numpy -> numpy (cpu) or a torch CUDA tensor (uint32 travels as int32 bits)."""
    a = np.ascontiguousarray(a)
    if device == "cpu":
        return a
    import torch

    if a.dtype == np.uint32:
        a = a.view(np.int32)
    return torch.from_numpy(a).to("cuda")


def _alloc(device: str, shape, dtype):
    if device == "cpu":
        return np.empty(shape, dtype)
    import torch

    tdt = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
           np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32,
           np.dtype(np.uint32): torch.int32}[np.dtype(dtype)]
    return torch.empty(shape, dtype=tdt, device="cuda")


def _ptr(x) -> int:
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def _stream(device: str):
    if device == "cpu":
        return None
    import torch

    return torch.cuda.current_stream().cuda_stream


def prepare_tree_build(lib, device: str, inp: dict, budget: int) -> Prepared:
    """kdt_tree_build on inputs `inp` (numpy: top_logp [bs,L,K], top_ids, root_ids, seq_lens)."""
    bs, L, K = inp["top_logp"].shape
    if K > budget:
        raise ValueError(f"prepare_tree_build: K={K} > budget={budget} (the ABI needs K <= budget)")
    ins = [to_device(inp[k], device) for k in ("top_logp", "top_ids", "root_ids", "seq_lens")]
    n, W = budget + 1, (budget + 32) // 32
    outs = {
        "tokens": _alloc(device, (bs, n), np.int64),
        "parents": _alloc(device, (bs, n), np.int32),
        "depths": _alloc(device, (bs, n), np.int32),
        "positions": _alloc(device, (bs, n), np.int64),
        "first_child": _alloc(device, (bs, n), np.int64),
        "next_sibling": _alloc(device, (bs, n), np.int64),
        "visibility": _alloc(device, (bs, n, W), np.uint32),
        "num_nodes": _alloc(device, (bs,), np.int32),
        "scores": _alloc(device, (bs, n), np.float64),
    }
    args = ([_BACKEND[device], _stream(device), bs, L, K, budget] + [_ptr(x) for x in ins]
            + [_ptr(outs[k]) for k in outs])
    return Prepared(lambda: lib.call("kdt_tree_build", *args), outs, tuple(ins))


def prepare_tree_accept(lib, device: str, tree, target_argmax: np.ndarray) -> Prepared:
    """kdt_tree_accept on a (numpy) tree and target_argmax i64 [bs, n]."""
    bs, n = np.asarray(tree.tokens).shape
    ins = [to_device(np.asarray(a), device) for a in
           (tree.tokens, tree.first_child, tree.next_sibling, tree.num_nodes, target_argmax)]
    outs = {
        "accept_index": _alloc(device, (bs, n), np.int32),
        "accept_len": _alloc(device, (bs,), np.int32),
        "bonus": _alloc(device, (bs,), np.int64),
        "status": _alloc(device, (bs,), np.int32),
    }
    args = ([_BACKEND[device], _stream(device), bs, n] + [_ptr(x) for x in ins]
            + [_ptr(outs[k]) for k in outs])
    return Prepared(lambda: lib.call("kdt_tree_accept", *args), outs, tuple(ins))


def _attention_signature(cdll) -> None:
    """ctypes signatures of the two verify-attention entry points (kdtree.h), set once."""
    f = cdll.kdt_verify_attention_workspace_size
    if f.argtypes is None:
        i32 = ctypes.c_int32
        f.argtypes = [ctypes.c_int] + [i32] * 6
        f.restype = ctypes.c_size_t
    g = cdll.kdt_verify_attention
    if g.argtypes is None:
        i32, vp = ctypes.c_int32, ctypes.c_void_p
        g.argtypes = ([ctypes.c_int, vp, ctypes.c_int] + [i32] * 8 + [vp] * 6
                      + [i32, ctypes.c_float, vp, vp, vp, ctypes.c_size_t])
        g.restype = ctypes.c_int


def prepare_verify_attention(lib, device: str, a: dict, bs: int, tree: int, prefix: int) -> Prepared:
    """kdt_verify_attention on `a` (bench.inputs.attention_inputs, tensors already on `device`;
    on "cpu" torch CPU tensors, whose data pointers the CPU backend reads directly)."""
    import torch

    _attention_signature(lib.cdll)
    total_q, H, d_latent = a["q_lat"].shape
    d_rope = a["q_pe"].shape[2]
    total_kv = a["kv_cache"].shape[0]
    dev = "cuda" if device == "cuda" else "cpu"
    out = torch.empty((total_q, H, d_latent), dtype=torch.float32, device=dev)
    lse = torch.empty((total_q, H), dtype=torch.float32, device=dev)
    dtype = 1 if a["q_lat"].dtype == torch.bfloat16 else 0
    backend = _BACKEND[device]
    max_kv = prefix + tree
    ws_bytes = int(lib.cdll.kdt_verify_attention_workspace_size(backend, bs, H, d_latent, total_q,
                                                                tree, max_kv))
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=dev)
    vp = ctypes.c_void_p
    args = [backend, _stream(device), dtype, bs, H, d_latent, d_rope, total_q, total_kv, tree,
            max_kv, vp(a["q_indptr"].data_ptr()), vp(a["kv_indptr"].data_ptr()),
            vp(a["q_lat"].data_ptr()), vp(a["q_pe"].data_ptr()), vp(a["kv_cache"].data_ptr()),
            vp(a["visibility"].data_ptr()), int(a["words"]), float(a["softmax_scale"]),
            vp(out.data_ptr()), vp(lse.data_ptr()), vp(ws.data_ptr()), ws_bytes]
    return Prepared(lambda: lib.call("kdt_verify_attention", *args), {"out": out, "lse": lse},
                    (a, ws))
