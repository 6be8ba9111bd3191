"""docs/BENCHMARKS_<host>.md (and its PNG plots) regenerated from results/<host>/.

`write_report(host_results_dir, docs_dir) -> Path` reads every complete run folder (final
manifest.json) under `results/<host>/` that holds suite JSONs (bench/__init__.py, schema 1;
run ids sort by time), says how many folders it skipped, and writes:
  - the newest run's provenance in a few lines and its suites' tables;
  - "What this means": figures computed from the newest run (the tree build's speedups over
    the SGLang-style path, its share of a decode step, the attention's fractions of the measured
    ceilings); nothing in that section is typed by hand;
  - plots beside the page: tree-build latency against batch and against budget, the speedups,
    attention latency against prefix length, and the headline speedups across all runs;
  - a history table with one line per run.
The page and the plots depend only on the JSON files, so regenerating them twice gives the
same bytes (the PNGs carry no timestamp).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report", "load_runs", "headline"]

KIMI_LAYERS = 61  # Kimi K2 / DeepSeek-V3 decoder layers: one verify attention per layer per step


# ---------------------------------------------------------------- loading ----------------

def load_runs(host_dir) -> tuple:
    """(runs, skipped). runs: [{"id", "dir", "manifest", "suites": {name: doc}}] oldest first,
    from complete run folders only: a final manifest.json present (ARCHITECTURE.md: a folder
    without one is incomplete) and at least one suite JSON. skipped: [(folder name, why)] for
    the folders left out: incomplete ones and those without suite JSON; dot-folders (a dead
    fetch's `.incoming-*`) are skipped too, and counted."""
    runs, skipped = [], []
    for d in sorted(p for p in Path(host_dir).iterdir() if p.is_dir()):
        if d.name.startswith("."):
            skipped.append((d.name, "a temporary folder (an interrupted fetch)"))
            continue
        m = d / "manifest.json"
        if not m.is_file():
            skipped.append((d.name, "no final manifest.json (incomplete)"))
            continue
        suites = {}
        for f in sorted(d.glob("*.json")):
            if f.name == "manifest.json":
                continue
            try:
                doc = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"report: {f}: not valid JSON ({e})") from None
            if isinstance(doc, dict) and "suite" in doc and isinstance(doc.get("results"), list):
                suites[doc["suite"]] = doc
        if not suites:
            skipped.append((d.name, "no benchmark suite JSON (a test run?)"))
            continue
        try:
            manifest = json.loads(m.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"report: {m}: not valid JSON ({e})") from None
        runs.append({"id": d.name, "dir": d, "suites": suites, "manifest": manifest})
    return runs, skipped


def _timed(doc, bench=None):
    for r in (doc or {}).get("results", []):
        if r.get("summary") and (bench is None or r.get("bench") == bench):
            yield r


def _tree_records(run) -> list:
    """Tree-build records: the head-to-head suite, else the kernels suite's tree_build."""
    recs = list(_timed(run["suites"].get("tree_build"), "tree_build"))
    if not recs:
        recs = [dict(r, backend=f"native-{r['backend']}")
                for r in _timed(run["suites"].get("kernels"), "tree_build")]
    return recs


def _median(recs, backend, bs, budget):
    for r in recs:
        c = r["case"]
        if r["backend"] == backend and c.get("bs") == bs and c.get("budget") == budget:
            return r["summary"]["median"]
    return None


def _native_backend(recs) -> str | None:
    names = {r["backend"] for r in recs}
    return next((b for b in ("native-cuda", "native-cpu") if b in names), None)


def _sglang_backend(recs) -> str | None:
    return next((b for b in sorted({r["backend"] for r in recs}) if b.startswith("sglang")), None)


def headline(run) -> dict:
    """{(bs, budget): speedup of the fastest native backend over the SGLang-style path}."""
    recs = _tree_records(run)
    nat, sg = _native_backend(recs), _sglang_backend(recs)
    out = {}
    if nat and sg:
        for bs in (1, 64):
            for budget in (15, 255):
                a, b = _median(recs, sg, bs, budget), _median(recs, nat, bs, budget)
                if a and b:
                    out[(bs, budget)] = a / b
    return out


# ---------------------------------------------------------------- text -------------------

def _us(s) -> str:
    if s is None:
        return "-"
    if s >= 1.0:
        return f"{s:.2f} s"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def _pct(x) -> str:
    """A percentage with two significant digits (0.0031% stays readable)."""
    v = 100.0 * x
    return f"{v:.2g}%" if v < 10 else f"{v:.0f}%"


