"""Compare two benchmark runs, like with like, from their raw samples.

`compare_runs(run_a, run_b, threshold=0.05)` reads every suite JSON (`bench/__init__.py`,
schema 1) in the two run folders, pairs records by suite and parameters, and for each pair
decides *faster*, *slower* or *no significant change* with a two-sided Mann-Whitney U test on
the raw samples (exact distribution for small untied samples, normal approximation with tie
correction otherwise; engine/remote/stats.py) at `alpha`. The size of a change is the ratio of medians, B / A - 1,
with a bootstrap 95% interval beside it. A significant slowdown is a regression when its
interval lies wholly above the change allowed for that record: the largest of `threshold`, the
noise floor of its kind (NOISE_FLOORS: GPU kernels 5%, host-side CPU timings 20%, decode 15%,
the HTTP service 25%) and twice the larger relative spread (IQR / median) either run measured
in its own raw samples; doubled when the runs come from different machines (hostname, GPU UUIDs
or boot id differ in the manifests' host facts). Slowdowns in a run that overlapped another run
on the same machine are reported but not judged (each measured the other's load).
`Comparison.exit_code` is 2 with a regression (ARCHITECTURE.md, exit codes), 5 when the runs
are refused or nothing in them is comparable, else 0.

Runs are comparable only when their host, GPU model and build flags match; otherwise the
comparison is refused with the reason (`refused`, exit code 5) and no verdicts are made.
A run folder is `results/<host>/<run-id>/` (or a remote `runs/<run-id>/`): its manifest.json
gives host, GPUs and build; the suite JSONs' provenance and build blocks fill in when it lacks
them.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.remote.stats import bootstrap_change, mann_whitney_u, relative_spread

__all__ = ["Row", "Comparison", "compare_runs", "resolve_pair", "record_key", "latest_run",
           "EXIT_REGRESSION", "EXIT_REFUSED"]

EXIT_REGRESSION = 2
EXIT_REFUSED = 5
# Fields of a record that are measurements, not parameters (record_key ignores them).
_MEASURED = {"samples", "summary", "rates", "validation", "table", "notes", "speedup",
             "speedups", "fraction", "fractions", "error"}


# ---------------------------------------------------------------- runs and records -------

def record_key(rec: dict) -> str:
    """A record's identity: `bench/backend` (or `name`) and its case parameters; for other
    shapes, its string and integer fields (floats are taken to be measurements)."""
    case = rec.get("case")
    if isinstance(case, dict):
        tail = " ".join(f"{k}={case[k]}" for k in sorted(case))
    else:
        tail = "" if case is None else str(case)  # e.g. bench/e2e.py's "ddtree B=15 block bs=1"
    if "bench" in rec:
        head = "/".join(str(rec[k]) for k in ("bench", "backend") if rec.get(k) is not None)
        return f"{head} {tail}".strip()
    if "name" in rec:
        return f"{rec['name']} {tail}".strip()
    parts = [f"{k}={v}" for k, v in sorted(rec.items())
             if k not in _MEASURED and isinstance(v, (str, int, bool)) and v is not None]
    return " ".join(parts)


def read_suites(run_dir: Path, who: str) -> dict:
    """{suite name: its JSON document} for the benchmark suite files in a run folder (any
    `*.json` with `suite` and a `results` list; manifest.json and other JSON are not suites)."""
    suites = {}
    for p in sorted(Path(run_dir).glob("*.json")):
        if p.name == "manifest.json":
            continue
        try:
            doc = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{who}: {p}: not valid JSON ({e})") from None
        if isinstance(doc, dict) and "suite" in doc and isinstance(doc.get("results"), list):
            suites[doc["suite"]] = doc
    return suites


def _load_run(run_dir: Path) -> dict:
    """{"manifest": dict|None, "suites": {name: doc}} of one run folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"compare: run folder {run_dir} does not exist")
    manifest = None
    mpath = run_dir / "manifest.json"
    if mpath.is_file():
        try:
            manifest = json.loads(mpath.read_text())
        except (ValueError, RecursionError) as e:
            raise ValueError(f"compare: {mpath}: not valid JSON ({e})") from None
        if not isinstance(manifest, dict):
            raise ValueError(f"compare: {mpath}: not a JSON object")
    suites = read_suites(run_dir, "compare")
    if not suites:
        raise ValueError(f"compare: {run_dir} holds no benchmark suite JSON (is it a bench run?)")
    return {"dir": run_dir, "manifest": manifest, "suites": suites}


