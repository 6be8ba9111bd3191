"""Greedy decoding on the reference model: plain AR, and DDTree rounds (DDTREE.md section 1).

The golden for the native engine's `generate`: both modes must produce the same tokens, DDTree
with far fewer target forwards. One request at a time (batch 1), float64 throughout.

    result = generate(model, prompt_ids, 64, mode="ddtree", budget=15, drafter=drafter)
    result.tokens        # int64 [64], the new tokens
    result.stats         # target_forwards (prefill included), rounds, accept_lengths per round

    python -m engine.model_decode --weights DIR [--drafter block|oracle:0.8] [--budget 63]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.model import Model


@dataclasses.dataclass
class DecodeStats:
    mode: str
    target_forwards: int = 0  # forward passes of the target, the prefill included
    rounds: int = 0  # DDTree rounds (AR: decode steps after the prefill)
    accept_lengths: list = dataclasses.field(default_factory=list)  # per round, root included
    tree_sizes: list = dataclasses.field(default_factory=list)  # verified nodes per round

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0


@dataclasses.dataclass
class GenerateResult:
    tokens: np.ndarray  # int64 [max_new_tokens]
    stats: DecodeStats


def generate(model: Model, prompt_ids, max_new_tokens: int, mode: str = "ar", budget: int = 15,
             drafter=None, topk: int | None = None) -> GenerateResult:
    """Greedy decode of max_new_tokens new tokens after prompt_ids (int [P0], P0 >= 1).

    mode "ddtree" needs a drafter (engine.drafters interface); K = topk or min(budget, vocab).
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if len(prompt) < 1:
        raise ValueError("generate: prompt_ids is empty (need at least one token)")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens = {max_new_tokens}, need >= 1")
    if mode not in ("ar", "ddtree"):
        raise ValueError(f"generate: mode = {mode!r}, expected 'ar' or 'ddtree'")
    if mode == "ddtree" and drafter is None:
        raise ValueError("generate: mode 'ddtree' needs a drafter (engine.drafters)")
    cache = model.new_cache(len(prompt) + max_new_tokens + budget + 1)
    stats = DecodeStats(mode)
    logits, hidden = model.forward(prompt, np.arange(len(prompt)), cache)
    stats.target_forwards += 1
    out = [int(np.argmax(logits[-1]))]
    if mode == "ar":
        while len(out) < max_new_tokens:
            logits, _ = model.forward([out[-1]], [cache.length], cache)
            stats.target_forwards += 1
            stats.rounds += 1
            stats.accept_lengths.append(1)
            out.append(int(np.argmax(logits[-1])))
    else:
        k = topk if topk is not None else min(budget, model.cfg.vocab_size)
        committed = list(prompt)
        hidden_ctx = hidden  # [P, D]: row j is the state at position j (it predicted token j+1)
        while len(out) < max_new_tokens:
            root = out[-1]
            accepted, bonus, hid = ddtree_round(model, cache, np.array(committed, np.int64), root,
                                                hidden_ctx, drafter, budget, k, stats)
            committed.extend(accepted)
            hidden_ctx = np.concatenate([hidden_ctx, hid])
            out.extend(accepted[1:])
            out.append(bonus)
    return GenerateResult(np.array(out[:max_new_tokens], dtype=np.int64), stats)


def ddtree_round(model: Model, cache, committed: np.ndarray, root: int, hidden_ctx: np.ndarray,
                 drafter, budget: int, k: int, stats: DecodeStats):
    """One round: draft, build the tree, verify it in one forward, accept, compact the cache.

    Returns (accepted tokens, root first; the bonus token; the target's hidden states at the
    accepted nodes [len, D]). The cache's committed length grows by len(accepted).
    """
    from engine import ddtree  # lazily: another area's module

    P = cache.length
    if P != len(committed):
        raise RuntimeError(f"ddtree_round: cache length {P} != committed tokens {len(committed)}")
    top_logp, top_ids = drafter.draft(committed, root, hidden_ctx, k)
    tree = ddtree.build_tree(np.asarray(top_logp, np.float32)[None], np.asarray(top_ids, np.int64)[None],
                             budget, np.array([root], np.int64), np.array([P], np.int64))
    nn = int(tree.num_nodes[0])
    vis = ddtree.unpack_visibility(tree)[0, :nn, :nn]
    logits, hidden = model.forward(tree.tokens[0, :nn], tree.positions[0, :nn], cache, vis)
    stats.target_forwards += 1
    stats.rounds += 1
    stats.tree_sizes.append(nn)
    target_argmax = np.full((1, tree.tokens.shape[1]), -1, np.int64)
    target_argmax[0, :nn] = np.argmax(logits, axis=-1)
    acc = ddtree.accept_greedy(tree, target_argmax)
    if acc.status[0] != ddtree.ACCEPT_OK:
        raise RuntimeError(f"ddtree_round: accept walk reported status {int(acc.status[0])} "
                           "on a tree built by engine.ddtree (a bug)")
    length = int(acc.accept_len[0])
    path = acc.accept_index[0, :length].astype(np.int64)
    cache.compact(P, path)
    stats.accept_lengths.append(length)
    return tree.tokens[0, path].tolist(), int(acc.bonus[0]), hidden[path]


def main(argv=None) -> int:
    """python -m engine.model_decode --weights DIR [--drafter block|oracle:Q] [--budget B] ...:
    AR vs DDTree on random prompts; checks the tokens agree and prints acceptance and forwards."""
    import argparse
    import json
    import sys
    import time

    from engine.model import ModelFormatError, limit_blas_threads

    ap = argparse.ArgumentParser(prog="python -m engine.model_decode", description=main.__doc__)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--drafter", default="block", help="'block' or 'oracle:<quality in [0, 1]>'")
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    limit_blas_threads(1)
    from engine import drafters

    try:
        model = Model.from_dir(args.weights)
        block = drafters.load_block_drafter(args.weights, backend="numpy") \
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
        drafter = block or drafters.NoisyOracleDrafter(
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
