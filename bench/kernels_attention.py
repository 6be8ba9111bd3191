"""Verify-attention cases of the `kernels` suite (bench/kernels.py holds the suite: grids, run,
table, and the tree build / accept cases): every path and torch peer on one case's inputs, each
validated against the float64 reference (engine.reference.mla) on the very buffers the timed call
writes, then timed. Rates (formulas in each record):
  attention    bytes = (total_kv * (Dl + Dr) + total_q * H * (Dl + Dr)) * s       (cache + q read)
                       + total_q * H * (Dl + 1) * 4 + total_q * W * 4             (out, lse, mask)
               FLOPs = 2 * H * (Dl + Dr + Dl) * visible, visible = sum over query rows of the
                       keys it sees (its prefix plus its ancestors and itself)
               fraction of the run's measured ceilings: GB/s over the device copy,
               TFLOP/s over the matmul (bf16 on CUDA, fp32 on the CPU).
Attention rows, per case and path, all on the same inputs in the same run: each of our forced
paths (KDT_VERIFY_PATH: simt for fp32; simt, mma, mma16 / mma-small / mma-smallq (mma with
KDT_MMA_TILE=16 / small / smallq), sm90a for bf16 on CUDA; cpu on the CPU) and two torch peers:
`torch` (scores by torch.bmm over the absorbed cache, masked fill of the tree tail, softmax,
torch.bmm with the latent values) and `sdpa` (scaled_dot_product_attention with a boolean mask).
Each row has two times: `kernel` (CUDA: N calls captured in a CUDA graph, replayed, divided by
N; the rates use it) and the summary's one call as a user makes it (between events, L2
flushed). speedup_vs_torch = torch's kernel time / the row's."""

from __future__ import annotations

import os

import numpy as np

from bench.inputs import KIMI_K2, attention_inputs
from bench.kernels_records import rate, record, sync
from bench.native_calls import prepare_verify_attention, to_numpy
from bench.timing import summarize, time_cuda_graph
from bench.validate import check_close

# Attention tolerance: the kernels' own contract (tests/test_native_attention.py), relative to
# the reference's magnitude (the float64 reference is computed on the stored, already-rounded
# inputs): fp32 1e-5; bf16 1e-2 (the tensor-core paths round the softmax weights to bf16, and
# the torch peers compute in bf16).
ATTENTION_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
# Our paths per (device, dtype) (KDT_VERIFY_PATH values), and the torch peers.
# mma16 / mma-small / mma-smallq: the mma path with KDT_MMA_TILE=16 / small / smallq (its
# previous big configuration, and the two sm_120 ones: query tile in shared memory, query
# fragments in registers), measured beside the default so that one run can choose.
MMA_VARIANTS = {"mma16": "16", "mma-small": "small", "mma-smallq": "smallq"}
ATTENTION_PATHS = {("cuda", "float32"): ["simt"],
                   ("cuda", "bfloat16"): ["simt", "mma", *MMA_VARIANTS, "sm90a"],
                   ("cpu", "float32"): ["cpu"], ("cpu", "bfloat16"): ["cpu"]}
PEERS = ["torch", "sdpa"]
# The peers are not held to our kernels' bf16 contract: the torch path's bmm returns bf16 scores
# on a bf16 cache, rounded before the softmax (a score s moves by up to 2^-9 |s|, so the
# weights by up to ~2^-9 max|s| relative; the output error grows with the score magnitudes and
# the prefix: 1.03e-2 measured at P 512 on the CPU, 3.47e-2 at bs 64 P 32k T 64 on the H200).
# Their bf16 bound is a same-function check (a wrong scale, a dropped prefix, a missing softmax
# give errors of order 1), 0.1; every record keeps its measured error (validation.rel_err) and
# the table shows it beside "ok", so a peer's imprecision is reported, not hidden, and does not
# fail the suite.
PEER_TOL = {"float32": 1e-5, "bfloat16": 1e-1}
# Kernel-alone timing (time_cuda_graph): up to 20 calls per graph and GRAPH_REPS replays, both
# cut so that one path's replays take about GRAPH_BUDGET_S (at least 1 call x 3 replays); the
# SIMT path is skipped where its estimated time exceeds SIMT_MAX_S (a reference path).
GRAPH_BUDGET_S = 0.15
GRAPH_REPS = 5
SIMT_MAX_S = 0.25
SIMT_TFLOPS_EST = 15.0
# Work allowed for the float64 reference per validated request (FLOPs); heads are subsampled
# beyond it (heads are independent, so a head subset is an exact check of those heads).
REF_FLOP_BUDGET = 5e8
MEMORY_FRACTION = 0.4  # skip attention cases whose inputs exceed this share of free GPU memory


