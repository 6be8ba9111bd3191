"""Two builds of libkdtree (or more) side by side on the same requests: the tree build timed for
each in one process, in rounds (A, B, then B, A: each library leads a round in turn), so that a
kernel change is measured against its base on identical inputs and under the same clocks (the
suites draw fresh inputs every run, and a batch takes as long as its slowest request, so two
runs compare poorly even at bs 64). Every case is first checked bit for bit against the
reference, for every library. Resolution: two libraries whose build kernel has the same SASS
(the rest of the library changed) measured 0.955-0.965x at bs 1, budget 1 and 1.01x at budget 15
on the H200, in both seeds, whichever led the rounds: a library's own offset of a few percent
for kernels of 2-5 us, so that a change there needs more than that, and a control beside it.

    python3 -m bench.tree_ab build/base/libkdtree.so build/new/libkdtree.so [build/new2/...]
        [--device cuda|cpu] [--cases 64:1023,1:1023,64:255,64:63,1:63,64:15,1:15]
        [--rounds 2] [--seed 15 | --draw-from RUN] [--algo auto] [--timing alone|call]
        [--after-torch]

CUDA times the kernel alone (a CUDA graph of 20 calls / 20, bench.timing.time_cuda_graph), or
with --timing call one call from Python between events as the kernels suite times it (no L2
flush, the launch included); the CPU the bare call. --after-torch puts a one-element torch
kernel before each call on the same stream, so that the kernel before the build is not one of
ours (as a torch drafter's top-k would be) and PDL's edge follows a kernel that never
triggers; both figures of a case then include that kernel. --draw-from RUN takes each case's
requests from a kernels-suite run folder instead (the seed its kernels.json records for that bs,
budget and --device, drawn again as the suite draws them), so that both builds run on the requests
behind that run's figures. Prints one line per case: each library's median (the median over the
rounds of each round's median), then each later one's ratio to A (B / A, C / A, ...). Several
changes against one base in one call time the base once a round, not once a comparison. Exits 1
on a wrong tree, 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

DEFAULT_CASES = "64:1023,1:1023,64:255,1:255,64:63,1:63,64:15,1:15"


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'bs:budget,bs:budget,...' -> [(bs, budget), ...]; ValueError naming the bad item."""
    cases = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            bs, budget = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"--cases: '{item}' is not bs:budget (two integers)") from None
        if not (1 <= bs <= 4096 and 1 <= budget <= 1024):
            raise ValueError(f"--cases: '{item}': bs must be in 1..4096 and budget in 1..1024")
        cases.append((bs, budget))
    return cases


def _inputs(seed: int, bs: int, budget: int) -> dict:
    # One generator per case, so that a case's requests do not depend on the list's order.
    return drawn_inputs([seed, bs, budget], bs, budget)


def run_seeds(run: Path, backend: str) -> dict:
    """{(bs, budget): seed} of one backend's tree cases in a kernels-suite run folder (its
    kernels.json): the suite draws each backend's requests with a seed of its own, so a CUDA
    comparison takes the CUDA rows' seeds. ValueError naming what is unreadable, malformed or
    contradictory."""
    f = Path(run) / "kernels.json"
    try:
        doc = json.loads(f.read_text())
    except OSError as e:
        raise ValueError(f"--draw-from: cannot read {f} ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--draw-from: {f} is not JSON ({e})") from None
    rows = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"--draw-from: {f} has no 'results' list")
    seeds = {}
    for i, x in enumerate(rows):
        if not isinstance(x, dict) or x.get("bench") != "tree_build" \
                or x.get("backend") != backend:
            continue
        try:
            key = (int(x["case"]["bs"]), int(x["case"]["budget"]))
            seed = x["seed"]
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ValueError(f"seed {seed!r} is not a non-negative integer")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--draw-from: {f}: result {i} has no usable case and seed "
                             f"({type(e).__name__}: {e})") from None
        if seeds.setdefault(key, seed) != seed:
            raise ValueError(f"--draw-from: {f}: {backend} bs {key[0]} budget {key[1]} has two "
                             f"seeds ({seeds[key]} and {seed})")
    return seeds


def drawn_inputs(seed: int | list[int], bs: int, budget: int) -> dict:
    """The requests the kernels suite draws for a tree case from this seed (default_rng's)."""
    from bench.kernels import tree_case_inputs

    return tree_case_inputs(np.random.default_rng(seed), bs, budget)


