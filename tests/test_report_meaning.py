"""engine.remote.report_meaning: the figures of "What this means" (CPU backend vs CUDA kernel,
the Kimi-shape attention table, e2e and service tables) recomputed here from random records."""

from __future__ import annotations

from engine.remote import report_meaning as rm


def _tree(rng):
    recs, med = [], {}
    for be in ("native-cuda", "native-cpu", "sglang-cuda"):
        for bs in (1, 64):
            for budget in (15, 255):
                m = float(rng.uniform(1e-6, 1e-3))
                med[(be, bs, budget)] = m
                recs.append({"bench": "tree_build", "backend": be, "case": {"bs": bs, "budget": budget},
                             "summary": {"median": m}})
    return recs, med


def _rates(rng):
    return {k: {"value": float(rng.uniform(0.001, 0.5)), "formula": "x (bfloat16)"}
            for k in ("GB_per_s", "TFLOP_per_s", "frac_copy_ceiling", "frac_matmul_ceiling")}


def _view(rng):
    tree, med = _tree(rng)
    att = [{"bench": "verify_attention", "backend": "cuda", "summary": {"median": float(rng.uniform(1e-5, 1e-2))},
            "case": {"bs": bs, "prefix": p, "tree": t, "dtype": dt, "path": path}, "rates": _rates(rng)}
           for dt in ("float32", "bfloat16") for bs in (1, 64) for p in (4096, 32768) for t in (1, 64)
           for path in ("simt", "mma", "torch")]
    for r in att:
        r["rates"]["kernel_s"] = {"value": r["summary"]["median"] * float(rng.uniform(0.5, 1))}
        if r["case"]["path"] != "simt":  # rows without a torch time show "-"
            r["rates"]["speedup_vs_torch"] = {"value": float(rng.uniform(0.1, 20))}
    e2e = []
    for b in (1, 8):
        e2e.append({"backend": "cuda", "batch": b, "mode": "ar", "budget": 0, "drafter": "-",
                    "summary": {"median": 1.0}, "rates": {"tokens_per_s": 100.0, "target_forwards_per_token": 1.0}})
        for budget in (15, 255):
            for dr in ("oracle:0.3", "oracle:0.95", "block:trained", "block:random"):
                e2e.append({"backend": "cuda", "batch": b, "mode": "ddtree", "budget": budget, "drafter": dr,
                            "summary": {"median": 1.0},
                            "rates": {k: float(rng.uniform(0.1, 5)) for k in (
                                "tokens_per_s", "target_forwards_per_token", "mean_accept_length", "speedup_vs_ar")}})
    svc = [{"case": {"mode": m, "concurrency": c}, "summary": {"median": 0.1}, "errors": 0,
            "ttft_s": {"p50": float(rng.uniform(1e-3, 1e-2)), "p99": float(rng.uniform(1e-2, 1e-1))},
            "rates": {"aggregate_tokens_per_s": {"value": float(rng.uniform(100, 9000))}}}
           for m in ("ar", "ddtree") for c in (1, 8)]
    suites = {"tree_build": {"results": tree}, "kernels": {"results": att},
              "e2e": {"results": e2e, "params": {"weights": "/w/tiny"}},
              "service": {"results": svc, "params": {"requests": 8, "max_tokens": 32, "budget": 63}}}
    return {"suites": suites, "from": {k: f"run-{k}" for k in suites}}, med, att, e2e, svc


