"""Where the tree build's time goes, phase by phase (a development tool, not a suite).

The parallel build (cuda/src/tree_build_parallel.h) records the SM's cycle counter at every phase
boundary when the library is built with KDT_PAR_PROFILE; each block prints its phases and total
through device printf. This runs the build on CUDA (KDT_TREE_BUILD=parallel) in a child process,
captures that output, and prints the blocks' spread and the phases of the median and slowest
blocks. With --algo warp it runs the one-warp build (KDT_TREE_BUILD=warp) instead, whose probes
(one request a warp) split it into the wait to start, the prologue, the pops and the outputs:

    bash cuda/build.sh --arch sm_90 --out build/prof --define KDT_PAR_PROFILE \\
        --define KDT_PAR_REPEAT=2
    KDTREE_LIB=build/prof/libkdtree.so python3 -m bench.tree_profile --budget 1023 --bs 64

KDT_PAR_REPEAT=2 builds each request twice in the launch and keeps the second build's marks
(warm shared memory; the staging of the log-probs is outside the repeat). The probes cost
registers, shared-memory stores and about 130 cycles a mark, so cycles here run above a release
build's; compare phases within one profile, and take absolute times from the kernels suite.
A block's output-writing phases (96, 97, 99) can stall for tens of thousands of cycles while
other blocks print: read the slowest block's earlier phases, not those.

The calls run one by one (eager launches), or with --graph captured in one CUDA graph and
replayed, as the suites time the kernel alone. Phase 15 is the wait for the kernel before
(programmatic dependent launch: the block starts early and waits there), so a phase after it
is the build's own.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

# Probe ids (blk.mark in tree_build_parallel.h and tree_build_parallel.cu): each names the phase
# that ends there; 100 + d, 200 + d and 300 + d are level d's; 70, 71 and 72 repeat for each of
# warp 0's batches in the queue (GpuBlock::expand), and 7 then holds the wait for the other warps.
PHASES = {
    15: "staging: the wait for the kernel before", 10: "staging: start",
    11: "staging: loaded, checked",
    12: "staging: warps' verdicts", 13: "staging: chain sums", 14: "staging: barrier",
    0: "staging", 1: "exactness check, chain sums", 2: "exactness verdict",
    20: "family sized", 21: "family's lowest score", 4: "bins made",
    5: "histogram pass", 3: "first threshold", 6: "queue: the first runs", 7: "queue: drained",
    70: "queue: a batch's run lengths", 71: "queue: its runs placed",
    72: "queue: its children written",
    86: "order: binned", 80: "order: bins scanned", 85: "order: placed", 81: "order: ranks",
    82: "nodes", 96: "slots",
    97: "visibility zeroed", 99: "visibility rows",
    60: "warp: waiting to start", 61: "warp: prologue (loads)", 62: "warp: pops",
    69: "warp: outputs",
}
END_IDS = (99, 69)  # the probe that ends a build: the parallel build's, the warp build's
LEVEL_PHASES = {1: "runs", 2: "write", 3: "bound check"}


def phase_name(pid: int) -> str:
    if pid in PHASES:
        return PHASES[pid]
    if pid // 100 in LEVEL_PHASES and pid % 100:
        return f"level {pid % 100}: {LEVEL_PHASES[pid // 100]}"
    return f"probe {pid}"


@dataclass
class Block:
    index: int
    phases: list[tuple[int, int]]  # (probe id, cycles since the previous probe)

    @property
    def total(self) -> int:
        return sum(c for _, c in self.phases)


def parse(text: str) -> list[Block]:
    """The last complete build of every block in `text` ("PROF block id cycles" lines, a build
    ending at probe 99, or 69 for the warp build's requests); other lines are ignored. Raises
    ValueError when there is none."""
    current: dict[int, list[tuple[int, int]]] = {}
    last: dict[int, list[tuple[int, int]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4 or parts[0] != "PROF":
            continue
        try:
            b, pid, cycles = (int(x) for x in parts[1:])
        except ValueError:
            continue
        current.setdefault(b, []).append((pid, cycles))
        if pid in END_IDS:
            last[b] = current.pop(b)
    if not last:
        raise ValueError("no profile lines (PROF ...): is KDTREE_LIB a library built with "
                         "--define KDT_PAR_PROFILE, and did the build run the profiled path?")
    return [Block(b, ph) for b, ph in sorted(last.items())]


def summary(blocks: list[Block]) -> str:
    """The blocks' totals (min / median / max) and the median and slowest blocks' phases."""
    ranked = sorted(blocks, key=lambda b: (b.total, b.index))
    median = ranked[len(ranked) // 2]
    slowest = ranked[-1]
    lines = [(f"{len(blocks)} block(s); cycles per block: min {ranked[0].total}, median "
              f"{median.total} (block {median.index}), max {slowest.total} "
              f"(block {slowest.index})")]
    shown = [median] if slowest is median else [median, slowest]
    for blk in shown:
        label = "median" if blk is median else "slowest"
        lines.append(f"{label} block {blk.index}: {blk.total} cycles")
        for pid, cycles in blk.phases:
            lines.append(f"  {pid:3d} {phase_name(pid):28s} {cycles:9d}")
    return "\n".join(lines)


def _child(budget: int, bs: int, seed: int, calls: int, graph: bool = False) -> None:
    """Runs the build `calls` times on CUDA (its device printf goes to this process's stdout):
    one launch after another, or with `graph` once alone and then `calls` launches captured in
    a CUDA graph, replayed twice (bench.timing.time_cuda_graph's way, on a side stream)."""
    import numpy as np
    import torch

    from bench.inputs import tree_inputs
    from bench.native_calls import prepare_tree_build
    from bench.timing import time_cuda_graph
    from bench.tree_algo import side_stream
    from engine.native import library

    inp = tree_inputs(np.random.default_rng(seed), bs, 15, min(budget, 64))
    with side_stream("cuda"):
        p = prepare_tree_build(library(), "cuda", inp, budget)
        if graph:
            time_cuda_graph(p.run, calls=calls, reps=1, warmup=1, min_reps=1)
        else:
            for _ in range(calls):
                p.run()
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.tree_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=1023)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="builds; the last one is shown")
    ap.add_argument("--graph", action="store_true",
                    help="capture the calls in a CUDA graph and replay it (the suites' kernel "
                         "alone) instead of launching them one by one")
    ap.add_argument("--algo", choices=("parallel", "warp"), default="parallel",
                    help="the build to profile (KDT_TREE_BUILD); default parallel")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not 1 <= a.budget <= 1024 or not 1 <= a.bs or not 1 <= a.calls:
        ap.error("--budget must be in 1..1024, --bs and --calls >= 1")
    if a.algo == "warp" and a.budget > 1023:
        ap.error("--algo warp takes budgets up to 1023")
    if a.child:
        _child(a.budget, a.bs, a.seed, a.calls, a.graph)
        return 0
    env = dict(os.environ, KDT_TREE_BUILD=a.algo)
    cmd = [sys.executable, "-m", "bench.tree_profile", "--child", "--budget", str(a.budget),
           "--bs", str(a.bs), "--seed", str(a.seed), "--calls", str(a.calls)]
    cmd += ["--graph"] if a.graph else []
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                           check=False)
    except subprocess.TimeoutExpired:
        print("tree_profile: the profiled build did not finish in 600 s", file=sys.stderr)
        return 1
    if r.returncode != 0:
        print(f"tree_profile: the profiled build failed (exit {r.returncode}):\n"
              f"{r.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    try:
        blocks = parse(r.stdout)
    except ValueError as e:
        print(f"tree_profile: {e}", file=sys.stderr)
        return 1
    print(f"budget {a.budget}, bs {a.bs}, seed {a.seed}, {a.algo} build, "
          f"{'a CUDA graph replayed' if a.graph else 'launched one by one'}")
    print(summary(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
