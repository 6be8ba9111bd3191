"""The PNG plots of docs/BENCHMARKS_<host>.md (engine/remote/report.py): tree-build latency
against batch and budget, its speedup over the SGLang-style path, verify attention against
prefix, e2e speedup over AR against budget per drafter, service tokens/s against concurrency
(per target), code-small's accept-length histograms, and the headline speedups across runs.
`view` is report_meaning's {"suites", "from"}. PNGs carry no timestamp, so regenerating gives
the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from engine.remote.report_meaning import (ROUND_PHASES, e2e_device, e2e_drafters, e2e_find,
                                          e2e_records, headline, median, round_drafter,
                                          round_phases, service_records, sglang_backend, timed,
                                          tree_records)


def plots(view, runs, docs_dir: Path, host: str) -> list:
    """Write the PNGs beside the page; returns their paths (in page order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, tag):
        p = docs_dir / f"BENCHMARKS_{host}_{tag}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=90, metadata={"Software": None})
        plt.close(fig)
        written.append(p)

    recs = tree_records(view)
    backends = sorted({r["backend"] for r in recs})
    budgets = sorted({r["case"]["budget"] for r in recs})
    batches = sorted({r["case"]["bs"] for r in recs})
    if recs:
        fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.4), squeeze=False)
        for ax, budget in zip(axes[0], budgets):
            for be in backends:
                pts = [(bs, median(recs, be, bs, budget)) for bs in batches]
                pts = [(x, y * 1e6) for x, y in pts if y]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=be)
            ax.set(xscale="log", yscale="log", xlabel="batch size", title=f"budget {budget}")
        axes[0][0].set_ylabel("tree build, median us")
        axes[0][0].legend(fontsize=7)
        save(fig, "tree_vs_batch")
        fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.4), squeeze=False)
        for ax, bs in zip(axes[0], batches):
            for be in backends:
                pts = [(b, median(recs, be, bs, b)) for b in budgets]
                pts = [(x, y * 1e6) for x, y in pts if y]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=be)
            ax.set(xscale="log", yscale="log", xlabel="budget (nodes)", title=f"bs {bs}")
        axes[0][0].set_ylabel("tree build, median us")
        axes[0][0].legend(fontsize=7)
        save(fig, "tree_vs_budget")
        sg = sglang_backend(recs)
        if sg:
            fig, ax = plt.subplots(figsize=(5.5, 3.6))
            for be in (b for b in backends if b.startswith("native")):
                for budget in budgets:
                    pts = [(bs, median(recs, sg, bs, budget), median(recs, be, bs, budget)) for bs in batches]
                    pts = [(x, a / b) for x, a, b in pts if a and b]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{be}, budget {budget}")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set(xscale="log", yscale="log", xlabel="batch size",
                   ylabel=f"speedup over {sg} (x)", title="tree build speedup")
            ax.legend(fontsize=7)
            save(fig, "speedup")
    att = list(timed(view["suites"].get("kernels"), "verify_attention"))
    if att:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        # bf16 at the largest tree where present (the production case), one line per path and bs
        if any(r["case"]["dtype"] == "bfloat16" for r in att):
            att = [r for r in att if r["case"]["dtype"] == "bfloat16"]
        t_max = max(r["case"]["tree"] for r in att)
        att = [r for r in att if r["case"]["tree"] == t_max]
        key = lambda r: (r["backend"], r["case"]["dtype"], r["case"]["bs"], r["case"]["tree"],  # noqa: E731
                         r["case"].get("path", "auto"))
        for k in sorted({key(r) for r in att}):
            be, dt, bs, tree, path = k
            pts = sorted((r["case"]["prefix"], r["summary"]["median"] * 1e6) for r in att if key(r) == k)
            ax.plot(*zip(*pts), marker=".", label=f"{be} {dt} bs{bs} T{tree} {path}")
        ax.set(xscale="log", yscale="log", xlabel="prefix length", ylabel="verify attention, median us",
               title="verify attention (one layer)")
        ax.legend(fontsize=5, ncol=2)
        save(fig, "attention")
    _tree_kernels_plot(view, plt, save)
    _e2e_plot(view, plt, save)
    _round_plot(view, plt, save)
    _service_plot(view, plt, save)
    _code_small_plot(view, plt, save)
    hist = [(i, headline(r)) for i, r in enumerate(runs)]
    if sum(1 for _, h in hist if h) >= 2:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for key in sorted({k for _, h in hist for k in h}):
            pts = [(i, h[key]) for i, h in hist if key in h]
            ax.plot(*zip(*pts), marker="o", label=f"bs {key[0]}, budget {key[1]}")
        ov = set(view.get("overlapped") or ())  # runs that ran beside another: marked
        ax.set_xticks(range(len(runs)), [r["id"][:16] + (" (overlap)" if r["id"] in ov else "") for r in runs],
                      rotation=30, fontsize=6)
        ax.set(yscale="log", ylabel="speedup over SGLang path (x)", title="headline speedups by run")
        ax.legend(fontsize=7)
        save(fig, "history")
    return written


