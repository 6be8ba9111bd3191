"""python -m engine.cli.model init|check|train: write a target's (and its block drafter's) weights,
print a model's logit spread and greedy diversity, or train the code-small target on real text.

    python -m engine.cli.model init [--config FILE] [--seed N] [--no-drafter] --out DIR
    python -m engine.cli.model check --weights DIR
    python -m engine.cli.model train --out DIR --device cuda|cpu [--corpus DIR] [--minutes M]
                                     [--seed S] [--config small|toy] [--steps N]

`train` (engine.training.code_model; docs/TRAINING.md): tokenizer, target, block drafter and
train.json in DIR, within --minutes (default 3 for small) plus the evaluations.

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
    t = sub.add_parser("train", help="train the code-small target (tokenizer, target, drafter) "
                       "on the stdlib's sources into DIR")
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:i]")
    t.add_argument("--corpus", help="folder of *.py files (default: this Python's stdlib)")
    t.add_argument("--minutes", type=float, help="the whole budget (default: the config's)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--config", default="small", choices=("small", "toy"))
    t.add_argument("--steps", type=int, help="at most this many target steps (default: the time "
                   "budget alone)")
    args = ap.parse_args(argv)
    limit_blas_threads(1)
    try:
        if args.cmd == "train":
            return _train(args)
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


def _train(args) -> int:
    from engine.training.code_model import train_code_model

    try:
        r = train_code_model(args.out, device=args.device, corpus=args.corpus,
                             minutes=args.minutes, seed=args.seed, config=args.config,
                             steps=args.steps)
    except (ValueError, ImportError) as e:
        print(f"error: train: {e}", file=sys.stderr)
        return 5
    tg, tau, sec = r["target"], r["tau"], r["seconds"]
    print(f"parameters        {r['parameters']:,} ({r['active_parameters']:,} active per token)")
    print(f"corpus            {r['corpus']['files']} files, digest {r['corpus']['digest'][:16]}, "
          f"{r['tokenizer']['train_tokens']:,} training tokens")
    print(f"target            {tg['steps']} steps, {tg['tokens_seen']:,} tokens "
          f"({tg['epochs']} epochs), {tg['tokens_per_second']:,.0f} tokens/s, {tg['seconds']} s "
          f"on {r['device_name']}")
    print(f"loss (nats/token) train {tg['train_loss']:.4f}  held-out {tg['heldout_loss']:.4f}  "
          f"unigram held-out {tg['unigram_heldout_loss']:.4f}")
    d = r["drafter"]
    print(f"drafter           {d['steps']} steps, {d['sequences']} sequences ({d['data_source']}), "
          f"held-out top-1 by depth {d['held_out_top1_by_depth'][:4]}")
    print("tau               " + (f"{tau['tau']:.3f} at budget {tau['budget']} ({tau['prompts']} "
                                  f"held-out prompts, {tau['device']}; DDTree == AR: "
                                  f"{tau['same_tokens']})" if "tau" in tau else
                                  f"skipped: {tau['skipped']}"))
    print(f"seconds           {json.dumps(sec)}")
    print(f"wrote             {Path(args.out).resolve()} (train.json has the record)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
