"""Tree-verify attention over the MLA latent cache: libkdtree's kdt_verify_attention.

Shapes (DDTREE.md section 6; the C contract is the comment in cuda/include/kdtree/kdtree.h):

    q_lat      [total_q, H, d_latent]          float32 or bfloat16 (see dtypes below)
    q_pe       [total_q, H, d_rope]            same dtype as q_lat
    kv_cache   [total_kv, d_latent + d_rope]   same dtype: c_kv then k_pe per cache row
    q_indptr   [bs + 1] int32                  request b owns query rows q_indptr[b]:q_indptr[b+1]
    kv_indptr  [bs + 1] int32                  and cache rows kv_indptr[b]:kv_indptr[b+1]; the last
                                               n_b of those are its tree nodes, the rest its prefix
    visibility [total_q, W] uint32             bit j of row i: node i sees tree node j
    -> out [total_q, H, d_latent] float32, lse [total_q, H] float32 (natural log)

dtypes: float32 (numpy or torch), torch.bfloat16, or numpy uint16 holding raw bfloat16 bits.
All array arguments are one kind (numpy or torch, engine.native._lib.Call); outputs follow it.
torch CUDA tensors run on torch's current stream with no host sync, provided max_tree and
max_kv are given (else the index pointers are read back to size the grid).

Paths (which implementation runs; `path=` or KDT_VERIFY_PATH in the environment, read by the
library on every call): "auto" (default: the fastest for the device and dtype), "cpu" (the CPU
backend, double precision), "simt" (CUDA fp32 SIMT kernels, any shape), "mma" (CUDA mma.sync
tensor cores: bfloat16, d_latent 512, d_rope 64), "sm90a" (CUDA wgmma, H100/H200 builds with
sm_90a). A path that cannot take the call raises with the library's reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os

import numpy as np

from ._lib import Call, DeviceBuffer, _is_torch, _torch, library

FN = "kdt_verify_attention"
DTYPE_F32, DTYPE_BF16 = 0, 1  # kdt_dtype

PATHS = ("auto", "cpu", "simt", "mma", "sm90a")
CUDA_PATHS = ("simt", "mma", "sm90a")
_SIG_SET = False


@contextlib.contextmanager
def forced_path(path: str | None):
    """KDT_VERIFY_PATH set to `path` for the duration of a call (None: left as it is). The
    variable is process-wide: do not race it from several threads."""
    if path is None:
        yield
        return
    if path not in PATHS:
        raise ValueError(f"{FN}: path = {path!r} is not one of {', '.join(PATHS)}")
    old = os.environ.get("KDT_VERIFY_PATH")
    os.environ["KDT_VERIFY_PATH"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["KDT_VERIFY_PATH"]
        else:
            os.environ["KDT_VERIFY_PATH"] = old


def _lib():
    """The library with kdt_verify_attention's ctypes signatures set (once per process)."""
    global _SIG_SET
    lib = library()
    if not _SIG_SET:
        i32, p = ctypes.c_int32, ctypes.c_void_p
        f = lib.cdll.kdt_verify_attention_workspace_size
        f.restype, f.argtypes = ctypes.c_size_t, [ctypes.c_int] + [i32] * 6
        # (backend, stream, dtype, bs, H, d_latent, d_rope, total_q, total_kv, max_tree, max_kv,
        #  q_indptr, kv_indptr, q_lat, q_pe, kv_cache, visibility, vis_words, softmax_scale,
        #  out, lse, workspace, workspace_bytes)
        f = lib.cdll.kdt_verify_attention
        f.restype = ctypes.c_int
        f.argtypes = ([ctypes.c_int, p, ctypes.c_int] + [i32] * 8 + [p] * 6
                      + [i32, ctypes.c_float, p, p, p, ctypes.c_size_t])
        _SIG_SET = True
    return lib


def _cache_dtype(name: str, x) -> int:
    """kdt_dtype of one of q_lat / q_pe / kv_cache."""
    if _is_torch(x):
        torch = _torch()
        table = {torch.float32: DTYPE_F32, torch.bfloat16: DTYPE_BF16}
    else:
        table = {np.dtype(np.float32): DTYPE_F32, np.dtype(np.uint16): DTYPE_BF16}
    if x.dtype not in table:
        raise ValueError(f"{FN}: {name}: dtype {x.dtype}, expected float32 or bfloat16 "
                         "(torch.bfloat16, or numpy uint16 holding bfloat16 bits)")
    return table[x.dtype]


def _as_bytes(name: str, x):
    """A bfloat16 tensor / uint16 array viewed as uint8 (the same memory, last dim doubled)."""
    contiguous = x.flags["C_CONTIGUOUS"] if isinstance(x, np.ndarray) else x.is_contiguous()
    if not contiguous:
        raise ValueError(f"{FN}: {name}: not C-contiguous (use np.ascontiguousarray or .contiguous())")
    if isinstance(x, np.ndarray):
        return x.view(np.uint8)
    torch = _torch()
    if x.numel() == 0:  # torch refuses to view empty tensors with odd strides (d_rope = 0)
        return torch.empty((*x.shape[:-1], 2 * x.shape[-1]), dtype=torch.uint8, device=x.device)
    return x.view(torch.uint8)