def _provenance_lines(run) -> list:
    m = run["manifest"] or {}
    prov = next((d.get("provenance") for d in run["suites"].values()
                 if isinstance(d.get("provenance"), dict) and "error" not in d["provenance"]), {}) or {}
    git = m.get("git") or prov.get("git") or {}
    facts = m.get("host_facts") or prov.get("host_facts") or {}
    tool = m.get("toolchain") or prov.get("toolchain") or {}
    build = next((d.get("build") for d in run["suites"].values() if (d.get("build") or {}).get("commands")),
                 None) or m.get("build") or prov.get("build") or {}
    gpus = facts.get("gpus") or []
    gpu = ", ".join(f"{g.get('name')} (driver {g.get('driver')}, {g.get('memory_mib')} MiB)"
                    for g in gpus if isinstance(g, dict)) or "none"
    lines = [
        f"- run `{run['id']}`; git `{git.get('sha', '?')}`{' (dirty)' if git.get('dirty') else ''}"
        f"{', branch ' + str(git['branch']) if git.get('branch') else ''}",
        f"- host `{facts.get('hostname', '?')}`: {facts.get('cpu_model', '?')} "
        f"({facts.get('cpu_cores', '?')} cores); GPUs: {gpu}",
        f"- toolchain: nvcc {tool.get('nvcc') or '-'}; {tool.get('cxx') or '-'}; python "
        f"{tool.get('python') or '-'}; torch {tool.get('torch') or '-'}; numpy {tool.get('numpy') or '-'}",
    ]
    cmds = build.get("commands") or []
    if cmds:
        lines.append(f"- library `{build.get('library', '?')}` (arch {build.get('arch')}), "
                     f"{len(cmds)} build lines; the first: `{cmds[0]}`")
    for dev, c in sorted(_ceilings(run).items()):
        lines.append(f"- measured ceilings ({dev}): copy {c['copy']['value']:.1f} GB/s "
                     f"(read + write), matmul {c['matmul']['value']:.2f} TFLOP/s "
                     f"({c['matmul']['params'].get('dtype')}, n = {c['matmul']['params'].get('n')})")
    return lines


def _ceilings(run) -> dict:
    out = {}
    for d in run["suites"].values():
        for dev, c in (d.get("ceilings") or {}).items():
            out.setdefault(dev, c)
    return out


def _step_times(run) -> list:
    """Decode-step times measured by the e2e suite (bench/e2e.py): for each timed DDTree record,
    step = batch / (target_forwards_per_token * tokens_per_s), i.e. the median wall time over the
    number of sequential target forwards (each forward is one step). [(step_s, record)]."""
    out = []
    for r in _timed(run["suites"].get("e2e")):
        rates = r.get("rates") or {}
        tps, fpt = rates.get("tokens_per_s"), rates.get("target_forwards_per_token")
        if r.get("mode") != "ddtree" or not isinstance(tps, (int, float)) or not isinstance(fpt, (int, float)):
            continue
        if tps > 0 and fpt > 0 and r.get("batch"):
            out.append((r["batch"] / (fpt * tps), r))
    return out


