"""Benchmark harness: suites, the context they run in, and the files they leave.

A suite is a module `bench/<name>.py` with `NAME` and `run(ctx) -> dict` returning
`{"params": {...}, "results": [record, ...], "table": "<short text table>"}`. A record carries its
own parameters (`bench`, `backend`, `case`), raw `samples` (seconds), `summary`
(`bench.timing.summarize`), derived `rates` with their formulas, and `validation`
(`{"ok": bool, ...}`) from the check against the reference made before timing.

`run_suites` runs the named suites one after another; a suite that is missing or raises is
recorded as failed (its JSON says why) and the others still run. Each suite leaves
`<out>/<name>.json` (schema below) and `<out>/<name>.txt` (its table).

JSON schema 1: `schema`, `suite`, `status` (ok | failed | invalid: a record failed validation),
`error` (failed only), `params`, `results`, `table`, `provenance` (engine.remote.provenance.collect,
or {"error": why}), `build` (library path, arch and its build_info commands), `ceilings` (per
device, when the suite used them), `started` / `finished` (UTC), `seconds`.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = 1
# Every suite `python -m bench` knows; the last three are other areas' modules.
SUITES = ("kernels", "tree_build", "pipeline", "e2e", "service")
REPO_ROOT = Path(__file__).resolve().parents[1]

__all__ = ["SCHEMA", "SUITES", "Context", "SuiteOutcome", "UsageError", "resolve_devices",
           "load_library", "run_suites", "format_table", "utc_now"]


class UsageError(ValueError):
    """A bad command line or option (exit code 5)."""


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Context:
    """What a suite gets: where to write, how much to do, on which devices, with which library."""

    out_dir: Path
    quick: bool = False
    devices: list = field(default_factory=lambda: ["cpu"])
    args: dict = field(default_factory=dict)
    library: object = None          # engine.native.library() result, or None
    library_error: str | None = None  # why `library` is None
    _ceilings: dict = field(default_factory=dict, repr=False)
    _ceilings_used: set = field(default_factory=set, repr=False)
    _suite: str = field(default="", repr=False)       # "kernels (1/3)": set by run_suites
    _suite_t0: float = field(default=0.0, repr=False)
    progress_stream: object = field(default=None, repr=False)  # None: sys.stderr

    def progress(self, done: int, total: int, what: str = "") -> None:
        """One line after each finished case: `progress: <suite> (i/n) case done/total <what>,
        E s elapsed, ~L s left`. The host-side runner passes these on to the client's terminal
        as they happen (engine/remote/runner.py); the estimate is the suite's mean case time."""
        elapsed = time.monotonic() - self._suite_t0 if self._suite_t0 else 0.0
        left = f", ~{elapsed / done * (total - done):.0f} s left" if 0 < done <= total else ""
        print(f"progress: {self._suite or 'bench'} case {done}/{total}{' ' + what if what else ''}, "
              f"{elapsed:.0f} s elapsed{left}", file=self.progress_stream or sys.stderr, flush=True)

    def ceilings(self, device: str) -> dict:
        """The device's measured ceilings (bench.ceilings.measure), measured once per run."""
        if device not in self._ceilings:
            from bench import ceilings

            self._ceilings[device] = ceilings.measure(device, quick=self.quick)
        self._ceilings_used.add(device)
        return self._ceilings[device]

    def require_library(self, what: str):
        """The native library, or an error naming what needed it and why it is missing."""
        if self.library is None:
            raise RuntimeError(f"{what} needs libkdtree.so: {self.library_error or 'not loaded'}")
        return self.library


@dataclass
class SuiteOutcome:
    name: str
    status: str           # ok | failed | invalid
    json_path: Path
    error: str | None = None
    seconds: float = 0.0


def resolve_devices(spec: str) -> list:
    """`cpu`, `cuda` or `all` -> the device list; `cuda` without a GPU is a usage error."""
    spec = (spec or "all").strip()
    if spec not in ("cpu", "cuda", "all"):
        raise UsageError(f"--device must be cpu, cuda or all, got {spec!r}")
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    if spec == "cuda" and not has_cuda:
        raise UsageError("--device cuda: torch reports no CUDA device on this machine")
    if spec == "cpu":
        return ["cpu"]
    if spec == "cuda":
        return ["cuda"]
    return ["cpu", "cuda"] if has_cuda else ["cpu"]


def load_library():
    """(library, None) or (None, why): `engine.native.library()` loaded lazily."""
    try:
        from engine import native
    except Exception as e:  # the native bindings may not be there (yet) on this checkout
        return None, f"engine.native could not be imported: {type(e).__name__}: {e}"
    try:
        return native.library(), None
    except Exception as e:
        return None, f"engine.native.library() failed: {type(e).__name__}: {e}"


