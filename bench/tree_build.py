"""Suite `tree_build`: the head-to-head at identical inputs, per (bs, budget).

Backends:
  native-cuda   kdt_tree_build's CUDA kernel (the default, KDT_TREE_BUILD=auto: the one-warp build
                up to budget 31, the block-parallel build above), a bare C-ABI call timed with
                CUDA events (inputs and outputs stay on the device; no L2 flush: a real step's
                drafter has just written the inputs, so they are L2-hot); the record's
                `kernel_alone` times the kernel alone (a CUDA graph of 20 calls, replayed, / 20)
  native-cuda-parallel  the same with KDT_TREE_BUILD=parallel (the block-parallel build always)
  native-cuda-serial  the same with KDT_TREE_BUILD=serial (the earlier serial kernel)
  native-cpu    the library's CPU backend, bare call, monotonic clock
  sglang-<dev>  engine.baselines.sglang_cpu.build_tree on torch tensors on <dev> (cuda when a
                GPU is present, else cpu), timed as SGLang runs it: its device-to-host copies,
                Python heap loop, host-to-device copies and syncs all inside the wall-clock
                sample, which ends with torch.cuda.synchronize() on a GPU
Every backend's output is checked against engine.reference.ddtree.build_tree (the reference) before it is
timed. Speedup of a native backend = median(sglang) / median(native) at the same (bs, budget).

Beside the grid, on CUDA (params, and two lines under the table):
  draws         native-cuda's kernel alone at bs 64, budget 63 (issue 15's first goal) on DRAWS
                more draws, each validated: at bs 64 a build takes as long as its slowest
                request, so the grid's one draw of that case says little about the next
  graph_floor   a one-element torch fill timed the same way (kernel alone): the part of any
                kernel-alone figure that is the graph's launch of a node, not the kernel's work
"""

from __future__ import annotations

import time

import numpy as np

from bench import format_table
from bench.inputs import tree_inputs
from bench.native_calls import prepare_tree_build
from bench.timing import (CpuStateRounds, cpu_states, device_warmup_s, summarize, time_cpu,
                          time_cuda, time_cuda_graph)
from bench.tree_algo import ALGOS, side_stream, tree_algo
from bench.validate import TREE_FIELDS, check_exact, sample_requests

NAME = "tree_build"
L = 15
# The case drawn again (bs, budget) and how many draws (draws, above).
DRAW_CASE = (64, 63)
DRAWS = 16
# Every request's committed length: the SGLang-style path builds a [n, seq_len + n] bool mask per
# request, so its cost grows with it; one fixed value keeps runs comparable.
SEQ_LEN = 4096
# Names the SGLang-style output may use for our arrays (SGLang's own names second).
_ALIASES = {
    "tokens": ("tokens", "draft_tokens"),
    "positions": ("positions",),
    "first_child": ("first_child", "retrive_next_token"),
    "next_sibling": ("next_sibling", "retrive_next_sibling"),
    "parents": ("parents",),
    "depths": ("depths",),
    "num_nodes": ("num_nodes",),
    "scores": ("scores",),
    "visibility": ("visibility",),  # packed on access by the baseline: read only to validate
}


def grid(quick: bool) -> dict:
    if quick:
        return {"bs": [1, 64], "budget": [15, 255]}
    return {"bs": [1, 4, 16, 64, 256], "budget": [15, 63, 255, 1023]}


def _sglang_fields(out, ref, bs: int) -> dict:
    """{our name: numpy array [bs, ...] shaped and typed like the reference's rows} for the
    fields the baseline returns (`ref` may hold only a subsample of the bs requests)."""
    from bench.native_calls import to_numpy

    found = {}
    for ours, names in _ALIASES.items():
        for nm in names:
            v = out.get(nm) if isinstance(out, dict) else getattr(out, nm, None)
            if v is None:
                continue
            a = to_numpy(v)
            want = np.asarray(getattr(ref, ours))
            shape = (bs,) + want.shape[1:]
            if a.size == int(np.prod(shape)):
                found[ours] = a.reshape(shape).astype(want.dtype)
            break
    return found


