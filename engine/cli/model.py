"""python -m engine.cli.model init|check: write a target's (and its block drafter's) weights, or
print a model's logit spread and greedy diversity.

    python -m engine.cli.model init [--config FILE] [--seed N] [--no-drafter] --out DIR
    python -m engine.cli.model check --weights DIR

A command, not part of the reference: `init` writes the drafter too (engine.drafters).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.drafters.block import init_block_drafter
from engine.reference.model import (CONFIG_FILE, WEIGHTS_FILE, Model, ModelFormatError, check,
                                    init_weights, limit_blas_threads, load_config, save_weights,
                                    tiny_config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.cli.model", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("init", help="write config.json + model.safetensors (+ the drafter) to DIR")
    a.add_argument("--config", help="a config.json to use instead of the tiny default")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", required=True)
    a.add_argument("--no-drafter", action="store_true", help="skip the block drafter's weights")
    c = sub.add_parser("check", help="print logit spread and greedy diversity of DIR's model")
    c.add_argument("--weights", required=True)
    args = ap.parse_args(argv)
    limit_blas_threads(1)
    try:
        if args.cmd == "init":
            cfg = load_config(args.config) if args.config else tiny_config()
            save_weights(args.out, cfg, init_weights(cfg, args.seed))
            print(f"wrote {Path(args.out) / CONFIG_FILE} and {Path(args.out) / WEIGHTS_FILE}")
            if not args.no_drafter:
                paths = init_block_drafter(args.out, seed=args.seed + 1)
                print("wrote " + " and ".join(str(p) for p in paths))
        else:
            print(json.dumps(check(Model.from_dir(args.weights)), indent=2))
    except (ModelFormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main())
