"""The "What this means" section of docs/BENCHMARKS_<host>.md, computed from suite JSONs.

Every figure here is read or derived from the suites' records (bench/__init__.py, schema 1);
nothing is typed by hand. `view` is {"suites": {name: doc}, "from": {name: run id}}: each suite
from the run engine/remote/report.py chose for it (the newest clean run that has it), so the
tree build, kernels, e2e and service figures may come from different runs (the page says which).
"""

from __future__ import annotations

from pathlib import Path

KIMI_LAYERS = 61  # Kimi K2 / DeepSeek-V3 decoder layers: one verify attention per layer per step
HEAD_BS, HEAD_BUDGETS = (1, 64), (15, 255)  # the tree build's headline grid
ATT_GRID = {"dtype": ("float32", "bfloat16"), "bs": (1, 64), "prefix": (4096, 32768), "tree": (1, 64)}
# Row order of the attention paths: ours (KDT_VERIFY_PATH values; mma16, mma-small, mma-smallq
# = mma with KDT_MMA_TILE=16, small, smallq; records before paths were recorded are the auto
# path), then the torch peers (bench/kernels_attention.py).
ATT_PATHS = ("auto", "cpu", "simt", "mma", "mma16", "mma-small", "mma-smallq", "sm90a", "torch",
             "sdpa")
ATT_PEERS = ("torch", "sdpa")


def att_path(r) -> str:
    return r["case"].get("path", "auto")


def att_kernel_s(r) -> float:
    """Kernel-alone time (CUDA graph of N calls / N) where recorded, else the one-call median."""
    return ((r.get("rates") or {}).get("kernel_s") or {}).get("value") or r["summary"]["median"]


# ---------------------------------------------------------------- records ----------------

def timed(doc, bench=None):
    """The records of a suite doc that carry a timing summary (optionally of one bench)."""
    for r in (doc or {}).get("results", []):
        if r.get("summary") and (bench is None or r.get("bench") == bench):
            yield r


def e2e_records(view, model: str = "tiny") -> list:
    """The timed e2e records of one target (`model`; records of runs before the model dimension
    have none and are tiny's)."""
    return [r for r in timed(view["suites"].get("e2e")) if (r.get("model") or "tiny") == model]


def service_records(view, target: str = "tiny") -> list:
    """The timed service records of one target (`target`; older records have none: tiny's, or
    the `weights` option's folder)."""
    return [r for r in timed(view["suites"].get("service"))
            if (r.get("target") or "tiny") in ((target, "weights") if target == "tiny" else (target,))]


def tree_records(view) -> list:
    """Tree-build records: the head-to-head suite, else the kernels suite's tree_build."""
    recs = list(timed(view["suites"].get("tree_build"), "tree_build"))
    if not recs:
        # one backend per algorithm (the kernels suite times "auto", the default, "parallel" and
        # "serial" on CUDA)
        recs = [dict(r, backend=f"native-{r['backend']}" + (
                    f"-{r['case']['algo']}" if r["case"].get("algo") in ("parallel", "serial")
                    and r["backend"] == "cuda" else ""))
                for r in timed(view["suites"].get("kernels"), "tree_build")]
    return recs


def _record(recs, backend, bs, budget):
    """The first record of a backend's (bs, budget) case, or None."""
    return next((r for r in recs if r["backend"] == backend and r["case"].get("bs") == bs
                 and r["case"].get("budget") == budget), None)


def median(recs, backend, bs, budget):
    r = _record(recs, backend, bs, budget)
    return r["summary"]["median"] if r else None


def kernel_alone(recs, backend, bs, budget):
    """The kernel-alone median (bench/tree_build.py's `kernel_alone`) of a case, or None."""
    r = _record(recs, backend, bs, budget) or {}
    return ((r.get("kernel_alone") or {}).get("summary") or {}).get("median")


def cpu_fast(recs, backend, bs, budget):
    """The CPU call's fast state (bench/timing.py's `cpu_states`) of a case, or None."""
    r = _record(recs, backend, bs, budget) or {}
    return (r.get("cpu_states") or {}).get("fast")


def native_backend(recs) -> str | None:
    names = {r["backend"] for r in recs}
    return next((b for b in ("native-cuda", "native-cpu") if b in names), None)