def _meaning(run) -> list:
    out = []
    recs = _tree_records(run)
    nat, sg = _native_backend(recs), _sglang_backend(recs)
    if nat and sg:
        for (bs, budget), sp in sorted(headline(run).items()):
            out.append(f"- Tree build, bs = {bs}, budget = {budget}: {nat} "
                       f"{_us(_median(recs, nat, bs, budget))} vs {sg} "
                       f"{_us(_median(recs, sg, bs, budget))}, **{sp:.1f}x** faster.")
    elif nat:
        out.append(f"- Tree build: no SGLang-style path in this run, so no speedup; {nat} at "
                   f"bs = 64, budget = 255: {_us(_median(recs, nat, 64, 255))}.")
    att = list(_timed(run["suites"].get("kernels"), "verify_attention"))
    steps = _step_times(run)
    shown = set()
    for step, r in sorted(steps, key=lambda x: (x[1].get("backend", ""), x[1]["batch"], x[1].get("budget", 0))):
        bs, budget, dev = r["batch"], r.get("budget"), r.get("backend")
        if (dev, bs, budget) in shown or not nat:
            continue
        t_nat = _median(recs, nat, bs, budget)
        if not t_nat:
            continue
        shown.add((dev, bs, budget))
        t_sg = _median(recs, sg, bs, budget) if sg else None
        w = (run["suites"]["e2e"].get("params") or {}).get("weights", "?")
        weights = Path(str(w["path"] if isinstance(w, dict) else w)).name  # dict: bench/weights.py
        out.append(f"- Measured decode step (e2e, {dev}, weights `{weights}`, bs = {bs}, DDTree "
                   f"budget {budget}, drafter {r.get('drafter')}): {_us(step)} per target forward. "
                   f"The {nat} tree build at that bs and budget is {_pct(t_nat / step)} of it"
                   + (f"; the SGLang-style path would be {_pct(t_sg / step)}" if t_sg else "") + ".")
    if recs and nat and att:
        # The Kimi K2 shape: a step is bounded below by its verify attention alone.
        for bs, budget, tree in ((1, 15, 16), (64, 63, 64)):
            cands = [r for r in att if r["case"]["bs"] == bs and r["case"]["tree"] == tree
                     and r["case"]["dtype"] == "bfloat16"]
            t_nat = _median(recs, nat, bs, budget)
            if not cands or not t_nat:
                continue
            a = max(cands, key=lambda r: r["case"]["prefix"])
            step_att = KIMI_LAYERS * a["summary"]["median"]
            t_sg = _median(recs, sg, bs, budget) if sg else None
            out.append(
                f"- bs = {bs}, tree of {tree} nodes (budget {budget}), prefix {a['case']['prefix']}: "
                f"the verify attention alone costs {KIMI_LAYERS} layers x {_us(a['summary']['median'])}"
                f" = {_us(step_att)} per step ({a['backend']}, bf16 cache; a lower bound: the "
                f"MoE and projections come on top). The {nat} tree build adds {_us(t_nat)} = {_pct(t_nat / step_att)} of that"
                + (f"; the SGLang-style path would add {_us(t_sg)} = {_pct(t_sg / step_att)}" if t_sg else "")
                + ".")
    by_dev = {}
    for r in att:
        by_dev.setdefault((r["backend"], r["case"]["dtype"]), []).append(r)
    for (dev, dtype), rs in sorted(by_dev.items()):
        best_mm = max(rs, key=lambda r: r["rates"]["frac_matmul_ceiling"]["value"])
        best_bw = max(rs, key=lambda r: r["rates"]["frac_copy_ceiling"]["value"])
        c1, c2 = best_mm["case"], best_bw["case"]
        out.append(
            f"- Verify attention ({dev}, {dtype} cache): up to "
            f"{_pct(best_mm['rates']['frac_matmul_ceiling']['value'])} of the measured matmul "
            f"ceiling ({best_mm['rates']['TFLOP_per_s']['value']:.2f} TFLOP/s at bs {c1['bs']}, "
            f"P {c1['prefix']}, T {c1['tree']}) and "
            f"{_pct(best_bw['rates']['frac_copy_ceiling']['value'])} of the copy bandwidth "
            f"({best_bw['rates']['GB_per_s']['value']:.3g} GB/s at bs {c2['bs']}, P {c2['prefix']}, "
            f"T {c2['tree']}).")
    acc = list(_timed(run["suites"].get("kernels"), "tree_accept"))
    if acc:
        worst = max(acc, key=lambda r: r["summary"]["median"])
        out.append(f"- Greedy accept stays under {_us(worst['summary']['median'])} over the grid "
                   f"(slowest: {worst['backend']} bs {worst['case']['bs']}, budget "
                   f"{worst['case']['budget']}).")
    return out or ["- This run has no tree-build or attention results to interpret."]


def _suite_section(name, doc) -> list:
    status = doc.get("status", "ok")
    lines = [f"### {name}" + ("" if status == "ok" else f" ({status.upper()})"), ""]
    if doc.get("error"):
        lines += [f"Error: `{doc['error'].splitlines()[0][:300]}`", ""]
    table = doc.get("table")
    if not table:
        from engine.remote.compare import record_key

        rows = [f"{record_key(r)}: median {_us(r['summary']['median'])}" for r in _timed(doc)]
        table = "\n".join(rows)
    if table.strip():
        lines += ["```", table.rstrip("\n"), "```", ""]
    params = doc.get("params") or {}
    notes = [f"{k}: {json.dumps(v)}" for k, v in params.items() if k in ("timing", "note", "speedup", "skipped")]
    if notes:
        lines += [f"Parameters: " + "; ".join(n[:400] for n in notes), ""]
    return lines


# ---------------------------------------------------------------- plots ------------------