def attention_work(bs, prefix, tree, dtype, visible, words, heads=KIMI_K2["heads"],
                   d_latent=KIMI_K2["d_latent"], d_rope=KIMI_K2["d_rope"]) -> dict:
    """Bytes moved and FLOPs of one verify-attention call (formulas in the module docstring)."""
    s = {"float32": 4, "bfloat16": 2}[dtype]
    total_q, total_kv = bs * tree, bs * (prefix + tree)
    bytes_ = ((total_kv * (d_latent + d_rope) + total_q * heads * (d_latent + d_rope)) * s
              + total_q * heads * (d_latent + 1) * 4 + total_q * words * 4)
    flops = 2 * heads * (d_latent + d_rope + d_latent) * visible
    return {"bytes": int(bytes_), "flops": int(flops)}


def _attention_reference(a, rows_req, prefix, tree, heads_sub):
    """float64 reference out/lse for requests `rows_req`, heads `heads_sub` (one request each)."""
    from engine.reference import mla

    outs, lses = [], []
    for b in rows_req:
        q0, k0 = b * tree, b * (prefix + tree)
        q_lat = to_numpy(a["q_lat"][q0:q0 + tree, heads_sub]).astype(np.float64)
        q_pe = to_numpy(a["q_pe"][q0:q0 + tree, heads_sub]).astype(np.float64)
        kv = to_numpy(a["kv_cache"][k0:k0 + prefix + tree]).astype(np.float64)
        vis = a["visibility_np"][q0:q0 + tree]
        o, l = mla.verify_attention_ragged(q_lat, q_pe, kv, np.array([0, tree], np.int32),
                                           np.array([0, prefix + tree], np.int32), vis,
                                           a["softmax_scale"])
        outs.append(np.asarray(o))
        lses.append(np.asarray(l))
    return np.concatenate(outs), np.concatenate(lses)


# Environment of a forced path (the library reads both variables per call).
def _path_env(path) -> dict:
    if path in MMA_VARIANTS:
        return {"KDT_VERIFY_PATH": "mma", "KDT_MMA_TILE": MMA_VARIANTS[path]}
    return {"KDT_VERIFY_PATH": path, "KDT_MMA_TILE": None}


def _forced(path):
    """The path's KDT_VERIFY_PATH (and KDT_MMA_TILE) around a call or a graph capture."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        env = _path_env(path)
        old = {k: os.environ.get(k) for k in env}
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx()


def _tail_mask(a, bs, tree):
    """[bs, tree, tree] bool: node i of request b sees tree node j (the visibility bits)."""
    import torch

    vis = a["visibility_np"].reshape(bs, tree, -1)
    j = np.arange(tree)
    bits = (vis[:, :, j // 32] >> (j % 32).astype(np.uint32)) & 1
    return torch.from_numpy(bits.astype(bool)).to(a["kv_cache"].device)


def _peer_fn(name, a, bs, prefix, tree):
    """The torch peers on the same inputs; each returns out [bs * tree, H, Dl]."""
    import torch

    H, dl = a["q_lat"].shape[1], a["q_lat"].shape[2]
    dk, kv_len, scale = a["kv_cache"].shape[1], prefix + tree, a["softmax_scale"]
    kv = a["kv_cache"].view(bs, kv_len, dk)
    tail = _tail_mask(a, bs, tree)  # [bs, T, T]
    if name == "torch":
        keep = tail[:, :, None, :]  # broadcast over heads: rows are (node, head)

        def fn():
            q = torch.cat([a["q_lat"], a["q_pe"]], -1).view(bs, tree * H, dk)
            sc = torch.bmm(q, kv.transpose(1, 2)).mul_(scale)
            sc.view(bs, tree, H, kv_len)[..., prefix:].masked_fill_(~keep, float("-inf"))
            return torch.bmm(torch.softmax(sc, -1), kv[..., :dl]).view(bs * tree, H, dl)
        return fn
    mask = torch.cat([torch.ones(bs, tree, prefix, dtype=torch.bool, device=tail.device), tail],
                     -1)[:, None]  # [bs, 1, T, P + T]
    k4, v4 = kv[:, None], kv[:, None, :, :dl]

    def fn():
        q = torch.cat([a["q_lat"], a["q_pe"]], -1).view(bs, tree, H, dk).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k4.expand(bs, H, kv_len, dk), v4.expand(bs, H, kv_len, dl), attn_mask=mask,
            scale=scale)
        return o.transpose(1, 2).reshape(bs * tree, H, dl)
    return fn


def _peer_fits(device, name, bs, prefix, tree, dtype) -> str | None:
    """Why a peer is not run (its temporaries would not fit), else None."""
    if device != "cuda":
        return None
    import torch

    s = {"float32": 4, "bfloat16": 2}[dtype]
    H, kv_len = KIMI_K2["heads"], prefix + tree
    need = 2 * bs * tree * H * kv_len * s  # scores and probabilities
    if name == "sdpa":  # a backend that materialises the broadcast K / V and fp32 scores
        need = bs * H * kv_len * (2 * KIMI_K2["d_latent"] + KIMI_K2["d_rope"]) * s + need * 4 // s
    free, _ = torch.cuda.mem_get_info()
    if need > MEMORY_FRACTION * free:
        return f"needs ~{need / 2**30:.1f} GiB, over {MEMORY_FRACTION:.0%} of {free / 2**30:.1f} GiB free"
    return None


def _time_graph(device, make_fn, call_s):
    """Kernel-alone time (s per call) by bench.timing.time_cuda_graph: N calls of make_fn()
    (built on a side stream, the capture stream) in one CUDA graph, replayed, divided by N; N and
    the replays adapt to the call's time (GRAPH_BUDGET_S in all). On the CPU: None."""
    if device != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the graph's private pool must not sit beside the cached temporaries
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    st = {}
    with torch.cuda.stream(stream):
        fn = make_fn()
        samples = time_cuda_graph(fn, calls=20, reps=GRAPH_REPS, warmup=1, budget_s=GRAPH_BUDGET_S,
                                  call_s=call_s, min_reps=3, stats=st)
    torch.cuda.synchronize()
    return {"median": float(np.median(samples)), "calls": st["calls"], "replays": st["reps"]}