def sglang_backend(recs) -> str | None:
    return next((b for b in sorted({r["backend"] for r in recs}) if b.startswith("sglang")), None)


def headline(view) -> dict:
    """{(bs, budget): speedup of the fastest native backend over the SGLang-style path}."""
    recs = tree_records(view)
    nat, sg = native_backend(recs), sglang_backend(recs)
    out = {}
    if nat and sg:
        for bs in HEAD_BS:
            for budget in HEAD_BUDGETS:
                a, b = median(recs, sg, bs, budget), median(recs, nat, bs, budget)
                if a and b:
                    out[(bs, budget)] = a / b
    return out


def us(s) -> str:
    if s is None:
        return "-"
    if s >= 1.0:
        return f"{s:.2f} s"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def pct(x) -> str:
    """A percentage with two significant digits (0.0031% stays readable)."""
    v = 100.0 * x
    return f"{v:.2g}%" if v < 10 else f"{v:.0f}%"


def ceilings(view) -> dict:
    out = {}
    for d in view["suites"].values():
        for dev, c in (d.get("ceilings") or {}).items():
            out.setdefault(dev, c)
    return out


def _src(view, suite) -> str:
    rid = (view.get("from") or {}).get(suite)
    why = (view.get("why") or {}).get(suite)
    return (f", run `{rid}`" + (f"; **caution: {why}**" if why else "")) if rid else ""


def _rate(r, key):
    """A rate of an e2e record: a bare number, or {"value": ...}."""
    v = (r.get("rates") or {}).get(key)
    v = v.get("value") if isinstance(v, dict) else v
    return v if isinstance(v, (int, float)) else None


def e2e_device(view, model: str = "tiny") -> str | None:
    devs = {r.get("backend") for r in e2e_records(view, model)}
    return next((d for d in ("cuda", "cpu") if d in devs), None)


def e2e_drafters(recs) -> list:
    """Oracle qualities in order, then the trained block drafter (the random one is a control)."""
    names = {r.get("drafter") for r in recs if r.get("mode") == "ddtree"}
    oracles = sorted((n for n in names if str(n).startswith("oracle:")), key=lambda n: float(n.split(":")[1]))
    return oracles + [n for n in ("block:trained", "block") if n in names]


def e2e_find(recs, dev, batch, mode, budget=None, drafter=None):
    for r in recs:
        if (r.get("backend"), r.get("batch"), r.get("mode")) == (dev, batch, mode) and \
                (mode == "ar" or (r.get("budget"), r.get("drafter")) == (budget, drafter)):
            return r
    return None


def step_time(r) -> float | None:
    """Wall time per target forward of an e2e record: batch / (forwards per token x tokens/s).
    For AR that is one decode step; for DDTree one round (draft + tree build + one verify
    forward + accept)."""
    tps, fpt = _rate(r, "tokens_per_s"), _rate(r, "target_forwards_per_token")
    if not tps or not fpt or not r.get("batch"):
        return None
    return r["batch"] / (fpt * tps)


# ---------------------------------------------------------------- sections ---------------

def _tree_lines(view) -> list:
    recs = tree_records(view)
    nat, sg = native_backend(recs), sglang_backend(recs)
    natives = [b for b in ("native-cuda", "native-cpu") if any(r["backend"] == b for r in recs)]
    out = []
    if not natives:
        return out
    src = _src(view, "tree_build" if view["suites"].get("tree_build") else "kernels")
    if sg:
        out.append(f"Tree build against the SGLang-style path ({src[2:] or 'this run'}), medians of the same inputs:")
        out.append("")
        for bs in HEAD_BS:
            for budget in HEAD_BUDGETS:
                t_sg = median(recs, sg, bs, budget)
                parts = []
                for b in natives:
                    t = median(recs, b, bs, budget)
                    if t and t_sg:
                        parts.append(f"{b} {us(t)} vs {sg} {us(t_sg)}, **{t_sg / t:.1f}x** faster")
                if parts:
                    out.append(f"- Tree build, bs = {bs}, budget = {budget}: " + "; ".join(parts) + ".")
    else:
        out.append(f"- Tree build ({src[2:] or 'this run'}): no SGLang-style path in this run, so no speedup; {nat} at "
                   f"bs = 64, budget = 255: {us(median(recs, nat, 64, 255))}.")
    if len(natives) == 2:
        cases = sorted({(r["case"]["bs"], r["case"]["budget"]) for r in recs})
        cpu = {c: median(recs, "native-cpu", *c) for c in cases}
        fast = {c: cpu_fast(recs, "native-cpu", *c) for c in cases}
        alone = {c: kernel_alone(recs, "native-cuda", *c) for c in cases}
        for what, cuda, host in (
                ("One call of the CUDA kernel (CUDA events around it) vs the native CPU backend's call",
                 {c: median(recs, "native-cuda", *c) for c in cases}, cpu),
                ("The CUDA kernel alone (a CUDA graph of calls, replayed, per call) vs the native CPU "
                 "backend's call", alone, cpu),
                ("The CUDA kernel alone vs the native CPU backend's call at its fast state (the runs of "
                 "calls back to back near the fastest: the host toggles the call between two speeds)",
                 alone, fast)):
            line = _cpu_vs_cuda(what, cuda, host)
            if line:
                out.append(line)
    return out