def _first_provenance(run: dict) -> dict:
    for doc in run["suites"].values():
        prov = doc.get("provenance")
        if isinstance(prov, dict) and "error" not in prov:
            return prov
    return {}


def _host_name(run: dict) -> str:
    m = run["manifest"] or {}
    host = m.get("host")
    if isinstance(host, dict) and host.get("name"):
        return str(host["name"])
    if isinstance(host, str) and host:
        return host
    return run["dir"].parent.name  # results/<host>/<run-id>


def _gpu_models(run: dict) -> list:
    m = run["manifest"] or {}
    facts = m.get("host_facts") or _first_provenance(run).get("host_facts") or {}
    gpus = facts.get("gpus") or []
    return sorted(str(g.get("name", "?")) if isinstance(g, dict) else str(g) for g in gpus)


def _build_commands(run: dict) -> list:
    for doc in run["suites"].values():
        cmds = (doc.get("build") or {}).get("commands")
        if cmds:
            return list(cmds)
    m = run["manifest"] or {}
    b = m.get("build") or _first_provenance(run).get("build") or {}
    return list(b.get("commands") or [])


def build_flags(commands) -> list:
    """The flags that change code (paths dropped): sorted unique (tool, flag) strings."""
    flags = set()
    for cmd in commands:
        try:
            toks = shlex.split(cmd)
        except ValueError:
            toks = cmd.split()
        if not toks:
            continue
        tool = Path(toks[0]).name
        skip_next = False
        for t in toks[1:]:
            if skip_next:
                skip_next = False
                continue
            if t in ("-o", "-I", "-L", "-MF", "-x"):
                skip_next = t != "-x"
                if t == "-x":
                    flags.add(f"{tool} -x")
                continue
            if t.startswith(("-I", "-L", "-o", "-MF")) or not t.startswith("-"):
                continue
            flags.add(f"{tool} {t}")
    return sorted(flags)


def _refusal(a: dict, b: dict) -> str | None:
    ha, hb = _host_name(a), _host_name(b)
    if ha != hb:
        return f"different hosts: {ha} vs {hb}"
    ga, gb = _gpu_models(a), _gpu_models(b)
    if ga != gb:
        return f"different GPU models: {ga or 'none'} vs {gb or 'none'}"
    fa, fb = build_flags(_build_commands(a)), build_flags(_build_commands(b))
    if fa != fb:
        only_a = sorted(set(fa) - set(fb))
        only_b = sorted(set(fb) - set(fa))
        return (f"different build flags: only in A {only_a or '[]'}, only in B {only_b or '[]'}")
    return None


# ---------------------------------------------------------------- comparison -------------

@dataclass
class Row:
    suite: str
    key: str
    median_a: float
    median_b: float
    change: float          # median_b / median_a - 1 (positive: B is slower)
    ci: tuple              # bootstrap 95% interval of `change`
    p_value: float
    n_a: int
    n_b: int
    verdict: str           # faster | slower | no significant change
    regression: bool       # slower, and the interval's low end above `allowed`
    allowed: float = 0.0   # the change this row must exceed: threshold, noise floor, spreads, machines
    spread: tuple = (0.0, 0.0)  # each run's own relative spread (IQR / median) of its samples
    not_judged: str | None = None  # why a slowdown here cannot be called a regression