def _tree_kernels_plot(view, plt, save):
    """Tree build (each algorithm) and accept on CUDA against budget at bs 1 and bs 64 (the
    batches present nearest those), two ways: the kernel alone (a CUDA graph of N calls / N,
    solid) and one call from Python between events (dashed)."""
    recs = [r for r in timed(view["suites"].get("kernels"))
            if r.get("bench") in ("tree_build", "tree_accept") and r.get("backend") == "cuda"
            and r.get("kernel_alone")]
    if not recs:
        return
    have = sorted({r["case"]["bs"] for r in recs})
    batches = sorted({min(have, key=lambda b: abs(b - want)) for want in (1, 64)})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.6), squeeze=False)
    for ax, bs in zip(axes[0], batches):
        keys = sorted({(r["bench"], r["case"].get("algo", "")) for r in recs if r["case"]["bs"] == bs})
        for bench, algo in keys:
            rows = sorted((r["case"]["budget"], r["kernel_alone"]["summary"]["median"] * 1e6,
                           r["summary"]["median"] * 1e6) for r in recs
                          if r["case"]["bs"] == bs and (r["bench"], r["case"].get("algo", "")) == (bench, algo))
            label = bench.replace("tree_", "") + (f" {algo}" if algo else "")
            line = ax.plot([x for x, _, _ in rows], [a for _, a, _ in rows], marker="o", label=f"{label}, alone")
            ax.plot([x for x, _, _ in rows], [c for _, _, c in rows], marker=".", ls="--",
                    color=line[0].get_color(), label=f"{label}, one call")
        ax.set(xscale="log", yscale="log", xlabel="budget (nodes)", ylabel="us", title=f"tree kernels, CUDA, bs {bs}")
        ax.legend(fontsize=6)
    save(fig, "tree_kernels")


def _e2e_plot(view, plt, save):
    from matplotlib.ticker import FuncFormatter, NullFormatter

    recs = e2e_records(view)
    dev = e2e_device(view)
    if not recs or not dev:
        return
    batches = sorted({r["batch"] for r in recs if r.get("backend") == dev})
    budgets = sorted({r.get("budget") for r in recs if r.get("mode") == "ddtree"})
    drafters = e2e_drafters(recs) + [d for d in ("block:random",) if any(r.get("drafter") == d for r in recs)]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    drawn = 0
    for ax, b in zip(axes[0], batches):
        for dr in drafters:
            pts = [(g, e2e_find(recs, dev, b, "ddtree", g, dr)) for g in budgets]
            pts = [(g, r["rates"]["speedup_vs_ar"]) for g, r in pts
                   if r and isinstance((r.get("rates") or {}).get("speedup_vs_ar"), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=dr)
                drawn += 1
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="budget (nodes)", title=f"e2e {dev}, bs {b}")
        ax.set_xticks(budgets, [str(g) for g in budgets])
        ax.xaxis.set_minor_formatter(NullFormatter())  # log-axis minor labels collide
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    if not drawn:  # no record carries speedup_vs_ar (an older e2e JSON): no empty plot
        plt.close(fig)
        return
    axes[0][0].set_ylabel("speedup over AR (x, wall clock)")
    axes[0][0].legend(fontsize=7)
    save(fig, "e2e")