def test_meaning_figures(rng):
    view, med, att, e2e, svc = _view(rng)
    text = "\n".join(rm.meaning(view))
    # speedups over the SGLang-style path for both native backends
    for be in ("native-cuda", "native-cpu"):
        for bs in (1, 64):
            for budget in (15, 255):
                want = med[("sglang-cuda", bs, budget)] / med[(be, bs, budget)]
                assert f"{be} {rm.us(med[(be, bs, budget)])} vs sglang-cuda" in text
                assert f"**{want:.1f}x** faster" in text, (be, bs, budget)
    # CPU backend vs CUDA kernel: the count of cases where the CPU backend is faster
    n_cpu = sum(med[("native-cuda", bs, b)] > med[("native-cpu", bs, b)] for bs in (1, 64) for b in (15, 255))
    if n_cpu:
        assert f"**the CPU backend is faster at {n_cpu}**" in text
    else:
        assert "the CPU backend is faster at none" in text
    # the attention table: one row per (dtype, bs, prefix, tree, path): path, kernel time, one
    # call, TFLOP/s and its fraction, GB/s and its fraction, speedup over the torch path
    for r in att:
        c, rt = r["case"], r["rates"]
        sp = rt.get("speedup_vs_torch")
        row = (f"| {c['dtype']} | {c['bs']} | {c['prefix']} | {c['tree']} | {c['path']} | "
               f"{rm.us(rt['kernel_s']['value'])} | {rm.us(r['summary']['median'])} | "
               f"{rt['TFLOP_per_s']['value']:.2f} | {rm.pct(rt['frac_matmul_ceiling']['value'])} (bfloat16) | "
               f"{rt['GB_per_s']['value']:.1f} | {rm.pct(rt['frac_copy_ceiling']['value'])} | "
               + (f"{sp['value']:.2f}x" if sp else "-") + " |")
        assert row in text, row
    # e2e: each (budget, drafter) row carries both batches' tau, fwd/tok and speedup; no random
    for budget in (15, 255):
        for dr in ("oracle:0.3", "oracle:0.95", "block:trained"):
            cells = []
            for b in (1, 8):
                r = next(x for x in e2e if (x["batch"], x["budget"], x["drafter"], x["mode"]) == (b, budget, dr, "ddtree"))
                sp = r["rates"]["speedup_vs_ar"]
                cells += [f"{r['rates']['mean_accept_length']:.2f}", f"{r['rates']['target_forwards_per_token']:.3f}",
                          f"**{sp:.2f}**" if sp > 1 else f"{sp:.2f}"]
            assert f"| {budget} | {dr} | " + " | ".join(cells) + " |" in text
    assert "block:random |" not in text
    # the tree build's share of a DDTree round: batch / (fwd/tok x tok/s)
    r = next(x for x in e2e if (x["batch"], x["budget"], x["drafter"], x["mode"]) == (1, 15, "block:trained", "ddtree"))
    step = 1 / (r["rates"]["target_forwards_per_token"] * r["rates"]["tokens_per_s"])
    assert f"{rm.us(step)} per target forward" in text and f"is {rm.pct(med[('native-cuda', 1, 15)] / step)} of it" in text
    # service: tok/s, DDTree over AR at the same concurrency, TTFT p50/p99
    by = {(s["case"]["mode"], s["case"]["concurrency"]): s for s in svc}
    for (m, c), s in by.items():
        tps = s["rates"]["aggregate_tokens_per_s"]["value"]
        rel = f"{tps / by[('ar', c)]['rates']['aggregate_tokens_per_s']['value']:.2f}x" if m == "ddtree" else "-"
        assert (f"| {m} | {c} | {tps:.0f} | {rel} | {rm.us(s['ttft_s']['p50'])} | "
                f"{rm.us(s['ttft_s']['p99'])} | 0 |") in text
    for k in view["from"].values():
        assert f"run `{k}`" in text  # every figure says which run it comes from


