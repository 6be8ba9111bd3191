"""`python -m bench --suite a,b --out DIR [--quick] [--device cpu|cuda|all] [--url URL]`.

Runs the suites (bench/__init__.py) and writes DIR/<suite>.json and DIR/<suite>.txt.
Exit status: 0 every suite ok; 1 a suite failed or a record failed validation; 5 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import bench


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    p.add_argument("--suite", required=True,
                   help=f"comma-separated suites: {', '.join(bench.SUITES)}, or 'all'")
    p.add_argument("--out", required=True, type=Path, help="folder for <suite>.json and .txt")
    p.add_argument("--quick", action="store_true", help="reduced grids and reps (CI, smoke runs)")
    p.add_argument("--device", default="all", help="cpu, cuda or all (default: all present)")
    p.add_argument("--url", default=None, help="server URL for the service suite")
    return p


def main(argv=None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage line
        return 0 if e.code == 0 else 5
    try:
        names = [s.strip() for s in args.suite.split(",") if s.strip()]
        if names == ["all"]:
            names = list(bench.SUITES)
        if not names:
            raise bench.UsageError("--suite: no suite named")
        for n in names:
            if n not in bench.SUITES:
                raise bench.UsageError(f"--suite: unknown suite {n!r} (known: {', '.join(bench.SUITES)})")
        devices = bench.resolve_devices(args.device)
    except bench.UsageError as e:
        print(f"error: bench: {e}", file=sys.stderr)
        return 5
    library, why = bench.load_library()
    if library is None:
        print(f"bench: native library not loaded: {why}", file=sys.stderr)
    ctx = bench.Context(out_dir=args.out, quick=args.quick, devices=devices,
                        args={"url": args.url}, library=library, library_error=why)
    outcomes = bench.run_suites(names, ctx)
    bad = [o for o in outcomes if o.status != "ok"]
    for o in bad:
        print(f"error: bench: {o.name}: {o.status}: {o.error}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