@dataclass
class Comparison:
    run_a: Path
    run_b: Path
    threshold: float
    alpha: float
    refused: str | None = None
    rows: list = field(default_factory=list)
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    machines: list = field(default_factory=list)  # how the two runs' machines differ ([]: the same)

    @property
    def regressions(self) -> list:
        return [r for r in self.rows if r.regression]

    @property
    def nothing_comparable(self) -> bool:
        return not self.refused and not self.rows

    @property
    def exit_code(self) -> int:
        if self.refused or self.nothing_comparable:
            return EXIT_REFUSED
        return EXIT_REGRESSION if self.regressions else 0

    def format(self) -> str:
        head = f"compare A={self.run_a.name} B={self.run_b.name}"
        if self.refused:
            return f"{head}: refused: {self.refused}\n"
        if self.nothing_comparable:
            return (f"{head}: nothing comparable: no benchmark of one run is in the other "
                    f"({len(self.only_a)} only in A, {len(self.only_b)} only in B)\n")
        from bench import format_table

        warn = [f"warning: {w}" for w in self.warnings]
        if self.machines:
            warn.append("note: different machines (" + "; ".join(self.machines) + f"): allowed changes are "
                        f"{MACHINE_FACTOR:g}x wider")

        def verdict(r):
            if r.regression:
                return r.verdict + " REGRESSION"
            if r.not_judged and r.verdict == "slower":
                return r.verdict + " (not judged: " + r.not_judged + ")"
            return r.verdict

        rows = [[r.suite, r.key, r.median_a * 1e6, r.median_b * 1e6, f"{100 * r.change:+.1f}%",
                 f"[{100 * r.ci[0]:+.1f}, {100 * r.ci[1]:+.1f}]%", f"{100 * r.allowed:.0f}%", r.p_value,
                 verdict(r)] for r in self.rows]
        text = [head + f" (threshold {100 * self.threshold:.1f}%, alpha {self.alpha})"] + warn + [
                format_table(["suite", "benchmark", "A us", "B us", "change", "95% CI", "allowed", "p",
                              "verdict"], rows)]
        counts = {v: sum(r.verdict == v for r in self.rows)
                  for v in ("faster", "slower", "no significant change")}
        within = sum(r.verdict == "slower" and not r.regression and not r.not_judged for r in self.rows)
        unjudged = sum(r.verdict == "slower" and bool(r.not_judged) for r in self.rows)
        text.append(", ".join(f"{n} {v}" for v, n in counts.items())
                    + f"; {len(self.regressions)} regression(s) beyond the allowed change"
                    + f" ({within} slower within the noise" + (f", {unjudged} not judged" if unjudged else "") + ")")
        if self.only_a or self.only_b:
            text.append(f"not compared: {len(self.only_a)} only in A, {len(self.only_b)} only in B")
        return "\n".join(text) + "\n"


def _records(doc: dict) -> dict:
    out = {}
    for rec in doc.get("results", []):
        if isinstance(rec, dict) and rec.get("samples"):
            if isinstance(rec.get("validation"), dict) and rec["validation"].get("ok") is False:
                continue  # an invalid result is not a timing to compare
            out[record_key(rec)] = rec
    return out


def compare_runs(run_a_dir, run_b_dir, threshold: float = 0.05, alpha: float = 0.01) -> Comparison:
    """Compare run B against run A (the baseline); see the module docstring."""
    if not (0 <= threshold < 10):
        raise ValueError(f"compare: threshold must be a fraction in [0, 10), got {threshold}")
    a, b = _load_run(Path(run_a_dir)), _load_run(Path(run_b_dir))
    cmp = Comparison(Path(run_a_dir), Path(run_b_dir), threshold, alpha)
    cmp.refused = _refusal(a, b)
    if cmp.refused:
        return cmp
    overlapped = overlapped_runs(Path(run_a_dir).parent, [Path(run_a_dir), Path(run_b_dir)])
    for rid, others in overlapped.items():
        cmp.warnings.append(
            f"run {rid} overlapped in time on the same machine (same boot_id) with "
            + ", ".join(f"{o} ({w})" for o, w in others)
            + "; its timings carry the other run's load, so its slowdowns are not judged (rerun it alone)")
    cmp.machines = machine_differences(a, b)
    return _compare_records(cmp, a, b, not_judged=(
        f"run {sorted(overlapped)[0]} overlapped another run" if overlapped else None))