def _cpu_vs_cuda(what: str, cuda: dict, cpu: dict) -> str | None:
    """One line: over the (bs, budget) cases timed on both, where the CPU backend is faster (and by
    how much) and where the CUDA kernel is most ahead; None when no case has both times."""
    ratio = {c: t / cpu[c] for c, t in cuda.items() if t and cpu.get(c)}
    if not ratio:
        return None
    cpu_wins = [c for c, x in ratio.items() if x > 1]
    gpu_wins = [c for c, x in ratio.items() if x <= 1]
    line = f"- {what} over {len(ratio)} (bs, budget) cases: "
    if cpu_wins:
        line += (f"**the CPU backend is faster at {len(cpu_wins)}**: "
                 + ", ".join(f"bs {b} B {g} ({ratio[(b, g)]:.1f}x)" for b, g in cpu_wins))
    else:
        line += "the CPU backend is faster at none"
    if gpu_wins:
        best = min(gpu_wins, key=lambda c: ratio[c])
        line += (f"; the CUDA kernel is faster at {len(gpu_wins)}, most at bs {best[0]} B {best[1]} "
                 f"({1 / ratio[best]:.1f}x: {us(cuda[best])} vs {us(cpu[best])})")
    return line + ". (x: how many times faster the winner is.)"


def _step_lines(view) -> list:
    recs_t = tree_records(view)
    nat, sg = native_backend(recs_t), sglang_backend(recs_t)
    e2e = e2e_records(view)
    dev = e2e_device(view)
    if not e2e or not nat or not dev:
        return []
    w = (view["suites"]["e2e"].get("params") or {}).get("weights", "?")
    weights = Path(str(w["path"] if isinstance(w, dict) else w)).name  # dict: bench/weights.py
    drafters = e2e_drafters(e2e)
    drafter = drafters[-1] if drafters else None
    out = []
    for batch in sorted({r["batch"] for r in e2e if r.get("backend") == dev}):
        ar = e2e_find(e2e, dev, batch, "ar")
        ar_step = step_time(ar) if ar else None
        for budget in sorted({r.get("budget") for r in e2e if r.get("mode") == "ddtree"}):
            r = e2e_find(e2e, dev, batch, "ddtree", budget, drafter)
            step = step_time(r) if r else None
            t_nat = median(recs_t, nat, batch, budget)
            if not step or not t_nat:
                continue
            t_sg = median(recs_t, sg, batch, budget) if sg else None
            out.append(
                f"- Measured decode step (e2e{_src(view, 'e2e')}, {dev}, weights `{weights}`, bs = {batch}, "
                f"DDTree budget {budget}, drafter {drafter}): {us(step)} per target forward "
                f"(one DDTree round: draft, tree build, one verify forward, accept)"
                + (f"; an AR step (one target forward) is {us(ar_step)}" if ar_step else "")
                + f". The {nat} tree build at that bs and budget ({us(t_nat)}) is {pct(t_nat / step)} of it"
                + (f"; the SGLang-style path ({us(t_sg)}) would be {pct(t_sg / step)}" if t_sg else "") + ".")
    if out:
        out.append("  These steps are the tiny test model's (a few layers, small vocabulary), so the "
                   "tree build's share is far larger than at a real model's step; the Kimi-shape "
                   "attention bound below is the realistic denominator.")
    return out


