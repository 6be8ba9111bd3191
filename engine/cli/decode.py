"""python -m engine.cli.decode: AR vs DDTree with the float64 reference model (engine.reference)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from engine.drafters.block import BlockDrafter
from engine.drafters.oracle import NoisyOracleDrafter
from engine.reference.decode import generate
from engine.reference.model import Model, ModelFormatError, limit_blas_threads


def main(argv=None) -> int:
    """python -m engine.cli.decode --weights DIR [--drafter block|oracle:Q] [--budget B] ...:
    AR vs DDTree on random prompts; checks the tokens agree and prints acceptance and forwards."""

    ap = argparse.ArgumentParser(prog="python -m engine.cli.decode", description=main.__doc__)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--drafter", default="block", help="'block' or 'oracle:<quality in [0, 1]>'")
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    limit_blas_threads(1)
    try:
        model = Model.from_dir(args.weights)
        block = BlockDrafter.from_dir(args.weights, backend="numpy") \
            if args.drafter == "block" else None
    except (ModelFormatError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 5
    if block is None and not args.drafter.startswith("oracle:"):
        print(f"error: --drafter {args.drafter!r}: expected 'block' or 'oracle:<quality>'",
              file=sys.stderr)
        return 5
    rng = np.random.default_rng(args.seed)
    accept, forwards, t_ar, t_dd = [], 0, 0.0, 0.0
    for i in range(args.prompts):
        prompt = rng.integers(0, model.cfg.vocab_size, int(rng.integers(1, 48)))
        t0 = time.monotonic()
        ar = generate(model, prompt, args.new_tokens)
        t1 = time.monotonic()
        drafter = block or NoisyOracleDrafter(
            np.concatenate([prompt, ar.tokens]), model.cfg.vocab_size, depth=15,
            quality=float(args.drafter.split(":", 1)[1]), seed=args.seed + i)
        dd = generate(model, prompt, args.new_tokens, mode="ddtree", budget=args.budget,
                      drafter=drafter)
        t_ar, t_dd = t_ar + t1 - t0, t_dd + time.monotonic() - t1
        if not (dd.tokens == ar.tokens).all():
            print(f"error: prompt {i}: DDTree output differs from AR at token "
                  f"{int(np.argmax(dd.tokens != ar.tokens))}", file=sys.stderr)
            return 1
        accept.extend(dd.stats.accept_lengths)
        forwards += dd.stats.target_forwards
    print(json.dumps({"drafter": args.drafter, "budget": args.budget, "prompts": args.prompts,
                      "new_tokens": args.new_tokens, "identical_to_ar": True,
                      "mean_accept_length": round(float(np.mean(accept)), 4),
                      "target_forwards_ddtree": forwards,
                      "target_forwards_ar": args.prompts * args.new_tokens,
                      "seconds_ar_float64": round(t_ar, 2), "seconds_ddtree_float64": round(t_dd, 2)},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