def _check_sglang(out, ref, rows, bs: int) -> dict:
    found = _sglang_fields(out, ref, bs)
    missing = [f for f in ("tokens", "first_child", "next_sibling") if f not in found]
    if missing:
        have = sorted(out) if isinstance(out, dict) else sorted(
            k for k in dir(out) if not k.startswith("_"))
        return {"ok": False, "error": f"SGLang-style output lacks {missing} (or its shape differs "
                                      f"from the reference's); it has {have}"}
    sub = {k: v[rows] for k, v in found.items()}
    v = check_exact(sub, ref, sorted(found), None, where="sglang: ")
    if v["ok"]:
        v["checked"] = f"requests {list(rows)}"
    return v


def _sglang_runner(device: str, inp: dict, budget: int):
    """() -> output of one SGLang-style build on torch tensors on `device`, synced at the end."""
    import torch

    from engine.baselines import sglang_cpu

    t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in inp.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        out = sglang_cpu.build_tree(t["top_logp"], t["top_ids"], budget, t["root_ids"],
                                    t["seq_lens"], device=device)
        sync()
        return out

    return call


def _time_slow(fn, first_call_s: float, quick: bool) -> list:
    """Wall-clock samples of a path that syncs by design; at least 3, fewer warm-ups when slow."""
    return time_cpu(fn, warmup=0 if first_call_s > 0.5 else 1, reps=50,
                    budget_s=1.0 if quick else 3.0, min_reps=3)


def _rec(backend, case, v, samples=None, seed=None, timing=None) -> dict:
    r = {"bench": "tree_build", "backend": backend, "case": case, "validation": v,
         "seed": seed, "samples": samples or [], "timing": timing}
    if samples:
        r["summary"] = summarize(samples)
        med = r["summary"]["median"]
        r["rates"] = {"nodes_per_s": {"value": case["bs"] * case["budget"] / med,
                                      "unit": "nodes/s", "formula": "bs * budget / median"}}
    return r


def _native(lib, dev, name, inp, budget, ref, rows, bs, case, seed, quick, rounds=None,
            algo=None) -> dict:
    """One native backend (KDT_TREE_BUILD=algo, set by the caller): validated, then timed
    (CUDA: also the kernel alone; the CPU: its states, measured again between later cases by
    `rounds`, a bench.timing.CpuStateRounds, when given)."""
    prep = prepare_tree_build(lib, dev, inp, budget)
    prep.run()
    if dev == "cuda":
        import torch

        torch.cuda.synchronize()
    v = check_exact(prep.outputs, ref, TREE_FIELDS, None if len(rows) == bs else rows)
    if not v["ok"]:
        return _rec(name, case, v, seed=seed)
    if dev == "cuda":
        s = time_cuda(prep.run, warmup=5, reps=200, flush_l2=False, budget_s=0.2)
        rec = _rec(name, case, v, s, seed, "CUDA events around the bare kernel call")
        g = time_cuda_graph(prep.run, calls=20, reps=20)
        rec["kernel_alone"] = {"summary": summarize(g), "samples": g,
                               "timing": "20 calls in one CUDA graph, replayed, / 20"}
        return rec
    s = time_cpu(prep.run, warmup=2, reps=200, budget_s=0.1 if quick else 0.5)
    rec = _rec(name, case, v, s, seed, "monotonic clock around the bare CPU-backend call")
    rec["cpu_states"] = cpu_states(prep.run, budget_s=0.02 if quick else 0.1)
    if rounds is not None:
        rounds.track(prep.run, rec, lambda: tree_algo(algo), keep=prep)
    return rec


def _inputs(seed: int, bs: int, budget: int):
    """A case's requests (the first draw of default_rng(seed)), the rows validated, and the
    reference's trees of those rows."""
    from engine.reference import ddtree

    inp = tree_inputs(np.random.default_rng(seed), bs, L, min(budget, 64), seq_len=SEQ_LEN)
    rows = sample_requests(bs, budget)
    ref = ddtree.build_tree(*(inp[k][rows] for k in ("top_logp", "top_ids")), budget,
                            *(inp[k][rows] for k in ("root_ids", "seq_lens")))
    return inp, rows, ref


