"""Suite `kernels`: tree build, tree accept and verify attention, per backend, over a grid.

Every case is validated against the reference (engine.reference.ddtree, engine.reference.mla) on the very buffers
the timed call writes, then timed as a bare C-ABI call (bench/native_calls.py): CUDA events on
the GPU, the monotonic clock on the CPU. Rates (formulas in each record):
  tree build   nodes/s = bs * budget / t
  tree accept  requests/s = bs / t
  attention    bytes = (total_kv * (Dl + Dr) + total_q * H * (Dl + Dr)) * s       (cache + q read)
                       + total_q * H * (Dl + 1) * 4 + total_q * W * 4             (out, lse, mask)
               FLOPs = 2 * H * (Dl + Dr + Dl) * visible, visible = sum over query rows of the
                       keys it sees (its prefix plus its ancestors and itself)
               fraction of the run's measured ceilings: GB/s over the device copy,
               TFLOP/s over the matmul (bf16 on CUDA, fp32 on the CPU).
Attention rows, per case and path, all on the same inputs in the same run: each of our forced
paths (KDT_VERIFY_PATH: simt for fp32; simt, mma, mma16 / mma-small / mma-smallq (mma with
KDT_MMA_TILE=16 / small / smallq), sm90a for bf16 on CUDA; cpu on the CPU) and two torch peers: `torch` (scores by torch.bmm over the absorbed cache, masked fill of the tree
tail, softmax, torch.bmm with the latent values) and `sdpa` (scaled_dot_product_attention with a
boolean mask). Each row has two times: `kernel` (CUDA: N calls captured in a CUDA graph,
replayed, divided by N; the rates use it) and the summary's one call as a user makes it
(between events, L2 flushed). speedup_vs_torch = torch's kernel time / the row's.
Grids: the issue's full grid on CUDA (fp32, a reference path, on bs 1 and 4 only); a reduced
attention grid on the CPU (the CPU backend computes in double precision and is a
reference-speed backend, not a fast path).
"""

from __future__ import annotations

import os

import numpy as np

from bench import format_table
from bench.inputs import KIMI_K2, accept_target, attention_inputs, tree_inputs
from bench.native_calls import (prepare_tree_accept, prepare_tree_build,
                                prepare_verify_attention, to_numpy)
from bench.timing import (cpu_states, device_warmup_s, settle, summarize, time_cpu, time_cuda,
                          time_cuda_graph)
from bench.tree_algo import ALGOS, side_stream, tree_algo
from bench.validate import (ACCEPT_FIELDS, TREE_FIELDS, check_close, check_exact,
                            sample_requests)

NAME = "kernels"
L = 15  # drafter block 16 -> 15 drafted depths (DDTREE.md section 1)
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


def grids(device: str, quick: bool) -> dict:
    full_tree = {"bs": [1, 4, 16, 64, 256], "budget": [15, 63, 255, 1023]}
    if device == "cuda":
        tree = {"bs": [1, 64], "budget": [15, 255]} if quick else full_tree
        att = ({"bs": [1, 64], "prefix": [1024, 32768], "tree": [1, 64]} if quick else
               {"bs": [1, 4, 16, 64], "prefix": [1024, 4096, 16384, 32768], "tree": [1, 16, 64]})
    else:
        tree = {"bs": [1, 16], "budget": [15, 255]} if quick else full_tree
        att = ({"bs": [1], "prefix": [512], "tree": [16]} if quick else
               {"bs": [1, 2], "prefix": [512, 1024], "tree": [16]})
    return {"tree": tree, "attention": dict(att, dtype=["float32", "bfloat16"], bs_float32=[1, 4],
                                            paths={f"{d}/{t}": p for (d, t), p in ATTENTION_PATHS.items()
                                                   if d == device}, peers=PEERS)}


def _timer(device: str, quick: bool, flush_l2: bool, warmup: int = 1):
    """The validation call before timing is a first warm-up already; `warmup` adds more."""
    if device == "cuda":
        return lambda fn: time_cuda(fn, warmup=3, reps=100, flush_l2=flush_l2,
                                    budget_s=0.05 if quick else (0.1 if flush_l2 else 0.3))
    return lambda fn: time_cpu(fn, warmup=warmup, reps=30, budget_s=0.05 if quick else 0.5)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _record(bench, device, case, validation, samples=None, rates=None, seed=None) -> dict:
    rec = {"bench": bench, "backend": device, "case": case, "validation": validation,
           "seed": seed, "samples": samples or []}
    if samples:
        rec["summary"] = summarize(samples)
    if rates:
        rec["rates"] = rates
    return rec


def _rate(value, unit, formula) -> dict:
    return {"value": value, "unit": unit, "formula": formula}