def _attention_path(lib, device, a, bs, prefix, tree, path, case, w, pick, ref, seed, timer,
                    ceil) -> dict:
    """One path or peer on the case's inputs: validated, then timed (kernel alone and one call)."""
    ref_out, ref_lse, checked = ref
    if path in PEERS:
        peer = _peer_fn(path, a, bs, prefix, tree)
        res = {}

        def run_once():
            res["out"] = peer()
        run_once()

        def make():  # built on the capture stream (its masks and views)
            return _peer_fn(path, a, bs, prefix, tree)
        got = {"out": (pick(res["out"]).astype(np.float64), ref_out)}
    else:
        prep = prepare_verify_attention(lib, device, a, bs, tree, prefix)

        def run_once():
            with _forced(path):
                prep.run()

        def make():
            p2 = prepare_verify_attention(lib, device, a, bs, tree, prefix)  # capture stream

            def fn():
                with _forced(path):
                    p2.run()
            return fn
        run_once()
        got = {"out": (pick(prep.outputs["out"]), ref_out),
               "lse": (pick(prep.outputs["lse"]), ref_lse)}
    sync(device)
    v = check_close(got, (PEER_TOL if path in PEERS else ATTENTION_TOL)[case["dtype"]], checked)
    if not v["ok"]:
        return record("verify_attention", device, case, v, seed=seed)
    samples = timer(run_once)
    call_med = summarize(samples)["median"]
    g = _time_graph(device, make, call_med)
    kern = g["median"] if g else call_med
    gbs, tfs = w["bytes"] / kern / 1e9, w["flops"] / kern / 1e12
    rates = {
        "kernel_s": rate(kern, "s", f"CUDA graph of N = {g['calls']} calls / N, median of "
                          f"{g['replays']} replays" if g else "median of one call"),
        "GB_per_s": rate(gbs, "GB/s", "bytes / kernel_s; " + w_formula("bytes")),
        "TFLOP_per_s": rate(tfs, "TFLOP/s", "flops / kernel_s; " + w_formula("flops")),
        "frac_copy_ceiling": rate(gbs / ceil["copy"]["value"], "fraction",
                                   "GB_per_s / ceilings.copy (device copy, read + write)"),
        "frac_matmul_ceiling": rate(tfs / ceil["matmul"]["value"], "fraction",
                                     f"TFLOP_per_s / ceilings.matmul ({ceil['matmul']['params']['dtype']})"),
    }
    rec = record("verify_attention", device, case, v, samples, rates, seed)
    rec["work"] = w
    return rec