def _attention_lines(view) -> list:
    att = list(timed(view["suites"].get("kernels"), "verify_attention"))
    recs_t = tree_records(view)
    nat, sg = native_backend(recs_t), sglang_backend(recs_t)
    if not att:
        return []
    out = []
    rows = []
    dev = "cuda" if any(r["backend"] == "cuda" for r in att) else att[0]["backend"]
    order = {p: i for i, p in enumerate(ATT_PATHS)}
    for dtype in ATT_GRID["dtype"]:
        for bs in ATT_GRID["bs"]:
            for prefix in ATT_GRID["prefix"]:
                for tree in ATT_GRID["tree"]:
                    rs = sorted((r for r in att if r["backend"] == dev and r["case"].get("dtype") == dtype
                                 and r["case"].get("bs") == bs and r["case"].get("prefix") == prefix
                                 and r["case"].get("tree") == tree),
                                key=lambda r: order.get(att_path(r), len(order)))
                    for r in rs:
                        rt = r.get("rates") or {}
                        v = lambda k: (rt.get(k) or {}).get("value")  # noqa: E731
                        mm_formula = (rt.get("frac_matmul_ceiling") or {}).get("formula", "")
                        mm_dtype = mm_formula.split("(")[-1].rstrip(")") if "(" in mm_formula else "?"
                        sp = v("speedup_vs_torch")
                        rows.append(f"| {dtype} | {bs} | {prefix} | {tree} | {att_path(r)} | "
                                    f"{us(att_kernel_s(r))} | {us(r['summary']['median'])} | "
                                    f"{v('TFLOP_per_s') or 0:.2f} | {pct(v('frac_matmul_ceiling') or 0)} ({mm_dtype}) | "
                                    f"{v('GB_per_s') or 0:.1f} | {pct(v('frac_copy_ceiling') or 0)} | "
                                    + (f"{sp:.2f}x" if sp else "-") + " |")
    if rows:
        c = ceilings(view).get(dev) or {}
        cc, cm = (c.get("copy") or {}).get("value"), (c.get("matmul") or {}).get("value")
        out += [f"Verify attention at the Kimi K2 shape ({dev}, one layer, 64 heads, latent 512 + "
                f"rope 64{_src(view, 'kernels')}), per path on the same inputs (ours forced by "
                "KDT_VERIFY_PATH; torch = bmm, masked fill, softmax, bmm; sdpa = "
                "scaled_dot_product_attention with a boolean mask); kernel = a CUDA graph of N calls / N, "
                "one call = between events with L2 flushed; rates from the kernel time, as fractions of "
                "this run's measured ceilings"
                + (f" (copy {cc:.0f} GB/s read + write, matmul {cm:.0f} TFLOP/s)" if cc and cm else "") + ":",
                "", "| cache | bs | prefix | tree | path | kernel | one call | TFLOP/s | of matmul ceiling "
                "| GB/s | of copy ceiling | vs torch |",
                "|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|"] + rows + [""]
    if recs_t and nat:
        # The Kimi K2 shape: a step is bounded below by its verify attention alone.
        for bs, budget, tree in ((1, 15, 16), (64, 63, 64)):
            cands = [r for r in att if r["case"]["bs"] == bs and r["case"]["tree"] == tree
                     and r["case"]["dtype"] == "bfloat16" and att_path(r) not in ATT_PEERS]
            t_nat = median(recs_t, nat, bs, budget)
            if not cands or not t_nat:
                continue
            top = max(r["case"]["prefix"] for r in cands)  # the fastest of our paths there
            a = min((r for r in cands if r["case"]["prefix"] == top), key=lambda r: r["summary"]["median"])
            step_att = KIMI_LAYERS * a["summary"]["median"]
            t_sg = median(recs_t, sg, bs, budget) if sg else None
            out.append(
                f"- bs = {bs}, tree of {tree} nodes (budget {budget}), prefix {a['case']['prefix']}: "
                f"the verify attention alone costs {KIMI_LAYERS} layers x {us(a['summary']['median'])}"
                f" = {us(step_att)} per step ({a['backend']}, bf16 cache; a lower bound: the "
                f"MoE and projections come on top). The {nat} tree build adds {us(t_nat)} = {pct(t_nat / step_att)} of that"
                + (f"; the SGLang-style path would add {us(t_sg)} = {pct(t_sg / step_att)}" if t_sg else "")
                + ".")
    by_dev = {}
    for r in att:
        if r.get("rates"):
            by_dev.setdefault((r["backend"], r["case"]["dtype"], att_path(r)), []).append(r)
    for (d, dtype, path), rs in sorted(by_dev.items()):
        best_mm = max(rs, key=lambda r: r["rates"]["frac_matmul_ceiling"]["value"])
        best_bw = max(rs, key=lambda r: r["rates"]["frac_copy_ceiling"]["value"])
        c1, c2 = best_mm["case"], best_bw["case"]
        out.append(
            f"- Verify attention ({d}, {dtype} cache, path {path}), whole grid: up to "
            f"{pct(best_mm['rates']['frac_matmul_ceiling']['value'])} of the measured matmul "
            f"ceiling ({best_mm['rates']['TFLOP_per_s']['value']:.2f} TFLOP/s at bs {c1['bs']}, "
            f"P {c1['prefix']}, T {c1['tree']}) and "
            f"{pct(best_bw['rates']['frac_copy_ceiling']['value'])} of the copy bandwidth "
            f"({best_bw['rates']['GB_per_s']['value']:.3g} GB/s at bs {c2['bs']}, P {c2['prefix']}, "
            f"T {c2['tree']}).")
    acc = list(timed(view["suites"].get("kernels"), "tree_accept"))
    if acc:
        worst = max(acc, key=lambda r: r["summary"]["median"])
        out.append(f"- Greedy accept stays under {us(worst['summary']['median'])} over the grid "
                   f"(slowest: {worst['backend']} bs {worst['case']['bs']}, budget "
                   f"{worst['case']['budget']}).")
    return out


