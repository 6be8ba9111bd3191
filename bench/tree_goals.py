"""Issue 15's goals for the tree kernels on CUDA, checked in one short run (about a minute):
each case validated against the reference, then timed as the kernel alone (a CUDA graph of 20
calls / 20) and as one call between events; the native CPU backend beside it. Prints one line per
case and PASS / FAIL per goal; exits 1 on a wrong tree or a missed goal. Builds: KDT_TREE_BUILD
auto (the default, which the goals judge), parallel, warp, and serial (budgets <= 255); accepts: KDT_TREE_ACCEPT parallel (the CUDA
default, judged) and walk.

    KDTREE_LIB=build/h200/libkdtree.so python3 -m bench.tree_goals
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.tree_goals",
                                 description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.tree_goals: the goals are CUDA timings, and torch reports no CUDA device "
              "here: run it on the GPU host (KDTREE_LIB=<a CUDA build> python3 -m "
              "bench.tree_goals)", file=sys.stderr)
        return 2
    from bench.inputs import accept_target, tree_inputs
    from bench.native_calls import prepare_tree_accept, prepare_tree_build
    from bench.timing import summarize, time_cpu, time_cuda, time_cuda_graph
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
            cpu = summarize(time_cpu(c.run, reps=20))["median"] * 1e6
            us[("cpu", bs, budget)] = cpu
            print(f"build  cpu      bs {bs:3d} budget {budget:4d}: {cpu:8.1f} us", flush=True)
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
    goals = [
        ("build bs 64 budget 63 <= 10 us", us.get(("build", "auto", 64, 63), 1e9) <= 10),
        ("build bs 64 budget 1023 <= 60 us", us.get(("build", "auto", 64, 1023), 1e9) <= 60),
        ("build bs 1 no slower than bs 64 (+5 %)",
         all(us.get(("build", "auto", 1, b), 1e9) <= 1.05 * us.get(("build", "auto", 64, b), 0)
             for b in (15, 63, 255, 1023))),
        ("build CUDA (alone) faster than the CPU backend at every case",
         all(us.get(("build", "auto", bs, b), 1e9) < us.get(("cpu", bs, b), 0)
             for bs in (1, 4, 64) for b in (15, 63, 255, 1023))),
        ("accept bs 64 budget 255 <= 4 us", us.get(("accept", "parallel", 64, 255), 1e9) <= 4),
    ]
    for e in bad:
        print(f"FAIL validation: {e}")
    for name, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'} goal: {name}")
    return 1 if bad or not all(ok for _, ok in goals) else 0


if __name__ == "__main__":
    sys.exit(main())
