"""Issue 15's goals for the tree kernels on CUDA, checked in one short run (about a minute):
each case validated against the reference, then timed as the kernel alone (a CUDA graph of 20
calls / 20) and as one call between events; the native CPU backend beside it. Prints one line per
case and PASS / FAIL per goal; exits 1 on a wrong tree or a missed goal. Builds: KDT_TREE_BUILD
auto (the default, which the goals judge), parallel, warp, and serial (budgets <= 255); accepts:
KDT_TREE_ACCEPT parallel (the CUDA default, judged) and walk.

    KDTREE_LIB=build/h200/libkdtree.so python3 -m bench.tree_goals

With --run DIR it judges the same goals on a fetched benchmark run instead (no GPU, no torch):
each of the run's kernels.json and tree_build.json on its own, from the kernel-alone medians of
the default build (auto) and the CPU backend's calls, over every bs and budget the suite has.
The CPU figure is its fast state where the record has one (`cpu_states`: the median of the runs
of calls back to back that are within 1.25x of the fastest, those runs taken again between the
suite's later cases since runs of 2026-12-06: bench/timing.py CpuStateRounds), else its median:
the host toggles the CPU call between two speeds ~1.8x apart, for seconds at a time, and the goal
"CUDA faster" is judged against the faster. A tree_build
suite that timed more draws of the first goal's case, and the graph floor, has them printed under
its goals (not judged: the goals are the suite's grid).

    python3 -m bench.tree_goals --run results/h200/<run>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# The goals' cases: (bs, budget) of the two bounds and the accept, and the +5 % that "bs 1 no
# slower than bs 64" allows for timing noise.
BUILD_SMALL, BUILD_LARGE, ACCEPT = (64, 63), (64, 1023), (64, 255)
BS1_SLACK = 1.05


class RunError(ValueError):
    """A run folder or one of its suite files that cannot be judged (the message says why)."""


def suite_times(doc: dict, suite: str) -> dict:
    """Medians in us from one suite's JSON: ("gpu", bs, budget) the default build's kernel alone,
    ("cpu", bs, budget) the CPU backend's call (its fast state where the record has
    `cpu_states`), ("accept", bs, budget) the accept's kernel alone. RunError names what is
    malformed."""
    out = {}
    rows = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise RunError(f"{suite}.json: no 'results' list")
    for i, x in enumerate(rows):
        try:
            case, bench, backend = x["case"], x["bench"], x["backend"]
            if suite == "kernels":  # its other kernels (the verify attention) are not judged
                kind = {("tree_build", "cuda"): "gpu" if case.get("algo") == "auto" else None,
                        ("tree_build", "cpu"): "cpu",
                        ("tree_accept", "cuda"): "accept"}.get((bench, backend))
            else:
                kind = {"native-cuda": "gpu", "native-cpu": "cpu"}.get(backend)
            if kind is None:
                continue
            key = (int(case["bs"]), int(case["budget"]))
            if kind == "cpu" and "cpu_states" in x:
                t = x["cpu_states"]["fast"]
            else:
                t = (x["summary"] if kind == "cpu" else x["kernel_alone"]["summary"])["median"]
            out[(kind,) + key] = float(t) * 1e6
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise RunError(f"{suite}.json: result {i} is malformed ({type(e).__name__}: {e})") \
                from None
    return out


def judge(us: dict) -> list[tuple[str, str, bool]]:
    """The goals on one suite's medians: (goal, the figures behind it, met). A case the suite
    lacks fails its goal, named as missing."""
    def at(kind, key):
        return us.get((kind,) + key)

    goals = []
    for key, limit in ((BUILD_SMALL, 10.0), (BUILD_LARGE, 60.0)):
        v = at("gpu", key)
        goals.append((f"build bs {key[0]} budget {key[1]} <= {limit:g} us",
                      "missing" if v is None else f"{v:.2f} us", v is not None and v <= limit))
    budgets = sorted({b for k, bs, b in us if k == "gpu" and bs == 1 and ("gpu", 64, b) in us})
    slower = [b for b in budgets if us[("gpu", 1, b)] > BS1_SLACK * us[("gpu", 64, b)]]
    goals.append(("build bs 1 no slower than bs 64 (+5 %)",
                  " / ".join(f"{us[('gpu', 1, b)]:.2f} vs {us[('gpu', 64, b)]:.2f}"
                             for b in budgets) + f" us at budgets {budgets}" if budgets
                  else "missing", bool(budgets) and not slower))
    cells = sorted((bs, b) for k, bs, b in us if k == "gpu" and ("cpu", bs, b) in us)
    lose = [c for c in cells if us[("cpu",) + c] < us[("gpu",) + c]]
    goals.append(("build CUDA (alone) faster than the CPU backend at every case",
                  f"CPU faster at {len(lose)} of {len(cells)}" + "".join(
                      f"; bs {c[0]} budget {c[1]}: {us[('cpu',) + c]:.2f} vs "
                      f"{us[('gpu',) + c]:.2f} us" for c in lose) if cells else "missing",
                  bool(cells) and not lose))
    if any(k == "accept" for k, _, _ in us):
        v = at("accept", ACCEPT)
        goals.append((f"accept bs {ACCEPT[0]} budget {ACCEPT[1]} <= 4 us",
                      "missing" if v is None else f"{v:.2f} us", v is not None and v <= 4.0))
    return goals


def spread(doc: dict) -> list[str]:
    """The lines a tree_build suite adds beside the goals (bench/tree_build.py: its more draws
    of the first goal's case, and the graph floor), or none; not judged. RunError names what is
    malformed."""
    from bench.tree_build import extras

    params = doc.get("params") if isinstance(doc, dict) else None
    if not isinstance(params, dict):
        return []
    try:
        d = params.get("draws")
        key = (int(d["bs"]), int(d["budget"])) if d else None
        text = extras(params, 10.0 if key == BUILD_SMALL else None)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise RunError(f"tree_build.json: params' draws or graph_floor is malformed "
                       f"({type(e).__name__}: {e})") from None
    return ["  " + line for line in text.splitlines()]


def judged_times(us: dict) -> dict:
    """The live run's medians (("build", algo, bs, budget), ("accept", algo, bs, budget), ("cpu",
    bs, budget)) in judge's keys: the default build (auto) and accept (parallel), and the CPU."""
    out = {("cpu",) + k[1:]: v for k, v in us.items() if k[0] == "cpu"}
    for (kind, algo), to in ((("build", "auto"), "gpu"), (("accept", "parallel"), "accept")):
        out.update({(to,) + k[2:]: v for k, v in us.items() if k[:2] == (kind, algo)})
    return out