def test_cpu_vs_the_cuda_kernel_alone(rng):
    # Records that carry the kernel alone (bench/tree_build.py) get a second comparison line, the
    # kernel alone against the CPU backend's call: the measure.
    recs, med = _tree(rng)
    alone = {}
    for r in recs:
        if r["backend"] == "native-cuda":
            key = (r["case"]["bs"], r["case"]["budget"])
            alone[key] = float(rng.uniform(1e-6, 1e-3))
            r["kernel_alone"] = {"summary": {"median": alone[key]}}
    view = {"suites": {"tree_build": {"results": recs}}, "from": {"tree_build": "run-x"}}
    lines = [ln for ln in rm.meaning(view) if ln.startswith("- The CUDA kernel alone")]
    assert len(lines) == 1
    n_cpu = sum(alone[c] > med[("native-cpu", *c)] for c in alone)
    want = (f"**the CPU backend is faster at {n_cpu}**" if n_cpu
            else "the CPU backend is faster at none")
    assert f"over 4 (bs, budget) cases: {want}" in lines[0]
    for c, t in alone.items():
        x = t / med[("native-cpu", *c)]
        if x > 1:
            assert f"bs {c[0]} B {c[1]} ({x:.1f}x)" in lines[0]
    # the CPU's fast state, where its records hold one: a third line, judged against it
    assert not [ln for ln in rm.meaning(view) if "at its fast state" in ln]
    fast = {}
    for r in recs:
        if r["backend"] == "native-cpu":
            key = (r["case"]["bs"], r["case"]["budget"])
            fast[key] = 0.5 * r["summary"]["median"]
            r["cpu_states"] = {"fast": fast[key], "slow": r["summary"]["median"], "calls": 50,
                               "medians": [fast[key], r["summary"]["median"]]}
    lines = [ln for ln in rm.meaning(view) if "at its fast state" in ln]
    assert len(lines) == 1
    n_fast = sum(alone[c] > fast[c] for c in alone)
    assert (f"**the CPU backend is faster at {n_fast}**" if n_fast
            else "the CPU backend is faster at none") in lines[0]
    # without kernel-alone times the lines are left out
    for r in recs:
        r.pop("kernel_alone", None)
    assert not [ln for ln in rm.meaning(view) if ln.startswith("- The CUDA kernel alone")]


def test_meaning_of_nothing_says_so():
    assert rm.meaning({"suites": {}, "from": {}}) == [
        "- These runs have no tree-build, attention, e2e or service results to interpret."]


def test_round_breakdown_table_and_plot(rng, tmp_path):
    """Where a round goes: one row per (batch, AR / budget) of the trained drafter with every
    phase in us and the whole-graph round over the AR step's; the stacked-bar PNG is written."""
    from engine.remote.report_figures import plots

    view, *_, e2e, _ = _view(rng)
    phases = {}
    for r in e2e:
        if r["mode"] == "ar" or r["drafter"] == "block:trained":
            ph = {p: float(rng.uniform(0.001, 0.3)) for p in rm.ROUND_PHASES}
            r["round"] = {"rounds": 10, "round_ms": float(rng.uniform(0.1, 1.0)), "phases_ms": ph,
                          "graphs": True}
            phases[(r["batch"], r["mode"], r["budget"])] = r["round"]
    lines = rm._round_lines(view)
    assert "drafter block:trained" in lines[0]
    for (b, mode, budget), rd in phases.items():
        label = "AR step" if mode == "ar" else f"B={budget}"
        row = next(x for x in lines if x.startswith(f"| {b} | {label} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2:8] == [format(1e3 * rd["phases_ms"][p], ".0f") for p in rm.ROUND_PHASES]
        assert cells[8] == format(1e3 * rd["round_ms"], ".0f")
        ar = phases[(b, "ar", 0)]["round_ms"]
        assert cells[9] == format(rd["round_ms"] / ar, ".2f")
    written = plots(view, [], tmp_path, "h")
    assert tmp_path / "BENCHMARKS_h_rounds.png" in written
    for r in e2e:  # older JSON (no breakdown): no table, no plot
        r.pop("round", None)
    assert rm._round_lines(view) == []
    again = tmp_path / "again"
    again.mkdir()
    assert again / "BENCHMARKS_h_rounds.png" not in plots(view, [], again, "h")