def compare(libs, device: str, cases, rounds: int, seed: int, algo: str, out=print,
            timing: str = "alone", after_torch: bool = False, seeds: dict | None = None) -> bool:
    """Times every case for each library (rounds of A, B, ..., rotated); prints a line per case;
    returns False when a library builds a wrong tree (that case is then not timed). seeds
    (run_seeds): each case's requests are a run's (drawn_inputs), else drawn from seed."""
    from bench.native_calls import prepare_tree_build
    from bench.timing import summarize, time_cpu, time_cuda, time_cuda_graph
    from bench.tree_algo import side_stream, tree_algo
    from bench.validate import TREE_FIELDS, check_exact
    from engine.reference import ddtree

    ok = True
    names = [chr(ord("A") + i) for i in range(len(libs))]
    head = "".join(f" {n + ' us':>9}" for n in names) + "".join(f" {n + ' / A':>7}"
                                                               for n in names[1:])
    which = ", ".join(f"{n} {lib.path}" for n, lib in zip(names, libs))
    out(f"{'case':>16}{head}   ({which})")
    for bs, budget in cases:
        inp = _inputs(seed, bs, budget) if seeds is None else drawn_inputs(seeds[(bs, budget)],
                                                                           bs, budget)
        ref = ddtree.build_tree(inp["top_logp"], inp["top_ids"], budget, inp["root_ids"],
                                inp["seq_lens"])
        with side_stream(device), tree_algo(algo):
            calls = [prepare_tree_build(lib, device, inp, budget) for lib in libs]
            bad = []
            for name, p in zip(names, calls):
                p.run()
                if device == "cuda":
                    import torch

                    torch.cuda.synchronize()
                v = check_exact(p.outputs, ref, TREE_FIELDS)
                if not v["ok"]:
                    bad.append(f"{name}: {v.get('error')}")
            if bad:
                ok = False
                out(f"FAIL bs {bs} budget {budget}: wrong tree: {'; '.join(bad)}")
                continue
            fns = [p.run for p in calls]
            if after_torch:
                import torch

                x = torch.zeros(1, device="cuda")
                fns = [lambda run=run: (x.add_(1), run()) for run in fns]
            medians = tuple([] for _ in libs)
            n = len(libs)
            for r in range(rounds):
                # Round r starts with library r mod n, so that none is always timed first.
                for j in range(n):
                    m, fn = medians[(r + j) % n], fns[(r + j) % n]
                    if device == "cpu":
                        samples = time_cpu(fn, reps=20)
                    elif timing == "call":
                        samples = time_cuda(fn, warmup=3, reps=100, flush_l2=False)
                    else:
                        samples = time_cuda_graph(fn)
                    m.append(summarize(samples)["median"])
        t = [statistics.median(m) * 1e6 for m in medians]
        out(f"{f'bs {bs} B {budget}':>16}" + "".join(f" {x:9.2f}" for x in t)
            + "".join(f" {x / t[0]:7.3f}" for x in t[1:]))
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.tree_ab",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("lib_a", type=Path, help="the base build's libkdtree.so")
    ap.add_argument("lib_b", type=Path, nargs="+",
                    help="the changed builds' libkdtree.so (one or more, each against A)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="bs:budget,... (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds, each timing every library once (default 2)")
    ap.add_argument("--seed", type=int, default=None, help="the requests' seed (default 15)")
    ap.add_argument("--draw-from", type=Path, metavar="RUN",
                    help="a kernels-suite run folder: each case's requests are the run's")
    ap.add_argument("--algo", default="auto", help="KDT_TREE_BUILD for both (default auto)")
    ap.add_argument("--timing", choices=("alone", "call"), default="alone",
                    help="CUDA: the kernel alone (a graph of 20 calls / 20) or one call from "
                         "Python between events (default %(default)s)")
    ap.add_argument("--after-torch", action="store_true",
                    help="CUDA: a one-element torch kernel before each call")
    a = ap.parse_args(argv)
    try:
        cases = parse_cases(a.cases)
    except ValueError as e:
        ap.error(str(e))
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.device == "cpu" and (a.timing != "alone" or a.after_torch):
        ap.error("--timing call and --after-torch are CUDA options (the CPU times the bare call)")
    seeds = None
    if a.draw_from is not None:
        if a.seed is not None:
            ap.error("--seed and --draw-from both choose the requests: give one")
        try:
            seeds = run_seeds(a.draw_from, a.device)
        except ValueError as e:
            ap.error(str(e))
        missing = [f"{bs}:{b}" for bs, b in cases if (bs, b) not in seeds]
        if missing:
            have = ",".join(f"{bs}:{b}" for bs, b in sorted(seeds)) or "none"
            ap.error(f"--draw-from: {a.draw_from} has no {a.device} tree case {', '.join(missing)} "
                     f"(it has {have})")
    paths = [a.lib_a, *a.lib_b]
    for p in paths:
        if not p.is_file():
            ap.error(f"no library at {p}")
    from engine.native._lib import load

    libs = [load(p.resolve()) for p in paths]
    for i in range(len(libs)):
        for j in range(i):
            if libs[i].cdll._handle == libs[j].cdll._handle:
                # the dynamic loader hands back the loaded copy for the same file
                ap.error(f"{paths[j]} and {paths[i]} are one library: give different builds")
    if a.device == "cuda":
        for lib in libs:
            if not lib.has_cuda:
                ap.error(f"{lib.path} is a CPU-only build: use --device cpu, or a CUDA build")
    seed = 15 if a.seed is None else a.seed
    return 0 if compare(libs, a.device, cases, a.rounds, seed, a.algo, timing=a.timing,
                        after_torch=a.after_torch, seeds=seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
