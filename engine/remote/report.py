"""docs/BENCHMARKS_<host>.md (and its PNG plots) regenerated from results/<host>/.

`write_report(host_results_dir, docs_dir) -> Path` reads every complete run folder (final
manifest.json) under `results/<host>/` that holds suite JSONs (bench/__init__.py, schema 1;
run ids sort by time), says how many folders it skipped, and writes:
  - which run each suite's figures come from: for each suite, the newest *clean* run that has
    it (suite status ok, and no overlap with another run on the same machine; an overlapped or
    failed run is chosen only when no better one has the suite), with those runs' provenance;
  - a warning line for runs that overlapped in time on one machine (same host_facts.boot_id,
    intersecting started..finished windows, engine/remote/compare.find_overlaps): each measured
    the other's load;
  - "What this means" (engine/remote/report_meaning.py), computed from the chosen suites only;
  - the code-small section (engine/remote/report_code_small.py): the trained target's training
    record, tau, accept lengths, speedups, served rows and a sample continuation;
  - plots beside the page (engine/remote/report_figures.py);
  - each chosen suite's table, and a history table with one line per run.
The page and the plots depend only on the JSON files, so regenerating them twice gives the
same bytes (the PNGs carry no timestamp).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report", "load_runs", "headline", "choose_suites"]

from engine.remote.compare import _parse_utc, find_overlaps, read_suites, run_window
from engine.remote.report_code_small import code_small_lines
from engine.remote.report_figures import plots as _plots
from engine.remote.report_meaning import KIMI_LAYERS, ceilings, headline, meaning, pct, timed, us

_pct, _us = pct, us  # the names tests and older callers use


def _dirty(git: dict) -> str:
    """' (dirty: what made it so)' for a dirty checkout, from the manifest's git record."""
    if not git.get("dirty"):
        return ""
    parts = []
    if git.get("tracked_changed") is not None:
        parts.append(f"{git['tracked_changed']} tracked file(s) changed")
    if git.get("untracked") is not None:
        parts.append(f"{git['untracked']} untracked file(s)")
    return f" (dirty: {', '.join(parts)})" if parts else " (dirty)"


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
        suites = read_suites(d, "report")
        try:
            manifest = json.loads(m.read_text())
        except json.JSONDecodeError as e:
            if not suites:
                skipped.append((d.name, "no benchmark suite JSON and an unreadable manifest.json"))
                continue
            raise ValueError(f"report: {m}: not valid JSON ({e})") from None
        if not suites:
            skipped.append((d.name, _why_no_suites(manifest)))
            continue
        runs.append({"id": d.name, "dir": d, "suites": suites, "manifest": manifest})
    return runs, skipped


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
        f"- run `{run['id']}`; git `{git.get('sha', '?')}`{_dirty(git)}"
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
    for dev, c in sorted(ceilings(run).items()):
        lines.append(f"- measured ceilings ({dev}): copy {c['copy']['value']:.1f} GB/s "
                     f"(read + write), matmul {c['matmul']['value']:.2f} TFLOP/s "
                     f"({c['matmul']['params'].get('dtype')}, n = {c['matmul']['params'].get('n')})")
    return lines


def _suite_section(name, doc, run_id=None) -> list:
    status = doc.get("status", "ok")
    lines = [f"### {name}" + ("" if status == "ok" else f" ({status.upper()})")
             + (f" (run `{run_id}`)" if run_id else ""), ""]
    if doc.get("error"):
        lines += [f"Error: `{doc['error'].splitlines()[0][:300]}`", ""]
    table = doc.get("table")
    if not table:
        from engine.remote.compare import record_key

        rows = [f"{record_key(r)}: median {us(r['summary']['median'])}" for r in timed(doc)]
        table = "\n".join(rows)
    if table.strip():
        lines += ["```", table.rstrip("\n"), "```", ""]
    params = doc.get("params") or {}
    notes = [f"{k}: {json.dumps(v)}" for k, v in params.items() if k in ("timing", "note", "speedup", "skipped")]
    if notes:
        lines += [f"Parameters: " + "; ".join(n[:400] for n in notes), ""]
    return lines


# ---------------------------------------------------------------- the page ---------------

def _why_no_suites(manifest: dict) -> str:
    """Why a complete run folder has no suite JSON, from its manifest: a test run, or a bench
    run that failed, timed out or was interrupted before its first suite finished."""
    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    if kind == "test":
        return "a test run: no benchmarks"
    if kind == "bench":
        state = "interrupted" if manifest.get("state") == "interrupted" else (
            "ok" if manifest.get("ok") else "failed")
        return f"a bench run that {state} with no suite JSON: {manifest.get('summary') or 'no summary'}"
    return "no benchmark suite JSON"


def _not_ok(run) -> str | None:
    m = run.get("manifest") or {}
    if m.get("state") == "interrupted":
        return "interrupted"
    if m.get("ok") is False:
        return "did not finish ok"
    return None


def _skipped_line(skipped, runs=()) -> str:
    partial = [(r["id"], _not_ok(r), (r.get("manifest") or {}).get("summary")) for r in runs if _not_ok(r)]
    parts = []
    if not skipped and not partial:
        return "Every folder there is a complete benchmark run whose steps all finished ok."
    if skipped:
        parts.append(f"{len(skipped)} folder(s) skipped (no benchmark results to show): "
                     + ", ".join(f"`{n}` ({w})" for n, w in skipped) + ".")
    if partial:
        parts.append(f"{len(partial)} run(s) below are partial (a step failed, timed out or was "
                     "interrupted; only the suites that finished are shown): "
                     + ", ".join(f"`{n}` ({why}: {summary})" for n, why, summary in partial) + ".")
    return " ".join(parts)