def _case_of(bs: int, budget: int) -> dict:
    return {"bs": bs, "budget": budget, "L": L, "K": min(budget, 64), "seq_len": SEQ_LEN}


def _case(lib, devices, bs, budget, seed, quick, rounds=None) -> list:
    case = _case_of(bs, budget)
    inp, rows, ref = _inputs(seed, bs, budget)
    recs = []
    for dev in devices:
        for algo in ALGOS[dev]:
            name = f"native-{dev}" + ("" if algo == ALGOS[dev][0] else f"-{algo}")
            try:
                with side_stream(dev), tree_algo(algo):
                    recs.append(_native(lib, dev, name, inp, budget, ref, rows, bs, case, seed,
                                        quick, rounds, algo))
            except Exception as e:
                recs.append(_rec(name, case, {"ok": False, "error": f"{type(e).__name__}: {e}"},
                                 seed=seed))
    sg_dev = "cuda" if "cuda" in devices else "cpu"
    name = f"sglang-{sg_dev}"
    try:
        call = _sglang_runner(sg_dev, inp, budget)
        t0 = time.perf_counter()
        out = call()
        first = time.perf_counter() - t0
        v = _check_sglang(out, ref, rows, bs)
        if v["ok"]:
            s = _time_slow(call, first, quick)
            recs.append(_rec(name, case, v, s, seed,
                             "monotonic clock around the whole call, its syncs and copies included"
                             + (", ending with torch.cuda.synchronize()" if sg_dev == "cuda" else "")))
        else:
            recs.append(_rec(name, case, v, seed=seed))
    except Exception as e:
        recs.append(_rec(name, case, {"ok": False, "error": f"{type(e).__name__}: {e}"}, seed=seed))
    base = next((r for r in recs if r["backend"] == name and r.get("summary")), None)
    for r in recs:
        if base is not None and r is not base and r.get("summary"):
            r["rates"]["speedup_vs_sglang"] = {
                "value": base["summary"]["median"] / r["summary"]["median"], "unit": "x",
                "formula": f"median({name}) / median({r['backend']})"}
    return recs


def _draws(lib, seeds: list) -> tuple[dict, list]:
    """native-cuda (the default build) on DRAW_CASE drawn once per seed: each draw validated,
    then timed as the kernel alone. Returns the params entry and a record (backend
    native-cuda-draws) for each draw that fails validation, which is not timed."""
    import torch

    bs, budget = DRAW_CASE
    timed, alone, bad = [], [], []
    for seed in seeds:
        inp, rows, ref = _inputs(seed, bs, budget)
        with side_stream("cuda"), tree_algo(ALGOS["cuda"][0]):
            p = prepare_tree_build(lib, "cuda", inp, budget)
            p.run()
            torch.cuda.synchronize()
            v = check_exact(p.outputs, ref, TREE_FIELDS, None if len(rows) == bs else rows)
            if not v["ok"]:
                bad.append(_rec("native-cuda-draws", _case_of(bs, budget), v, seed=seed))
                continue
            alone.append(summarize(time_cuda_graph(p.run, calls=20, reps=20))["median"])
            timed.append(seed)
    return {"bs": bs, "budget": budget, "backend": "native-cuda", "seeds": timed,
            "kernel_alone_s": alone, "invalid_seeds": [r["seed"] for r in bad],
            "timing": "per draw: the median of 20 replays of 20 calls in one CUDA graph, / 20"}, bad


def _graph_floor() -> dict:
    """A one-element torch fill as the kernel alone, timed as the builds are."""
    import torch

    with side_stream("cuda"):
        x = torch.zeros(1, device="cuda")
        s = time_cuda_graph(lambda: x.fill_(1.0), calls=20, reps=20)
    return {"summary": summarize(s), "samples": s,
            "what": "torch fill_ of one float32 element, 20 calls in one CUDA graph, / 20"}


