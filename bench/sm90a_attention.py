"""Check and time the sm90a (Hopper wgmma) verify-attention path on its own.

    KDTREE_LIB=build/h200/libkdtree.so python3 -m bench.sm90a_attention [--check] [--time]

Calls kdt_verify_attention with KDT_VERIFY_PATH=sm90a (the sm90a kernel only,
KDT_ERR_UNSUPPORTED where it cannot run) on torch CUDA tensors (verify_attention_sm90a.cu says
what the kernel does; docs/BENCHMARKS.md gives the H200 timings of the six variants it once had).
--check: fresh random bf16 inputs (seed printed) at the MLA shape (d_latent 512, d_rope 64),
  ragged batches, tree sizes and prefixes that are not multiples of the 64-row tile, prefix 0,
  split and unsplit key ranges, head counts 16 / 20 / 64 / 128, a query that sees nothing;
  each against a float64 reference on the same rounded inputs, computed on the GPU with
  engine.reference.mla's semantics (and checked against engine.reference.mla itself on a
  small ragged case first: numpy's einsum is too slow at these sizes). Prints
  PASS / FAIL with the max relative errors (max |x - ref| / max |ref|; bound 1e-2).
--time: a CUDA graph of N calls, time / N, for bs 1 / 16 / 64, prefix 4096 / 32768, tree
  1 / 16 / 64 at 64 heads, for the sm90a path and kdt_verify_attention's automatic path on the
  same inputs; TFLOP/s as a fraction of this run's bf16 matmul ceiling (torch.matmul 8192^3)
  and, for the AR step (tree 1), cache GB/s as a fraction of this run's copy ceiling (a 2 GiB
  device-to-device copy: read + write bytes / time). FLOPs = 2 T H (P + T) (2 Dl + Dr) per
  request; cache bytes = rows x 1152.
Exit status 1 when a check fails (the timing is then skipped).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys

import numpy as np

from bench.validate import rel_err

DL, DR, DK = 512, 64, 576
TOL = 1e-2
KDT_BACKEND_CUDA = 1
KDT_DTYPE_BF16 = 1
def load_library(path: str | None):
    if path is None:
        path = os.environ.get("KDTREE_LIB")
    if path is None:
        from engine.native._lib import find_library_path

        path = str(find_library_path())
    lib = ctypes.CDLL(path)
    args = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int32] * 8 + \
        [ctypes.c_void_p] * 6 + [ctypes.c_int32, ctypes.c_float, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.kdt_verify_attention.argtypes = args
    lib.kdt_verify_attention.restype = ctypes.c_int
    lib.kdt_verify_attention_workspace_size.argtypes = [ctypes.c_int] + [ctypes.c_int32] * 6
    lib.kdt_verify_attention_workspace_size.restype = ctypes.c_size_t
    lib.kdt_last_error.restype = ctypes.c_char_p
    return lib


def random_tree_visibility(rng, n: int, words: int) -> np.ndarray:
    """[n, words] uint32 ancestor-or-self bits of a random tree (parents precede children)."""
    vis = np.zeros((n, words), np.uint32)
    anc: list[set[int]] = [set() for _ in range(n)]
    for i in range(1, n):
        p = int(rng.integers(0, i))
        anc[i] = anc[p] | {p}
    for i in range(n):
        for j in anc[i] | {i}:
            vis[i, j // 32] |= np.uint32(1 << (j % 32))
    return vis


class Case:
    """One ragged batch on the GPU: request b has prefix P_b and tree n_b."""

    def __init__(self, torch, rng, H: int, prefixes, trees, scale: float | None = None,
                 device: str = "cuda"):
        ns, ps = list(trees), list(prefixes)
        self.H, self.bs = H, len(ns)
        self.max_tree = max(ns)
        self.max_kv = max(n + p for n, p in zip(ns, ps))
        self.words = (self.max_tree + 31) // 32
        qi = np.concatenate([[0], np.cumsum(ns)]).astype(np.int32)
        ki = np.concatenate([[0], np.cumsum([n + p for n, p in zip(ns, ps)])]).astype(np.int32)
        self.total_q, self.total_kv = int(qi[-1]), int(ki[-1])
        vis = np.concatenate([random_tree_visibility(rng, n, self.words) for n in ns])
        self.ns, self.ps = ns, ps
        self.device = dev = device
        g = torch.Generator(device=dev)
        g.manual_seed(int(rng.integers(0, 2**62)))
        bf = torch.bfloat16
        self.q_lat = torch.randn(self.total_q, H, DL, generator=g, device=dev).to(bf)
        self.q_pe = torch.randn(self.total_q, H, DR, generator=g, device=dev).to(bf)
        self.kv = torch.randn(self.total_kv, DK, generator=g, device=dev).to(bf)
        self.qi = torch.from_numpy(qi).to(dev)
        self.ki = torch.from_numpy(ki).to(dev)
        self.vis_np = vis
        self.vis = torch.from_numpy(vis.view(np.int32)).to(dev)
        self.scale = float(scale if scale is not None else 1.0 / np.sqrt(DK))
        self.out = torch.empty(self.total_q, H, DL, device=dev, dtype=torch.float32)
        self.lse = torch.empty(self.total_q, H, device=dev, dtype=torch.float32)
        self.torch = torch

    def set_visibility(self, vis: np.ndarray) -> None:
        self.vis_np = vis
        self.vis = self.torch.from_numpy(vis.view(np.int32)).to(self.device)

    def call(self, lib, path: str, ws) -> None:
        """kdt_verify_attention with KDT_VERIFY_PATH=path (read by the library on every call)."""
        torch = self.torch
        stream = torch.cuda.current_stream().cuda_stream
        os.environ["KDT_VERIFY_PATH"] = path
        st = lib.kdt_verify_attention(
            KDT_BACKEND_CUDA, ctypes.c_void_p(stream), KDT_DTYPE_BF16, self.bs, self.H, DL, DR,
            self.total_q, self.total_kv, self.max_tree, self.max_kv, self.qi.data_ptr(),
            self.ki.data_ptr(), self.q_lat.data_ptr(), self.q_pe.data_ptr(), self.kv.data_ptr(),
            self.vis.data_ptr(), self.words, self.scale, self.out.data_ptr(),
            self.lse.data_ptr(), ws.data_ptr() if ws is not None else None,
            ws.numel() if ws is not None else 0)
        if st != 0:
            raise RuntimeError(f"path {path}: status {st}: {lib.kdt_last_error().decode()}")

    def workspace(self, lib):
        n = lib.kdt_verify_attention_workspace_size(KDT_BACKEND_CUDA, self.bs, self.H, DL,
                                                     self.total_q, self.max_tree, self.max_kv)
        return self.torch.empty(max(int(n), 16), dtype=self.torch.uint8, device=self.device)

    def flops(self) -> float:
        return sum(2.0 * n * self.H * (p + n) * (2 * DL + DR) for n, p in zip(self.ns, self.ps))

    def cache_bytes(self) -> float:
        return float(self.total_kv) * DK * 2


def reference_gpu(case: Case):
    """engine.reference.mla.verify_attention_ragged's semantics in float64 on the GPU (numpy's
    einsum would take minutes at these sizes); agreement with it is checked on a small case."""
    torch = case.torch
    f64 = torch.float64
    q_lat, q_pe, kv = case.q_lat.to(f64), case.q_pe.to(f64), case.kv.to(f64)
    vis = torch.from_numpy(case.vis_np.astype(np.int64)).to(case.device)
    out = torch.zeros(case.total_q, case.H, DL, dtype=f64, device=case.device)
    lse = torch.full((case.total_q, case.H), -float("inf"), dtype=f64, device=case.device)
    q0 = k0 = 0
    for n, p in zip(case.ns, case.ps):
        rows = kv[k0:k0 + p + n]
        s = (torch.einsum("nhd,md->nhm", q_lat[q0:q0 + n], rows[:, :DL]) +
             torch.einsum("nhd,md->nhm", q_pe[q0:q0 + n], rows[:, DL:])) * case.scale
        j = torch.arange(n, device=case.device)
        bits = (vis[q0:q0 + n][:, j // 32] >> (j % 32)) & 1  # [n queries, n tree keys]
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool, device=case.device), bits.bool()], 1)
        s = s.masked_fill(~visible[:, None, :], -float("inf"))
        top = s.amax(dim=2)
        seen = torch.isfinite(top)
        shift = torch.where(seen, top, torch.zeros_like(top))
        w = torch.exp(s - shift[:, :, None])
        d = w.sum(dim=2)
        o = torch.einsum("nhm,md->nhd", w, rows[:, :DL]) / d.clamp_min(1e-300)[:, :, None]
        out[q0:q0 + n] = torch.where(seen[:, :, None], o, torch.zeros_like(o))
        lse[q0:q0 + n] = torch.where(seen, shift + torch.log(d), torch.full_like(d, -float("inf")))
        q0, k0 = q0 + n, k0 + p + n
    return out.cpu().numpy(), lse.cpu().numpy()


def reference_agreement(case: Case) -> float:
    """Max relative difference between reference_gpu and engine.reference.mla (float64)."""
    from engine.reference.mla import verify_attention_ragged

    to_np = lambda t: t.float().cpu().numpy()
    ref_out, ref_lse = verify_attention_ragged(
        to_np(case.q_lat), to_np(case.q_pe), to_np(case.kv), case.qi.cpu().numpy(),
        case.ki.cpu().numpy(), case.vis_np, case.scale)
    g_out, g_lse = reference_gpu(case)
    return max(rel_err(g_out, ref_out), rel_err(g_lse, ref_lse))


def diagnose(out: np.ndarray, lse: np.ndarray, ref_out: np.ndarray, ref_lse: np.ndarray) -> str:
    """Where a failing result is wrong, for debugging without a second GPU run: NaN counts,
    the error per 64-column block of out (blocks 0-3 come from consumer WG 0, 4-7 from WG 1),
    per 16-row warp slice of the 64-row tile (row = node * H + head), and for the lse."""
    o = out.reshape(-1, DL).astype(np.float64)
    r = ref_out.reshape(-1, DL)
    scale = max(np.abs(r[np.isfinite(r)]).max(initial=0.0), 1e-30)
    d = np.abs(np.nan_to_num(o, nan=1e30) - r) / scale
    rows = np.arange(o.shape[0]) % 64
    lines = [f"    NaN in out: {int(np.isnan(o).sum())}, in lse: {int(np.isnan(lse).sum())}",
             "    out err by column block: " + " ".join(f"{d[:, 64 * c:64 * c + 64].max():.2g}"
                                                     for c in range(DL // 64)),
             "    out err by tile-row slice (rows % 64 in 0-15, 16-31, 32-47, 48-63): " +
             " ".join(f"{d[(rows >= 16 * k) & (rows < 16 * k + 16)].max(initial=0.0):.2g}"
                      for k in range(4))]
    li, lr = lse.reshape(-1).astype(np.float64), ref_lse.reshape(-1)
    fin = np.isfinite(lr)
    if fin.any():
        worst = int(np.argmax(np.where(fin, np.abs(np.nan_to_num(li, nan=1e30) - lr), -1)))
        lines.append(f"    worst lse row {worst}: got {li[worst]:.6g}, want {lr[worst]:.6g}")
    return "\n".join(lines)


def check_case(lib, case: Case, detail: bool = True) -> tuple[float, float]:
    ws = case.workspace(lib)
    case.out.fill_(float("nan"))
    case.lse.fill_(float("nan"))
    case.call(lib, "sm90a", ws)
    case.torch.cuda.synchronize()
    ref_out, ref_lse = reference_gpu(case)
    out, lse = case.out.cpu().numpy(), case.lse.cpu().numpy()
    e_out, e_lse = rel_err(out, ref_out), rel_err(lse, ref_lse)
    if detail and not (e_out < TOL and e_lse < TOL):
        print(diagnose(out, lse, ref_out, ref_lse))
    return e_out, e_lse


CHECKS = [  # (name, H, prefixes, trees)
    ("ragged bs3 H64 P 0/100/1000 T 1/37/5", 64, [0, 100, 1000], [1, 37, 5]),
    ("split bs1 H64 P4113 T64", 64, [4113], [64]),
    ("split bs1 H64 P3000 T1 (AR step)", 64, [3000], [1]),
    ("split ragged bs2 H64 P 2000/700 T 3/5 (empty chunks)", 64, [2000, 700], [3, 5]),
    ("AR step ragged bs2 H64 P 4000/300 T 1/1 (16 splits: wide merge, empty chunks)", 64,
     [4000, 300], [1, 1]),
    ("unsplit ragged bs2 H64 P 2000/700 T 3/64", 64, [2000, 700], [3, 64]),
    ("split H16 bs1 P1000 T40 (tree crosses a chunk boundary)", 16, [1000], [40]),
    ("unsplit bs8 H64 T64 P 0..300", 64, [0, 17, 64, 65, 128, 200, 257, 300], [64] * 8),
    ("H16 bs2 P 77/0 T 13/40 (tile spans nodes, 2 vis words)", 16, [77, 0], [13, 40]),
    ("H20 bs2 P 64/200 T 7/33", 20, [64, 200], [7, 33]),
    ("H128 bs1 P130 T9 (2 tiles a node)", 128, [130], [9]),
]


def check_kernel(lib, torch, rng) -> bool:
    """Every check case on the sm90a kernel; prints a PASS / FAIL line each; True when all pass."""
    ok = True
    for name, H, ps, ns in CHECKS:
        case = Case(torch, rng, H, ps, ns)
        try:
            e_out, e_lse = check_case(lib, case)
        except RuntimeError as e:
            print(f"FAIL  {name}: {e}")
            ok = False
            continue
        good = e_out < TOL and e_lse < TOL
        ok &= good
        print(f"{'PASS' if good else 'FAIL'}  {name}: out rel err {e_out:.3g}, lse rel err {e_lse:.3g}")
    # a query that sees nothing (no prefix, no visibility bit): out 0, lse -inf
    case = Case(torch, rng, 64, [0], [3])
    vis = case.vis_np.copy()
    vis[1] = 0
    case.set_visibility(vis)
    try:
        e_out, e_lse = check_case(lib, case)
        out, lse = case.out.cpu().numpy(), case.lse.cpu().numpy()
        good = (e_out < TOL and e_lse < TOL and np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
                and np.all(np.isfinite(lse[[0, 2]])))
        print(f"{'PASS' if good else 'FAIL'}  masked-out row (P0 T3, row 1 sees nothing): "
              f"out rel err {e_out:.3g}, lse rel err {e_lse:.3g}")
    except RuntimeError as e:
        print(f"FAIL  masked-out row: {e}")
        good = False
    ok &= good
    # a NaN in the next request's first cache row stays there: request 0's last tile ends inside
    # a 64-row box, whose other rows (request 1's) must not reach its P V
    case = Case(torch, rng, 64, [100, 50], [5, 3])
    case.kv[case.total_kv - 53].fill_(float("nan"))
    try:
        ws = case.workspace(lib)
        case.call(lib, "sm90a", ws)
        torch.cuda.synchronize()
        ref_out, ref_lse = reference_gpu(case)
        out, lse = case.out.cpu().numpy()[:5], case.lse.cpu().numpy()[:5]
        e_out, e_lse = rel_err(out, ref_out[:5]), rel_err(lse, ref_lse[:5])
        good = e_out < TOL and e_lse < TOL and bool(np.isfinite(out).all())
        print(f"{'PASS' if good else 'FAIL'}  NaN in the next request's rows does not leak: "
              f"request 0 out rel err {e_out:.3g}, lse rel err {e_lse:.3g}")
    except RuntimeError as e:
        print(f"FAIL  NaN in the next request's rows: {e}")
        good = False
    ok &= good
    return ok


def run_checks(lib, torch, seed: int) -> bool:
    """All checks; True when all passed."""
    rng = np.random.default_rng(seed)
    print(f"sm90a check: seed {seed}, bound {TOL}")
    small = Case(torch, rng, 4, [5, 0, 40], [3, 7, 33])
    small_vis = small.vis_np.copy()
    small_vis[4] = 0  # node 1 of request 1 (no prefix): sees nothing
    small.set_visibility(small_vis)
    agree = reference_agreement(small)
    good = agree < 1e-9
    ok = good
    print(f"{'PASS' if good else 'FAIL'}  float64 GPU reference vs engine.reference.mla: "
          f"max rel diff {agree:.3g}")
    ok &= check_kernel(lib, torch, rng)
    # shapes / dtypes the path does not take are refused, not computed
    os.environ["KDT_VERIFY_PATH"] = "sm90a"
    ws = small.workspace(lib)
    st = lib.kdt_verify_attention(
        KDT_BACKEND_CUDA, None, 0, 1, 64, DL, DR, 1, 1, 1, 1, small.qi.data_ptr(),
        small.ki.data_ptr(), small.q_lat.data_ptr(), small.q_pe.data_ptr(), small.kv.data_ptr(),
        small.vis.data_ptr(), 1, 1.0, small.out.data_ptr(), small.lse.data_ptr(), ws.data_ptr(),
        ws.numel())
    msg = lib.kdt_last_error().decode()
    good = st == 2 and "bf16" in msg
    ok &= good
    print(f"{'PASS' if good else 'FAIL'}  float32 cache refused: status {st} ({msg})")
    print("sm90a check (all):", "PASS" if ok else "FAIL")
    return ok


def time_graph(torch, fn, target_s: float = 0.25) -> float:
    """Seconds per call: N calls captured in one CUDA graph, replayed, time / N."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    one = max(s.elapsed_time(e) / 1e3, 1e-6)
    n = int(max(2, min(50, target_s / one)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3 / n)
    return best


def run_timing(lib, torch) -> None:
    from bench import ceilings

    ceil = ceilings.measure("cuda")
    mm, cp = ceil["matmul"]["value"], ceil["copy"]["value"]
    rng = np.random.default_rng(0)
    print(f"sm90a timing (H 64, 512 + 64, bf16; CUDA graph of N calls / N, best of 3 replays; "
          f"sm90a = KDT_VERIFY_PATH=sm90a, auto = kdt_verify_attention's own choice; ceilings of this "
          f"run: matmul {mm:.0f} TFLOP/s, copy {cp:.0f} GB/s; %mm = TFLOP/s / matmul, %cp = cache "
          f"GB/s / copy)")
    print(f"{'bs':>3} {'prefix':>6} {'tree':>4} | {'sm90a ms':>8} {'TF/s':>5} {'%mm':>4} {'GB/s':>5} "
          f"{'%cp':>4} | {'auto ms':>8} {'TF/s':>5} {'%mm':>4} {'GB/s':>5} {'%cp':>4}")

    def cols(f: float, b: float, t: float) -> str:
        return (f"{t * 1e3:>8.3f} {f / t / 1e12:>5.0f} {f / t / 1e12 / mm:>4.0%} {b / t / 1e9:>5.0f} "
                f"{b / t / 1e9 / cp:>4.0%}")

    for bs in (1, 16, 64):
        for P in (4096, 32768):
            for T in (1, 16, 64):
                case = Case(torch, rng, 64, [P] * bs, [T] * bs)
                ws = case.workspace(lib)
                f, b = case.flops(), case.cache_bytes()
                try:
                    sm90a = cols(f, b, time_graph(torch, functools.partial(case.call, lib, "sm90a", ws)))
                except RuntimeError as e:
                    sm90a = f"failed: {e}"[:30].ljust(30)
                t_a = time_graph(torch, functools.partial(case.call, lib, "auto", ws))
                print(f"{bs:>3} {P:>6} {T:>4} | {sm90a} | {cols(f, b, t_a)}", flush=True)
                case = ws = None
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default=None, help="libkdtree.so (default: KDTREE_LIB, else build/*)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    lib = load_library(a.lib)
    seed = a.seed if a.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    ok = True
    if a.check or not a.time:
        ok = run_checks(lib, torch, seed)
    if a.time:
        if ok:
            run_timing(lib, torch)
        else:
            print("sm90a timing skipped: the check failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