def all_manifests(host_dir) -> dict:
    """{folder name: manifest} of every complete run folder, test runs included (a test run
    loads the machine as much as a bench run); unreadable manifests are left out here
    (load_runs names them when the folder holds suites)."""
    out = {}
    for d in sorted(p for p in Path(host_dir).iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            out[d.name] = json.loads((d / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return out


def suite_overlaps(run, name, overlaps, manifests) -> list:
    """The runs (ids) whose started..finished window intersects this suite's own window (the
    suite JSON's started/finished, else its run's): a run overlapped by another is only hurt in
    the suites that ran during the overlap."""
    doc = run["suites"][name]
    own = run_window(run["manifest"])
    t0, t1 = _parse_utc(doc.get("started")), _parse_utc(doc.get("finished"))
    if own and (t0 is None or t1 is None):
        t0, t1 = own[1], own[2]
    hit = []
    for other, _ in overlaps.get(run["id"], []):
        w = run_window(manifests.get(other))
        if w is None or t0 is None or (max(t0, w[1]) < min(t1, w[2])):
            hit.append(other)  # no times to tell: count it as overlapped
    return hit


def choose_suites(runs, overlaps, manifests=None) -> dict:
    """{suite: (run, why)}: for each suite, the newest run that has it, preferring, in order: a
    run whose suite is ok and ran during no other run; an overlapped one that is ok; a clean one
    where it failed; anything. why: "" for the first kind, else what is wrong with the choice.
    manifests ({run id: manifest}, for the other runs' windows) defaults to the runs' own."""
    manifests = manifests if manifests is not None else {r["id"]: r["manifest"] for r in runs}
    out = {}
    for name in sorted({n for r in runs for n in r["suites"]}):
        have = [r for r in runs if name in r["suites"]]
        hits = {r["id"]: suite_overlaps(r, name, overlaps, manifests) for r in have}

        def rank(r):
            ok = r["suites"][name].get("status", "ok") == "ok"
            clean = not hits[r["id"]]
            return (ok and clean, ok, clean)

        best = max(rank(r) for r in have)
        run = [r for r in have if rank(r) == best][-1]  # runs are oldest first
        why = []
        if hits[run["id"]]:
            why.append("ran while " + ", ".join(f"`{o}`" for o in hits[run["id"]])
                       + " ran on the same machine; no clean run has this suite")
        if run["suites"][name].get("status", "ok") != "ok":
            why.append(f"suite status {run['suites'][name].get('status')}")
        out[name] = (run, "; ".join(why))
    return out


def _overlap_lines(overlaps) -> list:
    seen, out = set(), []
    for a, others in sorted(overlaps.items()):
        for b, when in others:
            if (b, a) in seen:
                continue
            seen.add((a, b))
            out.append(f"- **Overlap:** runs `{a}` and `{b}` ran at the same time on the same "
                       f"machine (same boot id; {when}): the suites that ran in that window include each other's load. "
                       "A suite that ran then is shown only when no clean run has it.")
    return out


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
    manifests = all_manifests(host_dir)
    overlaps = find_overlaps(manifests)
    chosen = choose_suites(runs, overlaps, manifests)
    view = {"suites": {n: r["suites"][n] for n, (r, _) in chosen.items()},
            "from": {n: r["id"] for n, (r, _) in chosen.items()},
            "why": {n: why for n, (_, why) in chosen.items() if why}, "overlapped": sorted(overlaps)}
    plots = _plots(view, runs, docs_dir, host)
    lines = [f"# Benchmarks on `{host}`", "",
             f"Generated by `engine/remote/report.py` from {len(runs)} run(s) under "
             f"`results/{host}/` (`invoke report`); do not edit by hand. How to run the suites and "
             f"what they measure: [BENCHMARKS.md](BENCHMARKS.md).", "",
             _skipped_line(skipped, runs), ""]
    if overlaps:
        lines += _overlap_lines(overlaps) + [""]
    lines += ["## Runs shown", "",
              "Each suite from the newest clean run that has it (status ok, and the suite did not run while another run ran on the same machine):", ""]
    for name, (r, why) in sorted(chosen.items()):
        lines.append(f"- {name}: run `{r['id']}`" + (f" (**{why}**)" if why else ""))
    lines.append("")
    for r in [r for r in runs if r["id"] in {c["id"] for c, _ in chosen.values()}][::-1]:
        lines += [f"Provenance of `{r['id']}`:", ""] + _provenance_lines(r) + [""]
    lines += ["## What this means", ""] + meaning(view)
    if lines[-1] != "":
        lines.append("")
    lines += code_small_lines(view)  # the trained target, when a chosen suite ran it
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += ["## Tables", ""]
    for name, (r, _) in sorted(chosen.items()):
        lines += _suite_section(name, r["suites"][name], r["id"])
    lines += ["## History", "",
              "| run | suites | bs 1, B 15 | bs 1, B 255 | bs 64, B 15 | bs 64, B 255 |",
              "|---|---|--:|--:|--:|--:|"]
    for r in reversed(runs):
        h = headline(r)
        cells = [f"{h[k]:.1f}x" if k in h else "-" for k in ((1, 15), (1, 255), (64, 15), (64, 255))]
        suites = ", ".join(f"{n}{'' if d.get('status', 'ok') == 'ok' else ' (' + d['status'] + ')'}"
                           for n, d in sorted(r["suites"].items()))
        mark = " (overlapped)" if r["id"] in overlaps else ""
        lines.append(f"| `{r['id']}`{mark} | {suites} | " + " | ".join(cells) + " |")
    lines += ["", "Speedups: median of the SGLang-style path over the median of the fastest native "
              "backend (native-cuda when the run had a GPU), same inputs.", ""]
    page = docs_dir / f"BENCHMARKS_{host}.md"
    page.write_text("\n".join(lines))
    return page
