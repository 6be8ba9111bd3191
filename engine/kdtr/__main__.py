"""python -m engine.kdtr generate --out DIR [--quick] [--seed S] | show PATH: the golden bundles."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.kdtr.bundle import KdtrError, load
from engine.kdtr.cases import generate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.kdtr",
                                     description="KDTR bundles for the native tests.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="write the golden cases to DIR/<kernel>/<case>.kdtr")
    gen.add_argument("--out", required=True, help="output folder")
    gen.add_argument("--quick", action="store_true", help="skip the largest cases")
    gen.add_argument("--seed", type=int, default=None, help="RNG seed (default: fresh)")
    show = sub.add_parser("show", help="print a bundle's metadata and tensors")
    show.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "generate":
            index = generate(Path(args.out), quick=args.quick, seed=args.seed)
            print(f"wrote {len(index['cases'])} bundles to {args.out} (seed {index['seed']})")
        else:
            tensors, meta = load(args.path)
            print(json.dumps(meta, sort_keys=True))
            for name, t in sorted(tensors.items()):
                print(f"  {name}: {str(t.dtype).replace('torch.', '')} {list(t.shape)}")
    except KdtrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main())