def _num(x, fmt) -> str:
    return "-" if x is None else format(x, fmt)


def _e2e_lines(view) -> list:
    e2e = e2e_records(view)
    dev = e2e_device(view)
    if not e2e or not dev:
        return []
    batches = sorted({r["batch"] for r in e2e if r.get("backend") == dev})
    budgets = sorted({r.get("budget") for r in e2e if r.get("mode") == "ddtree"})
    head = "| budget | drafter | " + " | ".join(f"bs {b}: tau | bs {b}: fwd/tok | bs {b}: x AR" for b in batches) + " |"
    rows = []
    best = None
    for budget in budgets:
        for dr in e2e_drafters(e2e):
            cells = []
            for b in batches:
                r = e2e_find(e2e, dev, b, "ddtree", budget, dr)
                sp = _rate(r, "speedup_vs_ar") if r else None
                cells += [_num(_rate(r, "mean_accept_length") if r else None, ".2f"),
                          _num(_rate(r, "target_forwards_per_token") if r else None, ".3f"),
                          ("**" + _num(sp, ".2f") + "**") if sp is not None and sp > 1 else _num(sp, ".2f")]
                if sp is not None and (best is None or sp > best[0]):
                    best = (sp, budget, dr, b)
            rows.append(f"| {budget} | {dr} | " + " | ".join(cells) + " |")
    out = [f"End to end on `tiny`, DDTree against AR on the same device ({dev}, e2e{_src(view, 'e2e')}): tau = mean "
           "acceptance length (tokens per round), fwd/tok = target forwards per generated token, "
           "x AR = wall-clock speedup over AR (median of AR over median of DDTree; bold: faster "
           "than AR):", "", head, "|---|---|" + "--:|" * (3 * len(batches))] + rows + [""]
    if best:
        out.append(f"- Best wall-clock speedup over AR: {best[0]:.2f}x (budget {best[1]}, {best[2]}, bs {best[3]}).")
    return out


ROUND_PHASES = ("draft", "tree", "verify", "accept", "commit", "copy")  # engine/native/round.py


def round_drafter(recs) -> str | None:
    """The drafter whose rounds the breakdown shows: the trained block drafter, else the best
    oracle present."""
    names = e2e_drafters(recs)
    return next((n for n in ("block:trained", "block") if n in names), names[-1] if names else None)