def check_indptrs(q_indptr: np.ndarray, kv_indptr: np.ndarray, total_q: int, total_kv: int,
                  max_tree: int, max_kv: int) -> None:
    """The index-pointer contract (kdtree.h), checked on the host with the C backend's wording.
    The CUDA kernels cannot report a broken contract without a sync, so host arrays are
    checked here before every call."""
    qi, ki = np.asarray(q_indptr, np.int64), np.asarray(kv_indptr, np.int64)
    if qi[0] != 0 or ki[0] != 0:
        raise ValueError(f"{FN}: q_indptr[0] = {qi[0]} and kv_indptr[0] = {ki[0]} must both be 0")
    n, kv = np.diff(qi), np.diff(ki)
    for what, bad in (("q_indptr or kv_indptr decreases", (n < 0) | (kv < 0)),
                      (f"tree size exceeds max_tree = {max_tree}", n > max_tree),
                      ("kv_len is smaller than its tree size", kv < n),
                      (f"kv_len exceeds max_kv = {max_kv}", kv > max_kv)):
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"{FN}: request {b}: {what} (n = {n[b]}, kv_len = {kv[b]})")
    if qi[-1] != total_q or ki[-1] != total_kv:
        raise ValueError(f"{FN}: q_indptr[bs] = {qi[-1]} and kv_indptr[bs] = {ki[-1]} must equal "
                         f"total_q = {total_q} and total_kv = {total_kv}")


def verify_attention(q_lat, q_pe, kv_cache, q_indptr, kv_indptr, visibility, softmax_scale,
                     device: str = "cpu", *, max_tree: int | None = None,
                     max_kv: int | None = None, path: str | None = None):
    """Returns (out, lse) as described in the module docstring, computed on `device` by `path`
    (None: KDT_VERIFY_PATH as set, else auto)."""
    lib = _lib()
    call = Call(lib, FN, device)
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if len(x.shape) != (2 if name == "kv_cache" else 3):
            raise ValueError(f"{FN}: {name}: shape {tuple(x.shape)} has the wrong rank "
                             "(q_lat, q_pe [total_q, H, d]; kv_cache [total_kv, d_latent + d_rope])")
    total_q, H, d_latent = (int(s) for s in q_lat.shape)
    d_rope, total_kv = int(q_pe.shape[-1]), int(kv_cache.shape[0])
    dtype = _cache_dtype("q_lat", q_lat)
    for name, x in (("q_pe", q_pe), ("kv_cache", kv_cache)):
        if _cache_dtype(name, x) != dtype:
            raise ValueError(f"{FN}: {name}: dtype {x.dtype} differs from q_lat's {q_lat.dtype}")
    bs = int(q_indptr.shape[0]) - 1
    if bs < 1:
        raise ValueError(f"{FN}: q_indptr: shape {tuple(q_indptr.shape)}, expected [bs + 1] with bs >= 1")
    W = int(visibility.shape[-1]) if len(visibility.shape) == 2 else -1
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"{FN}: softmax_scale = {scale} is not finite")

    # Host copies of the index pointers size the grid and check the contract (see check_indptrs).
    host = lambda t: t.detach().cpu().numpy() if _is_torch(t) else np.asarray(t)  # noqa: E731
    if max_tree is None or max_kv is None or not _is_torch(q_indptr):
        qi, ki = host(q_indptr), host(kv_indptr)
        if qi.shape != ki.shape:
            raise ValueError(f"{FN}: kv_indptr has shape {ki.shape}, q_indptr {qi.shape}")
        max_tree = max(1, int(np.diff(qi).max())) if max_tree is None else max_tree
        max_kv = int(np.diff(ki).max()) if max_kv is None else max_kv
        check_indptrs(qi, ki, total_q, total_kv, max_tree, max_kv)

    b = 2 if dtype == DTYPE_BF16 else 1  # the bf16 views are uint8 with the last dim doubled
    el = np.uint8 if dtype == DTYPE_BF16 else np.float32
    view = _as_bytes if dtype == DTYPE_BF16 else (lambda name, x: x)
    p_q_lat = call.input("q_lat", view("q_lat", q_lat), el, (total_q, H, d_latent * b))
    p_q_pe = call.input("q_pe", view("q_pe", q_pe), el, (total_q, H, d_rope * b))
    p_kv = call.input("kv_cache", view("kv_cache", kv_cache), el, (total_kv, (d_latent + d_rope) * b))
    p_qi = call.input("q_indptr", q_indptr, np.int32, (bs + 1,))
    p_ki = call.input("kv_indptr", kv_indptr, np.int32, (bs + 1,))
    p_vis = call.input("visibility", visibility, np.uint32, (total_q, W))
    p_out = call.output("out", np.float32, (total_q, H, d_latent))
    p_lse = call.output("lse", np.float32, (total_q, H))

    ws_bytes = lib.cdll.kdt_verify_attention_workspace_size(call.backend, bs, H, d_latent, total_q,
                                                            max_tree, max_kv)
    ws, p_ws = None, None
    if ws_bytes:
        if call.kind == "torch":
            ws = _torch().empty(ws_bytes, dtype=_torch().uint8, device=call.torch_device)
            p_ws = ws.data_ptr()
        else:
            ws = DeviceBuffer(lib, ws_bytes)
            p_ws = ws.ptr
    with forced_path(path):
        res = call.run(call.backend, call.stream, dtype, bs, H, d_latent, d_rope, total_q,
                       total_kv, max_tree, max_kv, p_qi, p_ki, p_q_lat, p_q_pe, p_kv, p_vis, W,
                       scale, p_out, p_lse, p_ws, ws_bytes)
    if isinstance(ws, DeviceBuffer):
        ws.close()
    return res["out"], res["lse"]