def attention_case(lib, device, bs, prefix, tree, dtype, seed, timer, ceil) -> list:
    """Every path and peer on one set of inputs: validated against the float64 reference on
    the buffers the timed call writes, then timed (kernel alone and one call)."""
    import torch

    base = {"bs": bs, "prefix": prefix, "tree": tree, "dtype": dtype, "heads": KIMI_K2["heads"],
            "d_latent": KIMI_K2["d_latent"], "d_rope": KIMI_K2["d_rope"]}
    a = attention_inputs(seed, bs, prefix, tree, dtype, device)
    rows_req = [0] if bs == 1 else [0, bs - 1]
    per_head = 2.0 * tree * (prefix + tree) * (2 * KIMI_K2["d_latent"] + KIMI_K2["d_rope"])
    nh = int(max(1, min(KIMI_K2["heads"], REF_FLOP_BUDGET // per_head)))
    heads_sub = list(range(nh)) if nh == KIMI_K2["heads"] else sorted(
        set(np.linspace(0, KIMI_K2["heads"] - 1, nh).astype(int).tolist()))
    ref_out, ref_lse = _attention_reference(a, rows_req, prefix, tree, heads_sub)
    q_rows = torch.as_tensor(np.concatenate([np.arange(b * tree, (b + 1) * tree) for b in rows_req]))
    h_idx = torch.as_tensor(heads_sub)
    checked = (f"requests {rows_req}, heads "
               f"{'all' if nh == KIMI_K2['heads'] else heads_sub} of {KIMI_K2['heads']}")
    w = attention_work(bs, prefix, tree, dtype, a["visible"], a["words"])
    pick = lambda t: to_numpy(t[q_rows.to(t.device)][:, h_idx.to(t.device)])  # noqa: E731

    out, skipped = [], []
    for path in ATTENTION_PATHS[(device, dtype)] + PEERS:
        case = dict(base, path=path)
        if path == "simt" and device == "cuda" and w["flops"] / (SIMT_TFLOPS_EST * 1e12) > SIMT_MAX_S:
            skipped.append(dict(case, backend=device, why=f"simt (reference path) estimated over {SIMT_MAX_S} s a call"))
            continue
        why = _peer_fits(device, path, bs, prefix, tree, dtype) if path in PEERS else None
        if why:
            skipped.append(dict(case, backend=device, why=why))
            continue
        try:
            rec = _attention_path(lib, device, a, bs, prefix, tree, path, case, w, pick,
                                  (ref_out, ref_lse, checked), seed, timer, ceil)
        except Exception as e:  # one path's failure must not hide the others' rows
            from engine.native._lib import NativeError

            if isinstance(e, NativeError) and e.status == 2:  # KDT_ERR_UNSUPPORTED: not this build
                skipped.append(dict(case, backend=device, why=f"unsupported here: {e}"))
            elif path in PEERS and isinstance(e, torch.OutOfMemoryError):
                skipped.append(dict(case, backend=device, why=f"out of memory: {e}"[:200]))
            else:
                rec = record("verify_attention", device, case,
                              {"ok": False, "error": f"{type(e).__name__}: {e}"}, seed=seed)
                out.append(rec)
            rec = None
        if rec is not None:
            out.append(rec)
        if device == "cuda":
            torch.cuda.empty_cache()
    torch_rec = next((r for r in out if r["case"]["path"] == "torch" and "rates" in r), None)
    for r in out:
        if torch_rec and "rates" in r:
            r["rates"]["speedup_vs_torch"] = rate(
                torch_rec["rates"]["kernel_s"]["value"] / r["rates"]["kernel_s"]["value"], "x",
                "torch path kernel_s / this path's kernel_s (same inputs, same run)")
    return out, skipped


def w_formula(kind: str) -> str:
    return {"bytes": "(total_kv*(Dl+Dr) + total_q*H*(Dl+Dr))*s + total_q*H*(Dl+1)*4 + total_q*W*4",
            "flops": "2*H*(2*Dl+Dr)*visible"}[kind]


def fits(device, bs, prefix, tree, dtype) -> str | None:
    if device != "cuda":
        return None
    import torch

    s = {"float32": 4, "bfloat16": 2}[dtype]
    need = (bs * (prefix + tree) * 576 + bs * tree * 64 * 576) * s + bs * tree * 64 * 513 * 4
    free, _ = torch.cuda.mem_get_info()
    if need > MEMORY_FRACTION * free:
        return f"needs {need / 2**30:.1f} GiB, over {MEMORY_FRACTION:.0%} of {free / 2**30:.1f} GiB free"
    return None