def round_phases(r) -> dict | None:
    """An e2e record's per-phase ms per round (its profiled engine), or None (older JSON)."""
    ph = (r or {}).get("round", {}).get("phases_ms") if isinstance((r or {}).get("round"), dict) else None
    return ph if isinstance(ph, dict) and ph else None


def _round_lines(view) -> list:
    e2e = e2e_records(view)
    dev = e2e_device(view)
    dr = round_drafter(e2e)
    if not e2e or not dev or not dr:
        return []
    budgets = sorted({r.get("budget") for r in e2e if r.get("mode") == "ddtree"})
    rows = []
    for b in sorted({r["batch"] for r in e2e if r.get("backend") == dev}):
        ar = e2e_find(e2e, dev, b, "ar")
        for label, r in [("AR step", ar)] + [(f"B={g}", e2e_find(e2e, dev, b, "ddtree", g, dr)) for g in budgets]:
            ph = round_phases(r)
            if not ph:
                continue
            whole = (r.get("round") or {}).get("round_ms")
            ratio = whole / ar["round"]["round_ms"] if whole and round_phases(ar) and ar["round"].get("round_ms") else None
            rows.append(f"| {b} | {label} | " + " | ".join(_num(1e3 * ph.get(p, 0.0), ".0f") for p in ROUND_PHASES)
                        + f" | {_num(None if whole is None else 1e3 * whole, '.0f')} | {_num(ratio, '.2f')} |")
    if not rows:
        return []
    return [f"Where a round goes ({dev}, drafter {dr}, e2e{_src(view, 'e2e')}): microseconds per "
            "round and phase, from a second engine that times each phase (CUDA events around "
            "per-phase graphs on CUDA); 'round' is the plain engine's mean round (one whole graph "
            "and its one host sync, measured on the host), 'x AR' that over the AR step's:", "",
            "| bs | round | " + " | ".join(ROUND_PHASES) + " | round | x AR |",
            "|--:|---|" + "--:|" * (len(ROUND_PHASES) + 2)] + rows + [""]


def service_rows(recs, check: bool = False) -> list:
    """Table rows per (mode, concurrency): tok/s, vs AR at the same concurrency, TTFT p50/p99,
    errors (and, with check, whether the served tokens were the engine's)."""
    def tps(r):
        return ((r.get("rates") or {}).get("aggregate_tokens_per_s") or {}).get("value")

    by = {(r["case"].get("mode"), r["case"].get("concurrency")): r for r in recs}
    rows = []
    for (mode, conc), r in sorted(by.items(), key=lambda kv: (str(kv[0][0]), kv[0][1] or 0)):
        t = r.get("ttft_s") or {}
        ar = by.get(("ar", conc))
        rel = f"{tps(r) / tps(ar):.2f}x" if mode != "ar" and ar and tps(ar) and tps(r) else "-"
        row = (f"| {mode} | {conc} | {_num(tps(r), '.0f')} | {rel} | {us(t.get('p50'))} | "
               f"{us(t.get('p99'))} | {r.get('errors', '-')} |")
        if check:
            row += f" {'ok' if (r.get('validation') or {}).get('ok') else 'FAIL'} |"
        rows.append(row)
    return rows


def _service_lines(view) -> list:
    recs = service_records(view)
    if not recs:
        return []
    rows = service_rows(recs)
    p = view["suites"]["service"].get("params") or {}
    return [f"Served, `tiny` (service{_src(view, 'service')}; {p.get('requests', '?')} requests per level, "
            f"{p.get('max_tokens', '?')} tokens each, DDTree budget {p.get('budget', '?')}"
            + (f", shrunk while requests x (budget + 1) > {p['round_tokens']}" if p.get("round_tokens") else "")
            + "): aggregate "
            "tokens/s of all requests over the level's wall time, and time to first token:", "",
            "| mode | concurrency | tok/s | vs AR | TTFT p50 | TTFT p99 | errors |",
            "|---|--:|--:|--:|--:|--:|--:|"] + rows + [""]


def meaning(view) -> list:
    """The section's lines (markdown)."""
    out = []
    for part in (_tree_lines, _step_lines, _attention_lines, _e2e_lines, _round_lines, _service_lines):
        lines = part(view)
        if lines:
            out += lines + ([""] if lines[-1] != "" else [])
    return out or ["- These runs have no tree-build, attention, e2e or service results to interpret."]