def _build_block(ctx: Context) -> dict:
    lib = ctx.library
    if lib is None:
        return {"library": None, "error": ctx.library_error}
    info = getattr(lib, "build_info", None) or {}
    return {
        "library": str(getattr(lib, "path", "")),
        "arch": info.get("arch"),
        "cuda": info.get("cuda"),
        "commands": list(info.get("commands", [])),
        "built": info.get("built"),
    }


def _provenance(ctx: Context) -> dict:
    build_dir = None
    if ctx.library is not None and getattr(ctx.library, "path", None):
        build_dir = Path(ctx.library.path).parent
    try:
        from engine.remote import provenance
    except Exception as e:
        return {"error": f"engine.remote.provenance could not be imported: {type(e).__name__}: {e}"}
    try:
        return provenance.collect(REPO_ROOT, build_dir=build_dir)
    except Exception as e:
        return {"error": f"engine.remote.provenance.collect failed: {type(e).__name__}: {e}"}


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, set):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _load_suite(name: str):
    try:
        mod = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"bench.{name}":
            raise RuntimeError(f"suite {name!r}: bench/{name}.py is not in this checkout") from None
        raise
    if not callable(getattr(mod, "run", None)):
        raise RuntimeError(f"suite {name!r}: bench/{name}.py has no run(ctx) function")
    return mod


def _check_output(name: str, out) -> None:
    if not isinstance(out, dict):
        raise RuntimeError(f"suite {name!r}: run(ctx) returned {type(out).__name__}, expected a dict")
    for key, typ in (("params", dict), ("results", list), ("table", str)):
        if not isinstance(out.get(key), typ):
            raise RuntimeError(f"suite {name!r}: run(ctx)[{key!r}] must be a {typ.__name__}, "
                               f"got {type(out.get(key)).__name__}")


def _invalid_records(results: list) -> list:
    return [r for r in results if isinstance(r, dict)
            and isinstance(r.get("validation"), dict) and r["validation"].get("ok") is False]


def run_suites(names, ctx: Context, log=sys.stderr) -> list:
    """Run each suite, write its JSON and text table, and return one SuiteOutcome per suite."""
    for n in names:
        if n not in SUITES:
            raise UsageError(f"--suite: unknown suite {n!r} (known: {', '.join(SUITES)})")
    ctx.out_dir = Path(ctx.out_dir)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    provenance = _provenance(ctx)
    build = _build_block(ctx)
    outcomes = []
    for k, name in enumerate(names, 1):
        ctx._suite, ctx._suite_t0 = f"{name} ({k}/{len(names)})", time.monotonic()
        print(f"bench: {name}: running (devices {','.join(ctx.devices)}"
              f"{', quick' if ctx.quick else ''})", file=log, flush=True)
        started, t0 = utc_now(), time.monotonic()
        ctx._ceilings_used = set()
        doc = {"schema": SCHEMA, "suite": name, "status": "ok", "params": {}, "results": [],
               "table": ""}
        try:
            out = _load_suite(name).run(ctx)
            _check_output(name, out)
            doc.update(params=out["params"], results=out["results"], table=out["table"])
            bad = _invalid_records(out["results"])
            if bad:
                doc["status"] = "invalid"
                doc["error"] = (f"{len(bad)} record(s) failed validation against the reference, "
                                f"first: {bad[0].get('bench')} {bad[0].get('backend')} "
                                f"{bad[0].get('case')}: {bad[0]['validation'].get('error')}")
        except Exception as e:
            doc["status"] = "failed"
            doc["error"] = f"{type(e).__name__}: {e}"
            doc["traceback"] = traceback.format_exc()
        seconds = time.monotonic() - t0
        doc.update(provenance=provenance, build=build, started=started, finished=utc_now(),
                   seconds=round(seconds, 3))
        if ctx._ceilings_used:
            doc["ceilings"] = {d: ctx._ceilings[d] for d in sorted(ctx._ceilings_used)}
        json_path = ctx.out_dir / f"{name}.json"
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
        tmp.replace(json_path)
        table = doc["table"] if doc["status"] != "failed" else f"suite {name} FAILED: {doc['error']}\n"
        if doc["status"] == "invalid":
            table += f"\nVALIDATION FAILED: {doc['error']}\n"
        (ctx.out_dir / f"{name}.txt").write_text(table if table.endswith("\n") else table + "\n")
        outcomes.append(SuiteOutcome(name, doc["status"], json_path, doc.get("error"), seconds))
        print(f"bench: {name}: {doc['status']} ({seconds:.1f} s) -> {json_path}", file=log, flush=True)
    return outcomes


def format_table(headers, rows) -> str:
    """An aligned text table: numbers right-aligned, text left-aligned, one header rule."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [bool(rows) and all(_is_num(r[i]) for r in rows) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.rjust(w) if numeric[i] else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out) + "\n"


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) or v is None


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 1000:
            return f"{v:.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 0.01:
            return f"{v:.3f}"
        return f"{v:.2e}"
    return str(v)