def _round_plot(view, plt, save):
    """Where a round's time goes: a stacked bar per budget (the phases of round.PHASES, ms per
    round from the profiled engine) with the AR step beside them, one panel per batch size; a
    dot marks the plain engine's whole-graph round."""
    recs = e2e_records(view)
    dev = e2e_device(view)
    dr = round_drafter(recs)
    if not recs or not dev or not dr:
        return
    batches = sorted({r["batch"] for r in recs if r.get("backend") == dev})
    budgets = sorted({r.get("budget") for r in recs if r.get("mode") == "ddtree"})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    drawn = 0
    for ax, b in zip(axes[0], batches):
        bars = [("AR", e2e_find(recs, dev, b, "ar"))] + \
            [(f"B={g}", e2e_find(recs, dev, b, "ddtree", g, dr)) for g in budgets]
        bars = [(lab, r) for lab, r in bars if round_phases(r)]
        for i, (lab, r) in enumerate(bars):
            ph, bottom = round_phases(r), 0.0
            for p, c in zip(ROUND_PHASES, colors):
                v = 1e3 * ph.get(p, 0.0)
                ax.bar(i, v, bottom=bottom, color=c, label=p if i == 0 else None)
                bottom += v
            whole = (r.get("round") or {}).get("round_ms")
            if whole:
                ax.plot(i, 1e3 * whole, "k.", label="whole graph" if i == 0 else None)
            drawn += 1
        ax.set_xticks(range(len(bars)), [lab for lab, _ in bars])
        ax.set(ylabel="us per round", title=f"{dev} rounds, bs {b}, {dr}")
    if not drawn:  # older e2e JSON without the round breakdown: no empty plot
        plt.close(fig)
        return
    axes[0][0].legend(fontsize=7)
    save(fig, "rounds")


def _code_small_plot(view, plt, save):
    """code-small's accept-length histograms (share of rounds per accepted length, the bonus
    included), one line per budget, one panel per batch size."""
    from matplotlib.ticker import MaxNLocator

    from engine.remote.report_code_small import DRAFTER, MODEL

    recs = e2e_records(view, MODEL)
    dev = e2e_device(view, MODEL)
    if not recs or not dev:
        return
    batches = sorted({r["batch"] for r in recs if r.get("backend") == dev})
    budgets = sorted({r.get("budget") for r in recs if r.get("mode") == "ddtree"})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.4), squeeze=False)
    drawn = 0
    for ax, b in zip(axes[0], batches):
        for g in budgets:
            r = e2e_find(recs, dev, b, "ddtree", g, DRAFTER)
            hist = (r or {}).get("accept_hist") or []
            if sum(hist):
                ax.plot(range(1, len(hist)), [h / sum(hist) for h in hist[1:]], marker="o",
                        ms=3, label=f"B={g} (tau {r['rates']['mean_accept_length']:.2f})")
                drawn += 1
        ax.set(xlabel="tokens accepted per round (bonus included)", ylabel="share of rounds",
               title=f"code-small {dev}, bs {b}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not drawn:
        plt.close(fig)
        return
    axes[0][0].legend(fontsize=7)
    save(fig, "code_small_accept")


def _service_plot(view, plt, save):
    """Aggregate tokens/s against concurrency, one line per (target, mode)."""
    from matplotlib.ticker import NullFormatter

    lines = [(t, service_records(view, t)) for t in ("tiny", "code-small")]
    lines = [(t, recs) for t, recs in lines if recs]
    if not lines:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    levels = set()
    for t, recs in lines:
        for mode in sorted({r["case"].get("mode") for r in recs}, key=str):
            pts = sorted((r["case"]["concurrency"], r["rates"]["aggregate_tokens_per_s"]["value"])
                         for r in recs if r["case"].get("mode") == mode)
            levels |= {c for c, _ in pts}
            ax.plot(*zip(*pts), marker="o", ls="-" if t == "tiny" else "--",
                    label=str(mode) if len(lines) == 1 else f"{t} {mode}")
    levels = sorted(levels)
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="aggregate tokens/s",
           title="service: throughput")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7)
    save(fig, "service")
