"""Suite `kernels`: tree build, tree accept and verify attention, per backend, over a grid.

This module is the suite (grids, run, table) and its tree build / accept cases; the verify-
attention cases (paths, torch peers, their tolerances and work formulas) are in
bench/kernels_attention.py, and the record helpers both share in bench/kernels_records.py.
Every case is validated against the reference (engine.reference.ddtree, engine.reference.mla) on the very buffers
the timed call writes, then timed as a bare C-ABI call (bench/native_calls.py): CUDA events on
the GPU, the monotonic clock on the CPU. Rates (formulas in each record):
  tree build   nodes/s = bs * budget / t
  tree accept  requests/s = bs / t
  attention    bytes and FLOPs of each call, as fractions of the run's measured ceilings
               (formulas and the attention rows: bench/kernels_attention.py).
Grids: the issue's full grid on CUDA (fp32, a reference path, on bs 1 and 4 only); a reduced
attention grid on the CPU (the CPU backend computes in double precision and is a
reference-speed backend, not a fast path).
"""

from __future__ import annotations

import numpy as np

from bench import format_table
from bench.inputs import KIMI_K2, accept_target, tree_inputs
from bench.kernels_attention import (ATTENTION_PATHS, ATTENTION_TOL, PEERS, attention_case,
                                     fits)
from bench.kernels_records import rate, record, sync
from bench.native_calls import prepare_tree_accept, prepare_tree_build, to_numpy
from bench.timing import (CpuStateRounds, cpu_states, device_warmup_s, settle, summarize,
                          time_cpu, time_cuda, time_cuda_graph)
from bench.tree_algo import ALGOS, side_stream, tree_algo
from bench.validate import ACCEPT_FIELDS, TREE_FIELDS, check_exact, sample_requests

NAME = "kernels"
L = 15  # drafter block 16 -> 15 drafted depths (DDTREE.md section 1)


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


def _tree_and_accept(lib, device, bs, budget, rng, seed, timer, states_s=0.1,
                     rounds=None) -> list:
    """Build (validated, timed) with each algorithm, then accept on the built tree (validated,
    timed). On CUDA each is timed two ways: one call between events (`timer`, launch from
    Python included) and the kernel alone (`kernel_alone`: a CUDA graph of N calls / N). On the
    CPU the build's record also holds its two speeds (`cpu_states`, within states_s seconds),
    which `rounds` (bench.timing.CpuStateRounds), when given, measures again later."""
    with side_stream(device):  # graph capture needs a stream other than the legacy default
        return _tree_and_accept_on_stream(lib, device, bs, budget, rng, seed, timer, states_s,
                                          rounds)


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


def _tree_and_accept_on_stream(lib, device, bs, budget, rng, seed, timer, states_s,
                               rounds) -> list:
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
            sync(device)
            v = check_exact(p.outputs, ref, TREE_FIELDS, None if len(rows) == bs else rows)
            if not v["ok"]:
                out.append(record("tree_build", device, case, v, seed=seed))
                continue
            s = timer(p.run)
            alone = _kernel_alone(device, p.run)
            states = cpu_states(p.run, budget_s=states_s) if device == "cpu" else None
        med = summarize(s)["median"]
        rec = record("tree_build", device, case, v, s, {
            "nodes_per_s": rate(bs * budget / med, "nodes/s", "bs * budget / median"),
            "us_per_request": rate(med / bs * 1e6, "us", "median / bs"),
        }, seed)
        if alone:
            rec["kernel_alone"] = alone
        if states:
            rec["cpu_states"] = states
            if rounds is not None:
                rounds.track(p.run, rec, lambda a=algo: tree_algo(a), keep=p)
        out.append(rec)
        prep = prep or p
    if prep is None:
        return out

    tree = ddtree.Tree(**{f: to_numpy(prep.outputs[f]).view(np.uint32) if f == "visibility"
                          else to_numpy(prep.outputs[f]) for f in TREE_FIELDS})
    target = accept_target(rng, tree)
    acc = prepare_tree_accept(lib, device, tree, target)
    acc.run()
    sync(device)
    ref_acc = ddtree.accept_greedy(tree, target)
    v = check_exact(acc.outputs, ref_acc, ACCEPT_FIELDS)
    v["mean_accept_len"] = float(np.mean(ref_acc.accept_len))
    case_a = {"bs": bs, "budget": budget, "L": L, "K": K, "n": budget + 1}
    if not v["ok"]:
        out.append(record("tree_accept", device, case_a, v, seed=seed))
        return out
    s = timer(acc.run)
    med = summarize(s)["median"]
    rec = record("tree_accept", device, case_a, v, s, {
        "requests_per_s": rate(bs / med, "requests/s", "bs / median")}, seed)
    alone = _kernel_alone(device, acc.run)
    if alone:
        rec["kernel_alone"] = alone
    out.append(rec)
    return out



def _guarded(fn, bench, device, case, seed):
    """Run one case; an exception becomes a failed record (the others still run)."""
    try:
        r = fn()
        return r if isinstance(r, list) else [r]
    except Exception as e:
        return [record(bench, device, case, {"ok": False, "error": f"{type(e).__name__}: {e}"},
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
            results.append(record("all", device, {}, {"ok": False, "error":
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
        rounds = CpuStateRounds(budget_s=0.005 if ctx.quick else 0.02)
        for bs in g["tree"]["bs"]:
            for budget in g["tree"]["budget"]:
                seed = int(root.spawn(1)[0].generate_state(1)[0])
                rng = np.random.default_rng(seed)
                results += _guarded(lambda: _tree_and_accept(lib, device, bs, budget, rng, seed,
                                                             tree_timer,
                                                             0.02 if ctx.quick else 0.1, rounds),
                                    "tree_build", device, {"bs": bs, "budget": budget}, seed)
                rounds.round()
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
                        why = fits(device, bs, prefix, tree, dtype)
                        done += 1
                        ctx.progress(done, n_cases, f"{device} attention {dtype} bs={bs} prefix={prefix} tree={tree}")
                        if why:
                            params.setdefault("skipped", []).append(dict(case, backend=device, why=why))
                            continue
                        if device == "cuda" and dtype == "float32" and bs not in ga["bs_float32"]:
                            continue  # fp32 is a reference path: a reduced grid

                        def att(bs=bs, prefix=prefix, tree=tree, dtype=dtype, seed=seed):
                            recs, skipped = attention_case(lib, device, bs, prefix, tree, dtype,
                                                            seed, att_timer, ceil)
                            params.setdefault("skipped", []).extend(skipped)
                            return recs
                        results += _guarded(att, "verify_attention", device, case, seed)
                        rounds.round()  # the CPU's tree builds again, later in the suite
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
