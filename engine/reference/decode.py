"""Greedy decoding on the reference model: plain AR, and DDTree rounds (DDTREE.md section 1).

The golden for the native engine's `generate`: both modes must produce the same tokens, DDTree
with far fewer target forwards. One request at a time (batch 1), float64 throughout.

    result = generate(model, prompt_ids, 64, mode="ddtree", budget=15, drafter=drafter)
    result.tokens        # int64 [64], the new tokens
    result.stats         # target_forwards (prefill included), rounds, accept_lengths per round

    python -m engine.cli.decode --weights DIR [--drafter block|oracle:0.8] [--budget 63]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.reference.model import Model


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
    from engine.reference import ddtree  # lazily: another area's module

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
                           "on a tree built by engine.reference.ddtree (a bug)")
    length = int(acc.accept_len[0])
    path = acc.accept_index[0, :length].astype(np.int64)
    cache.compact(P, path)
    stats.accept_lengths.append(length)
    return tree.tokens[0, path].tolist(), int(acc.bonus[0]), hidden[path]