def judge_run(run: Path, out=print) -> int:
    """Prints each suite's goals for a fetched run; 0 all met, 1 one missed, 2 a bad run."""
    if not run.is_dir():
        print(f"bench.tree_goals: --run {run}: no such folder", file=sys.stderr)
        return 2
    missed = False
    found = 0
    try:
        for suite in ("kernels", "tree_build"):
            path = run / f"{suite}.json"
            if not path.is_file():
                continue
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise RunError(f"{suite}.json: not readable JSON ({e})") from None
            found += 1
            out(f"{run.name}: {suite} suite")
            for name, figures, ok in judge(suite_times(doc, suite)):
                missed |= not ok
                out(f"  {'PASS' if ok else 'FAIL'} {name}: {figures}")
            for line in spread(doc) if suite == "tree_build" else ():
                out(line)
    except RunError as e:
        print(f"bench.tree_goals: --run {run}: {e}", file=sys.stderr)
        return 2
    if not found:
        print(f"bench.tree_goals: --run {run}: neither kernels.json nor tree_build.json is there "
              "(a benchmark run of the kernels or tree_build suite)", file=sys.stderr)
        return 2
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.tree_goals",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, metavar="DIR",
                    help="judge a fetched run's kernels and tree_build suites instead")
    a = ap.parse_args(argv)
    if a.run is not None:
        return judge_run(a.run)
    import torch

    if not torch.cuda.is_available():
        print("bench.tree_goals: the goals are CUDA timings, and torch reports no CUDA device "
              "here: run it on the GPU host (KDTREE_LIB=<a CUDA build> python3 -m "
              "bench.tree_goals)", file=sys.stderr)
        return 2
    from bench.inputs import accept_target, tree_inputs
    from bench.native_calls import prepare_tree_accept, prepare_tree_build
    from bench.timing import CpuStateRounds, cpu_states, summarize, time_cuda, time_cuda_graph
    from bench.tree_algo import env, side_stream, tree_algo
    from bench.validate import ACCEPT_FIELDS, TREE_FIELDS, check_exact
    from engine.native import library
    from engine.reference import ddtree

    lib = library()
    if not lib.has_cuda:
        print(f"bench.tree_goals: {lib.path} is a CPU-only build: set KDTREE_LIB to a CUDA "
              "build", file=sys.stderr)
        return 2
    rng = np.random.default_rng(15)
    us = {}
    bad = []
    cpu_recs = {}  # (bs, budget): the CPU call's record, its states measured again by rounds
    rounds = CpuStateRounds()
    for bs in (1, 4, 64):
        for budget in (15, 63, 255, 1023):
            inp = tree_inputs(rng, bs, 15, min(budget, 64))
            ref = ddtree.build_tree(inp["top_logp"], inp["top_ids"], budget, inp["root_ids"],
                                    inp["seq_lens"])
            for algo in ("auto", "parallel", "warp") + (("serial",) if budget <= 255 else ()):
                with side_stream("cuda"), tree_algo(algo):
                    p = prepare_tree_build(lib, "cuda", inp, budget)
                    p.run()
                    torch.cuda.synchronize()
                    v = check_exact(p.outputs, ref, TREE_FIELDS)
                    if not v["ok"]:
                        bad.append(f"build {algo} bs {bs} budget {budget}: {v.get('error')}")
                        continue
                    alone = summarize(time_cuda_graph(p.run))["median"] * 1e6
                    call = summarize(time_cuda(p.run, flush_l2=False, reps=50))["median"] * 1e6
                us[("build", algo, bs, budget)] = alone
                print(f"build  {algo:8s} bs {bs:3d} budget {budget:4d}: alone {alone:8.1f} us, "
                      f"one call {call:8.1f} us", flush=True)
            c = prepare_tree_build(lib, "cpu", inp, budget)
            cpu_recs[(bs, budget)] = rec = {"cpu_states": cpu_states(c.run)}
            rounds.track(c.run, rec, keep=c)
            print(f"build  cpu      bs {bs:3d} budget {budget:4d}: "
                  f"{rec['cpu_states']['fast'] * 1e6:8.1f} us (fast state; again after later "
                  "cases)", flush=True)
            tree = ref
            target = accept_target(rng, tree)
            # KDT_TREE_ACCEPT: "parallel" (the default on CUDA) and "walk"
            for acc in ("parallel", "walk"):
                with side_stream("cuda"), env("KDT_TREE_ACCEPT", acc):
                    a = prepare_tree_accept(lib, "cuda", tree, target)
                    a.run()
                    torch.cuda.synchronize()
                    v = check_exact(a.outputs, ddtree.accept_greedy(tree, target), ACCEPT_FIELDS)
                    if not v["ok"]:
                        bad.append(f"accept {acc} bs {bs} budget {budget}: {v.get('error')}")
                        continue
                    alone = summarize(time_cuda_graph(a.run))["median"] * 1e6
                    call = summarize(time_cuda(a.run, flush_l2=False, reps=50))["median"] * 1e6
                us[("accept", acc, bs, budget)] = alone
                print(f"accept {acc:8s} bs {bs:3d} budget {budget:4d}: alone {alone:8.1f} us, "
                      f"one call {call:8.1f} us", flush=True)
            rounds.round()
    # The same goals as --run judges (a case that failed validation is missing there, and the
    # exit code says so through `bad`).
    for (bs, budget), rec in cpu_recs.items():
        st = rec["cpu_states"]
        us[("cpu", bs, budget)] = st["fast"] * 1e6
        print(f"build  cpu      bs {bs:3d} budget {budget:4d}: {st['fast'] * 1e6:8.1f} us (fast "
              f"state, {st.get('rounds', 1)} rounds over {st.get('span_s', 0.0):.0f} s)")
    goals = judge(judged_times(us))
    for e in bad:
        print(f"FAIL validation: {e}")
    for name, figures, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'} goal: {name}: {figures}")
    return 1 if bad or not all(ok for _, _, ok in goals) else 0


if __name__ == "__main__":
    sys.exit(main())
