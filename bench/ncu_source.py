"""Nsight Compute's source page of one kernel, summed between barriers (a development tool).

`ncu ... -o rep python3 ...` with `--section SourceCounters --section WarpStateStats`, then
`ncu --import rep.ncu-rep --page source --print-source sass --csv > src.csv`, gives every SASS
instruction its execution count and its warp-stall samples by reason: thousands of rows. This
cuts them into the stretches of code between two block barriers (BAR.SYNC) or exits, in address
order, which for a block-synchronous kernel such as the parallel tree build are its phases, and
prints each stretch's share of the samples, its leading stall reasons and how much of its code
ran, beside the kernel's totals: the instructions that ran, and the 128-byte lines of code they
take (the instruction fetch's unit):

    python3 -m bench.ncu_source src.csv [--min-share 0.5]

Sampling every 32 cycles (`--warp-sampling-interval 0`) gives a few hundred samples for a
9 us launch of one block; `--cache-control none` with a `--launch-skip` past the warm-up keeps
the caches as the calls before left them. docs/DEVELOPING.md has the commands.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
LINE_BYTES = 128  # an instruction-cache line


@dataclass
class Row:
    address: int  # bytes from the kernel's first instruction
    source: str   # the SASS instruction
    executed: int  # warp-level executions
    samples: float
    reasons: dict[str, float]  # stall reason (ncu's stall_* column, prefix dropped) -> samples


@dataclass
class Region:
    first: int
    last: int
    rows: list[Row] = field(default_factory=list)

    @property
    def samples(self) -> float:
        return sum(r.samples for r in self.rows)

    @property
    def executed(self) -> int:
        return sum(r.executed for r in self.rows)

    @property
    def ran(self) -> int:
        """Instructions of the region that ran at least once."""
        return sum(1 for r in self.rows if r.executed)

    def reasons(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.rows:
            for k, v in r.reasons.items():
                out[k] = out.get(k, 0.0) + v
        return out


def _number(text: str) -> float:
    t = text.replace(",", "").strip()
    return float(t) if t else 0.0


def load(path: str) -> tuple[str, list[Row]]:
    """The kernel's name and rows from an ncu source-page CSV (the first kernel in the file).
    Raises ValueError naming what is missing when the file is not such a CSV."""
    try:
        with open(path, newline="") as f:
            table = list(csv.reader(f))
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    if len(table) < 3 or not table[0] or table[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source page: expected a first line \"Kernel Name\","
                         f" from `ncu --import REP --page source --print-source sass --csv`")
    name = table[0][1] if len(table[0]) > 1 else "?"
    header = table[1]
    missing = [c for c in ("Address", "Source", EXECUTED, SAMPLES) if c not in header]
    if missing:
        raise ValueError(f"{path}: the source page lacks column(s) {', '.join(missing)}: "
                         f"profile with --section SourceCounters --section WarpStateStats")
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    rows: list[Row] = []
    base = None
    for n, rec in enumerate(table[2:], start=3):
        if rec and rec[0] == "Kernel Name":
            break  # the next kernel's page
        if len(rec) < len(header):
            continue
        try:
            addr = int(rec[col["Address"]], 16)
            row = Row(0, rec[col["Source"]].strip(), int(_number(rec[col[EXECUTED]])),
                      _number(rec[col[SAMPLES]]),
                      {h[len("stall_"):]: _number(rec[col[h]]) for h in stalls})
        except ValueError:
            raise ValueError(f"{path}:{n}: not a number where one was expected") from None
        base = addr if base is None else base
        row.address = addr - base
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no instruction rows")
    return name, rows


def regions(rows: list[Row]) -> list[Region]:
    """The rows cut after each block barrier or exit, in address order."""
    out: list[Region] = []
    cur: Region | None = None
    for r in sorted(rows, key=lambda r: r.address):
        if cur is None:
            cur = Region(r.address, r.address)
            out.append(cur)
        cur.rows.append(r)
        cur.last = r.address
        if "BAR.SYNC" in r.source or "EXIT" in r.source:
            cur = None
    return out


def summary(name: str, rows: list[Row], min_share: float = 0.5) -> str:
    """The kernel's totals, then each region holding at least `min_share` percent of the
    samples: addresses, instructions (static, of them run, executions), samples and the
    four leading stall reasons."""
    total = sum(r.samples for r in rows) or 1.0
    ran = [r for r in rows if r.executed]
    lines = len({r.address // LINE_BYTES for r in ran})
    top = sorted(Region(0, 0, rows).reasons().items(), key=lambda kv: -kv[1])[:6]
    out = [f"{name}",
           f"samples {total:.0f}; instructions executed {sum(r.executed for r in rows)}; "
           f"{len(ran)} of {len(rows)} instructions ran, on {lines} lines of {LINE_BYTES} bytes "
           f"({lines * LINE_BYTES / 1024:.1f} KB)",
           "stalls: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in top),
           f"{'region':>15}  {'instr':>5} {'ran':>5} {'execs':>7}  {'samples':>13}  reasons"]
    for g in regions(rows):
        if 100 * g.samples / total < min_share:
            continue
        lead = sorted(g.reasons().items(), key=lambda kv: -kv[1])[:4]
        out.append(f"{g.first:6x}-{g.last:6x}  {len(g.rows):5d} {g.ran:5d} {g.executed:7d}  "
                   f"{g.samples:6.0f} ({100 * g.samples / total:4.1f}%)  "
                   + " ".join(f"{k}:{v:.0f}" for k, v in lead if v))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.ncu_source", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--min-share", type=float, default=0.5,
                    help="show regions with at least this percent of the samples (default 0.5)")
    a = ap.parse_args(argv)
    if not 0 <= a.min_share <= 100:
        ap.error("--min-share must be a percentage in 0..100")
    try:
        name, rows = load(a.csv)
    except ValueError as e:
        print(f"ncu_source: {e}", file=sys.stderr)
        return 2
    print(summary(name, rows, a.min_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