def _plots(run, runs, docs_dir: Path, host: str) -> list:
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

    recs = _tree_records(run)
    backends = sorted({r["backend"] for r in recs})
    budgets = sorted({r["case"]["budget"] for r in recs})
    batches = sorted({r["case"]["bs"] for r in recs})
    if recs:
        fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.4), squeeze=False)
        for ax, budget in zip(axes[0], budgets):
            for be in backends:
                pts = [(bs, _median(recs, be, bs, budget)) for bs in batches]
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
                pts = [(b, _median(recs, be, bs, b)) for b in budgets]
                pts = [(x, y * 1e6) for x, y in pts if y]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=be)
            ax.set(xscale="log", yscale="log", xlabel="budget (nodes)", title=f"bs {bs}")
        axes[0][0].set_ylabel("tree build, median us")
        axes[0][0].legend(fontsize=7)
        save(fig, "tree_vs_budget")
        sg = _sglang_backend(recs)
        if sg:
            fig, ax = plt.subplots(figsize=(5.5, 3.6))
            for be in (b for b in backends if b.startswith("native")):
                for budget in budgets:
                    pts = [(bs, _median(recs, sg, bs, budget), _median(recs, be, bs, budget)) for bs in batches]
                    pts = [(x, a / b) for x, a, b in pts if a and b]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{be}, budget {budget}")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set(xscale="log", yscale="log", xlabel="batch size",
                   ylabel=f"speedup over {sg} (x)", title="tree build speedup")
            ax.legend(fontsize=7)
            save(fig, "speedup")
    att = list(_timed(run["suites"].get("kernels"), "verify_attention"))
    if att:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        keys = sorted({(r["backend"], r["case"]["dtype"], r["case"]["bs"], r["case"]["tree"]) for r in att})
        for be, dt, bs, tree in keys:
            pts = sorted((r["case"]["prefix"], r["summary"]["median"] * 1e6) for r in att
                         if (r["backend"], r["case"]["dtype"], r["case"]["bs"], r["case"]["tree"]) == (be, dt, bs, tree))
            ax.plot(*zip(*pts), marker=".", label=f"{be} {dt} bs{bs} T{tree}")
        ax.set(xscale="log", yscale="log", xlabel="prefix length", ylabel="verify attention, median us",
               title="verify attention (one layer)")
        ax.legend(fontsize=5, ncol=2)
        save(fig, "attention")
    hist = [(i, headline(r)) for i, r in enumerate(runs)]
    if sum(1 for _, h in hist if h) >= 2:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for key in sorted({k for _, h in hist for k in h}):
            pts = [(i, h[key]) for i, h in hist if key in h]
            ax.plot(*zip(*pts), marker="o", label=f"bs {key[0]}, budget {key[1]}")
        ax.set_xticks(range(len(runs)), [r["id"][:16] for r in runs], rotation=30, fontsize=6)
        ax.set(yscale="log", ylabel="speedup over SGLang path (x)", title="headline speedups by run")
        ax.legend(fontsize=7)
        save(fig, "history")
    return written


# ---------------------------------------------------------------- the page ---------------

def _skipped_line(skipped) -> str:
    if not skipped:
        return "Every folder there is a complete benchmark run."
    return (f"{len(skipped)} folder(s) skipped (not complete benchmark runs): "
            + ", ".join(f"`{n}` ({w})" for n, w in skipped) + ".")


def write_report(host_results_dir, docs_dir) -> Path:
    """Regenerate docs_dir/BENCHMARKS_<host>.md and its plots; returns the page's path."""
    host_dir = Path(host_results_dir)
    if not host_dir.is_dir():
        raise FileNotFoundError(f"report: {host_dir} does not exist (fetch results first)")
    host = host_dir.name
    runs, skipped = load_runs(host_dir)
    if not runs:
        why = "; ".join(f"{n}: {w}" for n, w in skipped) or "no run folders"
        raise ValueError(f"report: no run under {host_dir} holds a benchmark suite JSON and a final "
                         f"manifest.json ({why})")
    docs_dir = Path(docs_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    for old in docs_dir.glob(f"BENCHMARKS_{host}_*.png"):
        old.unlink()  # plots of a kind the newest data no longer has must not linger
    new = runs[-1]
    plots = _plots(new, runs, docs_dir, host)
    lines = [f"# Benchmarks on `{host}`", "",
             f"Generated by `engine/remote/report.py` from {len(runs)} run(s) under "
             f"`results/{host}/` (`invoke report`); do not edit by hand. How to run the suites and "
             f"what they measure: [BENCHMARKS.md](BENCHMARKS.md).", "",
             _skipped_line(skipped), "",
             "## Newest run", ""] + _provenance_lines(new) + ["", "## What this means", ""]
    lines += _meaning(new) + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += ["## Tables (newest run)", ""]
    for name in sorted(new["suites"]):
        lines += _suite_section(name, new["suites"][name])
    lines += ["## History", "",
              "| run | suites | bs 1, B 15 | bs 1, B 255 | bs 64, B 15 | bs 64, B 255 |",
              "|---|---|--:|--:|--:|--:|"]
    for r in reversed(runs):
        h = headline(r)
        cells = [f"{h[k]:.1f}x" if k in h else "-" for k in ((1, 15), (1, 255), (64, 15), (64, 255))]
        suites = ", ".join(f"{n}{'' if d.get('status', 'ok') == 'ok' else ' (' + d['status'] + ')'}"
                           for n, d in sorted(r["suites"].items()))
        lines.append(f"| `{r['id']}` | {suites} | " + " | ".join(cells) + " |")
    lines += ["", "Speedups: median of the SGLang-style path over the median of the fastest native "
              "backend (native-cuda when the run had a GPU), same inputs.", ""]
    page = docs_dir / f"BENCHMARKS_{host}.md"
    page.write_text("\n".join(lines))
    return page