def _parse_utc(s):
    from datetime import datetime, timezone

    try:
        return datetime.strptime(str(s), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def run_window(manifest) -> tuple | None:
    """(boot_id, started, finished) of a run's manifest, or None when a field is missing."""
    m = manifest or {}
    boot = (m.get("host_facts") or {}).get("boot_id")
    t0, t1 = _parse_utc(m.get("started")), _parse_utc(m.get("finished"))
    if not boot or t0 is None or t1 is None:
        return None
    return boot, t0, t1


def find_overlaps(manifests: dict) -> dict:
    """{run id: [(other run id, "HH:MM:SS..HH:MM:SS UTC")]} for runs whose started..finished
    windows intersect another run's on the same machine boot (host_facts.boot_id): each
    measured the other's load. manifests: {run id: manifest dict}."""
    wins = {rid: w for rid, m in manifests.items() if (w := run_window(m))}
    out = {}
    for a, (ba, a0, a1) in sorted(wins.items()):
        for b, (bb, b0, b1) in sorted(wins.items()):
            if a == b or ba != bb:
                continue
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.setdefault(a, []).append(
                    (b, f"both running {lo:%H:%M:%S}..{hi:%H:%M:%S} UTC, {(hi - lo).total_seconds():.0f} s"))
    return out


def overlapped_runs(host_dir, runs) -> dict:
    """find_overlaps over every run folder's manifest under host_dir (and the given run folders,
    wherever they are), restricted to the given runs: {run name: [(other, why)]}."""
    manifests = {}
    dirs = [p for p in Path(host_dir).iterdir() if p.is_dir()] if Path(host_dir).is_dir() else []
    for d in dirs + [Path(r) for r in runs]:
        m = d / "manifest.json"
        if m.is_file() and not d.name.startswith("."):
            try:
                manifests[d.name] = json.loads(m.read_text())
            except json.JSONDecodeError:
                continue  # compare/_load_run reports the broken manifest of the runs compared
    names = {Path(r).name for r in runs}
    return {k: v for k, v in find_overlaps(manifests).items() if k in names}


# Noise floors per kind of benchmark (relative change): how far runs of the same code on the
# same machine drift apart beyond what one run's spread shows. GPU kernels timed with events are
# steady; host-side timings (CPU backends, the SGLang-style CPU tree path) follow the CPU's
# clocks and neighbours; decode loops and the HTTP service add Python and a scheduler.
NOISE_FLOORS = {"cuda": 0.05, "cpu": 0.20, "e2e": 0.15, "service": 0.25}
DEFAULT_NOISE_FLOOR = 0.10
SPREAD_FACTOR = 2.0    # a change must exceed twice the larger run's own IQR / median
MACHINE_FACTOR = 2.0   # different machines (hostname, GPU UUIDs, boot): allowed changes doubled


def noise_floor(suite: str, key: str) -> float:
    """The noise floor of one record's kind: by suite (e2e, service), else by its backend."""
    head = key.split(" ", 1)[0]
    bench, _, backend = head.partition("/")
    if suite in ("service", "e2e") or bench in ("service", "e2e"):
        return NOISE_FLOORS["service" if "service" in (suite, bench) else "e2e"]
    if "cpu" in backend or backend.startswith("sglang"):
        return NOISE_FLOORS["cpu"]
    if "cuda" in backend:
        return NOISE_FLOORS["cuda"]
    return DEFAULT_NOISE_FLOOR


def _machine(run: dict) -> dict:
    m = run["manifest"] or {}
    facts = m.get("host_facts") or _first_provenance(run).get("host_facts") or {}
    gpus = facts.get("gpus") or []
    uuids = sorted(str(g.get("uuid")) for g in gpus if isinstance(g, dict) and g.get("uuid"))
    return {"hostname": facts.get("hostname"), "GPU UUIDs": uuids or None, "boot id": facts.get("boot_id")}


def machine_differences(a: dict, b: dict) -> list:
    """How the machines of two runs differ, from their host facts ([]: the same, as far as both
    manifests tell): hostname, GPU UUIDs, boot id (a reboot changes clocks and placement)."""
    ma, mb = _machine(a), _machine(b)
    out = []
    for k in ma:
        if ma[k] and mb[k] and ma[k] != mb[k]:
            va, vb = (", ".join(v) if isinstance(v, list) else v for v in (ma[k], mb[k]))
            out.append(f"{k} {va} vs {vb}")
    return out


def _compare_records(cmp, a, b, not_judged=None):
    machine = MACHINE_FACTOR if cmp.machines else 1.0
    for suite in sorted(set(a["suites"]) | set(b["suites"])):
        ra = _records(a["suites"].get(suite, {}))
        rb = _records(b["suites"].get(suite, {}))
        cmp.only_a += [f"{suite}: {k}" for k in sorted(set(ra) - set(rb))]
        cmp.only_b += [f"{suite}: {k}" for k in sorted(set(rb) - set(ra))]
        for key in sorted(set(ra) & set(rb)):
            try:
                sa = np.asarray(ra[key]["samples"], dtype=np.float64).ravel()
                sb = np.asarray(rb[key]["samples"], dtype=np.float64).ravel()
            except (TypeError, ValueError):
                cmp.warnings.append(f"{suite}: {key}: samples are not numbers; not compared")
                continue
            sa, sb = sa[np.isfinite(sa)], sb[np.isfinite(sb)]
            if sa.size == 0 or sb.size == 0:
                cmp.warnings.append(f"{suite}: {key}: no finite samples; not compared")
                continue
            ma, mb = float(np.median(sa)), float(np.median(sb))
            change = mb / ma - 1.0 if ma > 0 else float("inf")
            _, p = mann_whitney_u(sa, sb)
            seed = int.from_bytes(f"{suite}|{key}".encode()[-8:].rjust(8, b"\0"), "little") % 2**32
            ci = bootstrap_change(sa, sb, seed)
            if p >= cmp.alpha or mb == ma:
                verdict = "no significant change"
            else:
                verdict = "slower" if mb > ma else "faster"
            # A regression must clear, at the low end of its interval, the largest of: the
            # threshold asked for, the noise floor of its kind, and twice the larger spread either
            # run measured itself; doubled across machines. Between runs the machine's state
            # drifts more than the samples inside one run show.
            spread = (relative_spread(sa), relative_spread(sb))
            allowed = machine * max(cmp.threshold, noise_floor(suite, key), SPREAD_FACTOR * max(spread))
            cmp.rows.append(Row(suite, key, ma, mb, change, ci, p, sa.size, sb.size, verdict,
                                verdict == "slower" and ci[0] > allowed and not_judged is None,
                                allowed, spread, not_judged))
    return cmp


def latest_run(host_dir, exclude=None) -> Path | None:
    """The newest benchmark run under `host_dir` (results/<host>/), skipping `exclude`; None
    when there is none. A benchmark run is a folder whose final manifest.json says
    `kind == "bench"` (test runs and incomplete folders are never picked); run ids start with
    a UTC timestamp, so the largest name is the newest. Used by `invoke compare --against
    latest`."""
    host_dir = Path(host_dir)
    if not host_dir.is_dir():
        return None
    skip = Path(exclude).resolve() if exclude else None
    runs = []
    for d in host_dir.iterdir():
        m = d / "manifest.json"
        if d.name.startswith(".") or not m.is_file() or (skip is not None and d.resolve() == skip):
            continue
        try:
            kind = json.loads(m.read_text()).get("kind")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"{m}: not a JSON object (a damaged manifest)") from None
        if kind == "bench":
            runs.append(d)
    return max(runs, key=lambda d: d.name) if runs else None


