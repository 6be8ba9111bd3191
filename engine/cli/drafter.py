"""python -m engine.cli.drafter train --weights DIR [--steps N] [--device cuda] [--data native]:
train the block drafter briefly on the target's greedy outputs (engine.training.drafter) and
record the run in drafter_config.json."""

from __future__ import annotations

import argparse
import json
import sys

from engine.reference.model import limit_blas_threads
from engine.training.drafter import train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.cli.drafter",
                                 description="Drafters; `train` trains the block drafter briefly.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train DIR's block drafter on the target's greedy outputs")
    t.add_argument("--weights", required=True, help="folder with the target and drafter weights")
    t.add_argument("--steps", type=int, default=800)
    t.add_argument("--sequences", type=int, default=192, help="greedy training sequences")
    t.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per sequence")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:i] (the native "
                   "engine generating the data runs on cuda too when the library has it)")
    t.add_argument("--data", default="auto", choices=("auto", "native", "reference"),
                   help="who generates the greedy training sequences: the native engine, the "
                   "float64 reference model, or auto (native unless libkdtree is missing)")
    args = ap.parse_args(argv)
    limit_blas_threads(1)
    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)  # small matrices: extra threads only spin on a shared machine
    try:
        result = train(args.weights, steps=args.steps, sequences=args.sequences,
                       new_tokens=args.new_tokens, seed=args.seed, device=args.device,
                       data=args.data)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 5
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