def _tree_and_accept(lib, device, bs, budget, rng, seed, timer, states_s=0.1) -> list:
    """Build (validated, timed) with each algorithm, then accept on the built tree (validated,
    timed). On CUDA each is timed two ways: one call between events (`timer`, launch from
    Python included) and the kernel alone (`kernel_alone`: a CUDA graph of N calls / N). On the
    CPU the build's record also holds its two speeds (`cpu_states`, within states_s seconds)."""
    with side_stream(device):  # graph capture needs a stream other than the legacy default
        return _tree_and_accept_on_stream(lib, device, bs, budget, rng, seed, timer, states_s)


def _kernel_alone(device, fn) -> dict | None:
    if device != "cuda":
        return None
    s = time_cuda_graph(fn, calls=20, reps=20)
    return {"summary": summarize(s), "samples": s,
            "timing": "20 calls in one CUDA graph, replayed, / 20 (no L2 flush)"}


def tree_case_inputs(rng: np.random.Generator, bs: int, budget: int) -> dict:
    """A tree case's requests as this suite draws them: the first draw of the case's generator
    (default_rng of the seed its records carry), L depths, min(budget, 64) ranks. bench.tree_ab
    --draw-from draws a run's requests again this way."""
    return tree_inputs(rng, bs, L, min(budget, 64))


def _tree_and_accept_on_stream(lib, device, bs, budget, rng, seed, timer, states_s) -> list:
    from engine.reference import ddtree

    K = min(budget, 64)
    inp = tree_case_inputs(rng, bs, budget)
    rows = sample_requests(bs, budget)
    ref = ddtree.build_tree(*(inp[k][rows] for k in ("top_logp", "top_ids")), budget,
                            *(inp[k][rows] for k in ("root_ids", "seq_lens")))
    out, prep = [], None
    for algo in ALGOS[device]:
        case = {"bs": bs, "budget": budget, "L": L, "K": K, "algo": algo}
        with tree_algo(algo):
            p = prepare_tree_build(lib, device, inp, budget)
            p.run()
            _sync(device)
            v = check_exact(p.outputs, ref, TREE_FIELDS, None if len(rows) == bs else rows)
            if not v["ok"]:
                out.append(_record("tree_build", device, case, v, seed=seed))
                continue
            s = timer(p.run)
            alone = _kernel_alone(device, p.run)
            states = cpu_states(p.run, budget_s=states_s) if device == "cpu" else None
        med = summarize(s)["median"]
        rec = _record("tree_build", device, case, v, s, {
            "nodes_per_s": _rate(bs * budget / med, "nodes/s", "bs * budget / median"),
            "us_per_request": _rate(med / bs * 1e6, "us", "median / bs"),
        }, seed)
        if alone:
            rec["kernel_alone"] = alone
        if states:
            rec["cpu_states"] = states
        out.append(rec)
        prep = prep or p
    if prep is None:
        return out

    tree = ddtree.Tree(**{f: to_numpy(prep.outputs[f]).view(np.uint32) if f == "visibility"
                          else to_numpy(prep.outputs[f]) for f in TREE_FIELDS})
    target = accept_target(rng, tree)
    acc = prepare_tree_accept(lib, device, tree, target)
    acc.run()
    _sync(device)
    ref_acc = ddtree.accept_greedy(tree, target)
    v = check_exact(acc.outputs, ref_acc, ACCEPT_FIELDS)
    v["mean_accept_len"] = float(np.mean(ref_acc.accept_len))
    case_a = {"bs": bs, "budget": budget, "L": L, "K": K, "n": budget + 1}
    if not v["ok"]:
        out.append(_record("tree_accept", device, case_a, v, seed=seed))
        return out
    s = timer(acc.run)
    med = summarize(s)["median"]
    rec = _record("tree_accept", device, case_a, v, s, {
        "requests_per_s": _rate(bs / med, "requests/s", "bs / median")}, seed)
    alone = _kernel_alone(device, acc.run)
    if alone:
        rec["kernel_alone"] = alone
    out.append(rec)
    return out


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
    _sync(device)
    v = check_close(got, (PEER_TOL if path in PEERS else ATTENTION_TOL)[case["dtype"]], checked)
    if not v["ok"]:
        return _record("verify_attention", device, case, v, seed=seed)
    samples = timer(run_once)
    call_med = summarize(samples)["median"]
    g = _time_graph(device, make, call_med)
    kern = g["median"] if g else call_med
    gbs, tfs = w["bytes"] / kern / 1e9, w["flops"] / kern / 1e12
    rates = {
        "kernel_s": _rate(kern, "s", f"CUDA graph of N = {g['calls']} calls / N, median of "
                          f"{g['replays']} replays" if g else "median of one call"),
        "GB_per_s": _rate(gbs, "GB/s", "bytes / kernel_s; " + w_formula("bytes")),
        "TFLOP_per_s": _rate(tfs, "TFLOP/s", "flops / kernel_s; " + w_formula("flops")),
        "frac_copy_ceiling": _rate(gbs / ceil["copy"]["value"], "fraction",
                                   "GB_per_s / ceilings.copy (device copy, read + write)"),
        "frac_matmul_ceiling": _rate(tfs / ceil["matmul"]["value"], "fraction",
                                     f"TFLOP_per_s / ceilings.matmul ({ceil['matmul']['params']['dtype']})"),
    }
    rec = _record("verify_attention", device, case, v, samples, rates, seed)
    rec["work"] = w
    return rec