def _run_dir(results_root: Path, spec: str) -> Path:
    """A run folder from a path or a run id under results/<host>/."""
    p = Path(spec)
    if p.is_dir():
        return p
    hits = sorted(Path(results_root).glob(f"*/{spec}")) if "/" not in spec and not spec.startswith(".") else []
    if len(hits) != 1:
        raise ValueError(f"{spec!r}: " + ("no such run under results/" if not hits else
                         f"found in several hosts: {', '.join(str(h) for h in hits)}"))
    return hits[0]


def resolve_pair(results_root, spec_a: str, spec_b: str) -> tuple:
    """(run A, run B) folders for `compare A B`, where either may be `latest`: the newest bench
    run of the other's host other than it; both `latest`: the two newest bench runs of the one
    host under results_root. ValueError (a usage error) when that cannot be decided."""
    results_root = Path(results_root)
    if spec_a == "latest" and spec_b == "latest":
        hosts = sorted(p for p in results_root.iterdir() if p.is_dir()) if results_root.is_dir() else []
        if len(hosts) != 1:
            raise ValueError("`latest latest` needs exactly one host under results/ "
                             f"(found {len(hosts)}); name one run instead")
        b = latest_run(hosts[0])
        a = latest_run(hosts[0], exclude=b) if b else None
        if a is None:
            raise ValueError(f"fewer than two bench runs under {hosts[0]}")
        return a, b
    if spec_a == "latest":
        b = _run_dir(results_root, spec_b)
        a = latest_run(b.parent, exclude=b)
        if a is None:
            raise ValueError(f"no other bench run under {b.parent} to compare {b.name} against")
        return a, b
    a = _run_dir(results_root, spec_a)
    if spec_b == "latest":
        b = latest_run(a.parent, exclude=a)
        if b is None:
            raise ValueError(f"no other bench run under {a.parent} to compare {a.name} against")
        return a, b
    return a, _run_dir(results_root, spec_b)