def extras(params: dict, limit: float | None = None) -> str:
    """The lines under the table for params' draws and graph_floor (empty without them); with
    `limit` (us), how many draws it holds. A malformed entry raises KeyError, TypeError or
    ValueError."""
    lines = []
    d = params.get("draws")
    if d:
        us = sorted(float(x) * 1e6 for x in d["kernel_alone_s"])
        bad = len(d.get("invalid_seeds") or [])
        head = f"native-cuda bs {int(d['bs'])} budget {int(d['budget'])}"
        if us:
            lines.append(f"{head}, {len(us)} more draws, kernel alone: min {us[0]:.2f}, median "
                         f"{float(np.median(us)):.2f}, max {us[-1]:.2f} us"
                         + (f"; {sum(x <= limit for x in us)} of {len(us)} <= {limit:g} us"
                            if limit else "") + (f"; {bad} draws INVALID" if bad else ""))
        else:
            lines.append(f"{head} draws: none timed ({bad} INVALID)")
    f = params.get("graph_floor")
    if f:
        lines.append(f"graph floor (a one-element torch fill, kernel alone): "
                     f"{float(f['summary']['median']) * 1e6:.2f} us")
    return "\n".join(lines)


def run(ctx) -> dict:
    import os

    import torch

    lib = ctx.require_library("suite tree_build")
    devices = [d for d in ctx.devices if d == "cpu" or lib.has_cuda]
    root = np.random.SeedSequence()
    g = grid(ctx.quick)
    params = {"L": L, "K": "min(budget, 64)", "seq_len": SEQ_LEN, "grid": g, "devices": devices,
              "sglang_device": "cuda" if "cuda" in devices else "cpu",
              # the SGLang-style path's small torch ops are sensitive to intra-op threads on a
              # busy machine: recorded so that a slow baseline can be told from a loaded host
              "torch_threads": torch.get_num_threads(), "load_avg_before": list(os.getloadavg()),
              "seed_entropy": str(root.entropy),
              "speedup": "median(sglang path) / median(native backend), same inputs"}
    if "cuda" in ctx.devices and "cuda" not in devices:
        params["note"] = f"{lib.path} is a CPU-only build: no native-cuda backend timed"
    results = []
    done, n_cases = 0, len(g["bs"]) * len(g["budget"])
    rounds = CpuStateRounds(budget_s=0.005 if ctx.quick else 0.02)
    for bs in g["bs"]:
        for budget in g["budget"]:
            seed = int(root.spawn(1)[0].generate_state(1)[0])
            results += _case(lib, devices, bs, budget, seed, ctx.quick, rounds)
            rounds.round()
            done += 1
            ctx.progress(done, n_cases, f"bs={bs} budget={budget}")
    if "cuda" in devices and not ctx.quick:
        params["draws"], bad = _draws(lib, [int(root.spawn(1)[0].generate_state(1)[0])
                                            for _ in range(DRAWS)])
        results += bad
        params["graph_floor"] = _graph_floor()
    # seconds of untimed device work before the process's first CUDA sample (bench.timing), or
    # None when nothing was timed on CUDA
    params["device_warmup_s"] = device_warmup_s()
    more = extras(params)
    return {"params": params, "results": results,
            "table": table(results) + ("\n" + more if more else "")}


def table(results) -> str:
    rows = []
    for r in results:
        c, s = r["case"], r.get("summary")
        sp = r.get("rates", {}).get("speedup_vs_sglang")
        ka, st = r.get("kernel_alone"), r.get("cpu_states")
        rows.append([r["backend"], c["bs"], c["budget"], s["median"] * 1e6 if s else None,
                     ka["summary"]["median"] * 1e6 if ka else None,
                     st["fast"] * 1e6 if st else None,
                     s["p10"] * 1e6 if s else None, s["p90"] * 1e6 if s else None,
                     f"{sp['value']:.1f}x" if sp else "-",
                     "ok" if r["validation"].get("ok") else "INVALID: " + r["validation"].get("error", "")[:60]])
    return format_table(["backend", "bs", "budget", "median us", "alone us", "cpu fast us",
                         "p10 us", "p90 us", "vs sglang", "check"], rows)