def _attention_case(lib, device, bs, prefix, tree, dtype, seed, timer, ceil) -> list:
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
                rec = _record("verify_attention", device, case,
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
            r["rates"]["speedup_vs_torch"] = _rate(
                torch_rec["rates"]["kernel_s"]["value"] / r["rates"]["kernel_s"]["value"], "x",
                "torch path kernel_s / this path's kernel_s (same inputs, same run)")
    return out, skipped


def w_formula(kind: str) -> str:
    return {"bytes": "(total_kv*(Dl+Dr) + total_q*H*(Dl+Dr))*s + total_q*H*(Dl+1)*4 + total_q*W*4",
            "flops": "2*H*(2*Dl+Dr)*visible"}[kind]


def _fits(device, bs, prefix, tree, dtype) -> str | None:
    if device != "cuda":
        return None
    import torch

    s = {"float32": 4, "bfloat16": 2}[dtype]
    need = (bs * (prefix + tree) * 576 + bs * tree * 64 * 576) * s + bs * tree * 64 * 513 * 4
    free, _ = torch.cuda.mem_get_info()
    if need > MEMORY_FRACTION * free:
        return f"needs {need / 2**30:.1f} GiB, over {MEMORY_FRACTION:.0%} of {free / 2**30:.1f} GiB free"
    return None


def _guarded(fn, bench, device, case, seed):
    """Run one case; an exception becomes a failed record (the others still run)."""
    try:
        r = fn()
        return r if isinstance(r, list) else [r]
    except Exception as e:
        return [_record(bench, device, case, {"ok": False, "error": f"{type(e).__name__}: {e}"},
                        seed=seed)]


def run(ctx) -> dict:
    lib = ctx.require_library("suite kernels")
    root = np.random.SeedSequence()
    results, params = [], {"L": L, "K": "min(budget, 64)", "attention_shape": "Kimi K2",
                           "heads": KIMI_K2["heads"], "d_latent": KIMI_K2["d_latent"],
                           "d_rope": KIMI_K2["d_rope"], "attention_tol": ATTENTION_TOL,
                           "attention_timing": "kernel_s: CUDA graph of N calls / N (N up to 20, up to "
                           "5 replays, both cut to ~GRAPH_BUDGET_S, median); summary: one call between events, "
                           "L2 flushed",
                           "seed_entropy": str(root.entropy), "grids": {}, "timing": {}}
    for device in ctx.devices:
        if device == "cuda" and not lib.has_cuda:
            results.append(_record("all", device, {}, {"ok": False, "error":
                                   f"{lib.path} is a CPU-only build: no CUDA backend to time"}))
            continue
        g = grids(device, ctx.quick)
        params["grids"][device] = g
        params["timing"][device] = (
            "CUDA events, bare kdt_* calls on torch's stream; tree/accept without L2 flush "
            "(their inputs come hot from the drafter), attention with a 2x-L2 flush per rep"
            if device == "cuda" else
            "monotonic clock around bare kdt_* calls (CPU backend)"
            + ("; reduced attention grid (--quick: seconds)" if ctx.quick else
               "; reduced attention grid (the CPU backend is the double-precision reference "
               "speed path; the full grid runs on CUDA)"))
        tree_timer = _timer(device, ctx.quick, flush_l2=False)
        att_timer = _timer(device, ctx.quick, flush_l2=True, warmup=0)
        ga = g["attention"]
        n_cases = (len(g["tree"]["bs"]) * len(g["tree"]["budget"])
                   + len(ga["dtype"]) * len(ga["bs"]) * len(ga["prefix"]) * len(ga["tree"]))
        done = 0
        for bs in g["tree"]["bs"]:
            for budget in g["tree"]["budget"]:
                seed = int(root.spawn(1)[0].generate_state(1)[0])
                rng = np.random.default_rng(seed)
                results += _guarded(lambda: _tree_and_accept(lib, device, bs, budget, rng, seed,
                                                             tree_timer,
                                                             0.02 if ctx.quick else 0.1),
                                    "tree_build", device, {"bs": bs, "budget": budget}, seed)
                done += 1
                ctx.progress(done, n_cases, f"{device} tree bs={bs} budget={budget}")
        # The ceilings (a device copy and a large matmul at full power) only scale the attention
        # figures, so they are measured after the tree cases, and the device settles after them
        # (bench.timing.settle): on the H200, a bs 1 tree build timed right after the matmul
        # took 22.7-24.3 us as one call against 15.4 after a settled second (2026-12-01: the
        # suite's first tree cases replayed in fresh processes).
        ceil = ctx.ceilings(device)
        if device == "cuda":
            settle()
        for dtype in ga["dtype"]:
            for bs in ga["bs"]:
                for prefix in ga["prefix"]:
                    for tree in ga["tree"]:
                        case = {"bs": bs, "prefix": prefix, "tree": tree, "dtype": dtype}
                        seed = int(root.spawn(1)[0].generate_state(1)[0])
                        why = _fits(device, bs, prefix, tree, dtype)
                        done += 1
                        ctx.progress(done, n_cases, f"{device} attention {dtype} bs={bs} prefix={prefix} tree={tree}")
                        if why:
                            params.setdefault("skipped", []).append(dict(case, backend=device, why=why))
                            continue
                        if device == "cuda" and dtype == "float32" and bs not in ga["bs_float32"]:
                            continue  # fp32 is a reference path: a reduced grid

                        def att(bs=bs, prefix=prefix, tree=tree, dtype=dtype, seed=seed):
                            recs, skipped = _attention_case(lib, device, bs, prefix, tree, dtype,
                                                            seed, att_timer, ceil)
                            params.setdefault("skipped", []).extend(skipped)
                            return recs
                        results += _guarded(att, "verify_attention", device, case, seed)
                        if device == "cuda":
                            import torch

                            torch.cuda.empty_cache()
    # seconds of untimed device work before the process's first CUDA sample (bench.timing), or
    # None when nothing was timed on CUDA
    params["device_warmup_s"] = device_warmup_s()
    return {"params": params, "results": results, "table": table(results)}


def table(results) -> str:
    rows = []
    for r in results:
        c, s = r.get("case", {}), r.get("summary")
        shape = (f"bs={c.get('bs')} B={c.get('budget')}" if "budget" in c else
                 f"bs={c.get('bs')} P={c.get('prefix')} T={c.get('tree')} {c.get('dtype')} "
                 f"{c.get('path', '-')}" if "prefix" in c else "-")
        if "algo" in c:
            shape += f" {c['algo']}"
        if r.get("kernel_alone"):  # tree kernels on CUDA: the kernel alone beside the call
            shape += f" (alone {r['kernel_alone']['summary']['median'] * 1e6:.1f} us)"
        if r.get("cpu_states"):  # tree builds on the CPU: the fast state beside the median
            shape += f" (fast {r['cpu_states']['fast'] * 1e6:.1f} us)"
        rates = r.get("rates", {})
        if r["bench"] == "verify_attention" and rates:
            k = rates.get("kernel_s", {}).get("value")
            sp = rates.get("speedup_vs_torch", {}).get("value")
            rate = ((f"kernel {k * 1e6:.4g} us, " if k else "")
                    + f"{rates['TFLOP_per_s']['value']:.3g} TF/s ({rates['frac_matmul_ceiling']['value']:.0%} mm), "
                    f"{rates['GB_per_s']['value']:.3g} GB/s ({rates['frac_copy_ceiling']['value']:.0%} copy)"
                    + (f", {sp:.2f}x torch" if sp else ""))
        elif "nodes_per_s" in rates:
            rate = f"{rates['nodes_per_s']['value'] / 1e6:.2f} Mnodes/s"
        elif "requests_per_s" in rates:
            rate = f"{rates['requests_per_s']['value'] / 1e6:.3f} Mreq/s"
        else:
            rate = "-"
        status = "ok" if r["validation"].get("ok") else "INVALID: " + r["validation"].get("error", "")[:60]
        errs = r["validation"].get("rel_err")
        if r["validation"].get("ok") and r["bench"] == "verify_attention" and errs:
            status += f" (err {max(errs.values()):.2g} <= {r['validation']['tol']:g})"
        rows.append([r["bench"], r["backend"], shape, s["median"] * 1e6 if s else None,
                     s["p10"] * 1e6 if s else None, s["p90"] * 1e6 if s else None, rate, status])
    return format_table(["kernel", "dev", "case", "median us", "p10 us", "p90 us", "rate", "check"], rows)
