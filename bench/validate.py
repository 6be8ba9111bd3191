"""Checks of a timed output against the reference, made before any timing.

Each check returns a validation dict `{"ok": bool, "checked": what, ...}` (the record keeps it);
`ok` False carries `error`, naming the array, the request and the first differing index.
"""

from __future__ import annotations

import numpy as np

from bench.native_calls import to_numpy

__all__ = ["TREE_FIELDS", "ACCEPT_FIELDS", "check_exact", "rel_err", "check_close",
           "sample_requests"]

TREE_FIELDS = ("tokens", "parents", "depths", "positions", "first_child", "next_sibling",
               "visibility", "num_nodes", "scores")
ACCEPT_FIELDS = ("accept_index", "accept_len", "bonus", "status")


def sample_requests(bs: int, work_per_request: int, limit: int = 16384) -> list:
    """All requests when the reference is cheap (bs * work <= limit), else first, middle, last."""
    if bs * work_per_request <= limit:
        return list(range(bs))
    return sorted({0, bs // 2, bs - 1})


def check_exact(out: dict, ref, fields, rows=None, where: str = "") -> dict:
    """Bit-for-bit equality of out[f] (numpy or torch) and ref.f, on request rows `rows`."""
    for f in fields:
        if f not in out:
            return {"ok": False, "error": f"{where}output has no {f!r}"}
        got = to_numpy(out[f])
        want = np.asarray(getattr(ref, f))
        if got.dtype != want.dtype and got.dtype.itemsize == want.dtype.itemsize:
            got = got.view(want.dtype)  # uint32 visibility comes back from torch as int32 bits
        if rows is not None:
            got = got[rows]
        if got.shape != want.shape:
            return {"ok": False, "error": f"{where}{f}: shape {got.shape} != reference {want.shape}"}
        same = (got == want) if got.dtype.kind != "f" else (got.view(np.uint64 if got.itemsize == 8 else np.uint32)
                                                           == want.view(np.uint64 if want.itemsize == 8 else np.uint32))
        if not np.all(same):
            idx = tuple(int(i) for i in np.argwhere(~same)[0])
            req = (rows[idx[0]] if rows is not None else idx[0])
            return {"ok": False, "error": f"{where}{f}[{idx}] (request {req}) = {got[idx]} but the "
                                          f"reference has {want[idx]}"}
    return {"ok": True, "checked": "all requests" if rows is None else f"requests {list(rows)}",
            "compare": "bit for bit", "fields": list(fields)}


def rel_err(out, ref) -> float:
    """max|out - ref| / max|ref| over the finite reference entries (inf/NaN must match)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shape {out.shape} != reference {ref.shape}")
    finite = np.isfinite(ref)
    if not np.array_equal(finite, np.isfinite(out)):
        return float("inf")
    if not finite.any():
        return 0.0
    return float(np.abs(out[finite] - ref[finite]).max() / max(np.abs(ref[finite]).max(), 1e-30))


def check_close(pairs: dict, tol: float, checked: str) -> dict:
    """pairs: name -> (out, ref); ok when every rel_err <= tol."""
    errs = {name: rel_err(o, r) for name, (o, r) in pairs.items()}
    worst = max(errs, key=errs.get)
    v = {"ok": errs[worst] <= tol, "checked": checked, "rel_err": errs, "tol": tol,
         "metric": "max|out-ref| / max|ref|"}
    if not v["ok"]:
        v["error"] = f"{worst}: relative error {errs[worst]:.3g} > tol {tol:g} ({checked})"
    return v
