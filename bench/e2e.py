"""Suite `e2e`: end-to-end greedy decoding on the native engine, AR vs DDTree, per backend.

For each device in ctx.devices, each batch size and each case below, `Engine.generate` decodes
`new_tokens` tokens for every prompt (prompts split into batches decoded together); a sample is
the wall-clock time of decoding all prompts once (prefill included; every round ends with its one
synchronisation, so the host clock is the device time too). Each case also records its rounds
(mean ms per round, each a whole CUDA graph on CUDA) and where a round's time goes per phase
(draft, tree, verify, accept, commit, copy: round.PHASES), from a second, profiled engine.

Cases: AR; DDTree at budgets {15, 63, 255} x drafters: the noisy ORACLE at several qualities
(handed the true greedy continuation, built before timing) and the block drafter: by default
`block:trained` (trained once per weights digest and training settings, on the run's device, and
cached beside the weights: bench/weights.trained_drafter_weights; --quick trains less) and
`block:random` (the seeded untrained one, a cheap floor: tau about 1); with a `weights` option,
`block`, the drafter stored in that folder as it is. Validation before timing: every DDTree
case's tokens must equal the AR tokens of the same device, and the AR tokens of every device
must equal the CPU's.

Derived rates (formula beside each):
  tokens_per_s            = new tokens of all prompts / median(samples)
  target_forwards_per_token = (prefill + decode target forwards, batched) x batch / new tokens
  mean_accept_length      = mean over requests and rounds of accepted nodes (root included)
  speedup_vs_ar           = median(AR samples) / median(samples), same device and batch

Options (ctx.args): `weights` (a folder; default: the tiny model with seed 0 and its block
drafter with seed 1, from the weights cache of bench/weights.py: weights are inputs and never
land in the run folder), and any key of `grid()` (`prompts`, `new_tokens`, `budgets`,
`qualities`, `batches`, `reps`, `block`, `block_random`, `drafter_steps`) to override the
default grid. params["weights"] records the folder, the target's config and the sha256 of every
weights file; params["drafters"] each block drafter used (trained or random, steps, data source,
held-out top-1 accuracy by depth, the target sha256 it is bound to).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import format_table
from bench.timing import summarize, time_cpu

NAME = "e2e"
PROMPT_SEED = 1234  # fixed: runs compare like with like


def grid(quick: bool) -> dict:
    if quick:
        return {"budgets": [15, 63], "qualities": [0.5, 0.9], "batches": [1], "prompts": 2,
                "new_tokens": 32, "reps": 2, "block": True, "block_random": True,
                "drafter_steps": None}
    return {"budgets": [15, 63, 255], "qualities": [0.3, 0.6, 0.8, 0.95], "batches": [1, 8],
            "prompts": 8, "new_tokens": 64, "reps": 3, "block": True, "block_random": True,
            "drafter_steps": None}


def _weights(ctx, g) -> tuple[Path, Path, dict]:
    """(engine weights folder, the target's folder for params, {case name: drafter folder}).

    With a `weights` option: that folder and its stored drafter ("block"). Else the tiny model
    from the cache with its trained drafter ("block:trained", the engine's own) and, when
    g["block_random"], the seeded untrained one ("block:random")."""
    w = ctx.args.get("weights")
    if w:
        return Path(w), Path(w), {"block": Path(w)}
    from bench import weights as bw

    base = bw.tiny_weights()
    if not g["block"]:
        return base, base, {}
    settings = dict(bw.DRAFTER_TRAIN_QUICK if ctx.quick else bw.DRAFTER_TRAIN)
    if g["drafter_steps"]:
        settings["steps"] = int(g["drafter_steps"])
    device = "cuda" if "cuda" in ctx.devices else "cpu"
    trained = bw.trained_drafter_weights(base, settings, device=device)
    out = {"block:trained": trained}
    if g["block_random"]:
        out["block:random"] = base
    return trained, base, out


def _prompts(n: int, vocab: int) -> list:
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(0, vocab, size=int(rng.integers(8, 64))).astype(np.int64)
            for _ in range(n)]


def _batches(prompts, bs):
    return [prompts[i:i + bs] for i in range(0, len(prompts), bs)]


def _decode_all(eng, batches, new_tokens, mode, budget, drafters) -> dict:
    """Every batch decoded once; the merged tokens and engine stats."""
    out = {"tokens": [], "forwards": 0, "accept": [], "rounds": 0, "round_s": 0.0,
           "prefill_s": 0.0, "phase_s": {}}
    for i, b in enumerate(batches):
        r = eng.generate(b, new_tokens, mode=mode, budget=budget,
                         drafter=None if drafters is None else drafters[i])
        out["tokens"].extend(r.tokens)
        out["forwards"] += r.stats.target_forwards * len(b)
        out["accept"].extend(a for req in r.stats.accept_lengths for a in req)
        out["rounds"] += r.stats.rounds
        out["round_s"] += r.stats.round_seconds
        out["prefill_s"] += r.stats.prefill_seconds
        for ph, sec in r.stats.phase_seconds.items():
            out["phase_s"][ph] = out["phase_s"].get(ph, 0.0) + sec
    return out


def _run_case(eng, batches, new_tokens, mode, budget, drafters, reps):
    """Times decoding every batch once per sample; returns (samples, the last sample's
    tokens and merged stats)."""
    last = {}

    def once():
        last.update(_decode_all(eng, batches, new_tokens, mode, budget, drafters))

    samples = time_cpu(once, warmup=1, reps=reps)
    return samples, last


def _phases(peng, batches, new_tokens, mode, budget, drafters) -> dict:
    """Where a round's time goes: one more decode of every batch on the profiled engine (per
    phase: CUDA events around per-phase graphs on CUDA, the monotonic clock on the CPU), in
    milliseconds per round."""
    out = _decode_all(peng, batches, new_tokens, mode, budget, drafters)
    n = max(out["rounds"], 1)
    return {ph: 1e3 * sec / n for ph, sec in out["phase_s"].items()}


def _load_drafter(folder, device):
    """As Engine.block_drafter loads its own: batched torch on the engine's device."""
    from engine.drafters.block import BlockDrafter

    return BlockDrafter.from_dir(folder, backend="torch", device=device)


def run(ctx) -> dict:
    lib = ctx.require_library("suite e2e")
    from engine.native.engine import Engine

    g = grid(ctx.quick)
    for key in g:  # ctx.args may override any grid entry (e.g. from a driver script)
        if key in ctx.args and ctx.args[key] is not None:
            g[key] = ctx.args[key]
    n_prompts, new_tokens = int(g["prompts"]), int(g["new_tokens"])
    weights, target, drafter_dirs = _weights(ctx, g)
    from bench.weights import describe, drafter_record

    params = {"weights": describe(target), "engine_weights": str(weights),
              "drafters": {name: drafter_record(d) for name, d in drafter_dirs.items()},
              "prompts": n_prompts, "new_tokens": new_tokens,
              "prompt_seed": PROMPT_SEED, "budgets": g["budgets"], "oracle_qualities": g["qualities"],
              "batches": g["batches"], "reps": g["reps"], "devices": list(ctx.devices),
              "oracle_depth": 15, "block_drafter": g["block"]}
    results, rows = [], []
    reference_tokens = None  # the CPU AR tokens (or the first device's)
    for device in ctx.devices:
        if device == "cuda" and (not lib.has_cuda or lib.cuda_device_count() == 0):
            results.append({"bench": NAME, "backend": device, "case": "all", "skipped":
                            f"{lib.path} has no CUDA backend or no GPU is visible",
                            "validation": {"ok": True, "skipped": True}})
            continue
        max_seq = 64 + new_tokens + max(g["budgets"]) + 32
        eng = Engine(weights, device=device, max_slots=max(g["batches"]), max_seq=max_seq)
        # The same engine with per-phase timing (per-phase graphs on CUDA): the breakdown only.
        peng = Engine(weights, device=device, max_slots=max(g["batches"]), max_seq=max_seq,
                      profile=True)
        prompts = _prompts(n_prompts, eng.vocab_size)
        n_cases = len(g["batches"]) * (1 + len(g["budgets"]) * (len(g["qualities"]) + len(drafter_dirs)))
        done = 0
        for bs in g["batches"]:
            batches = _batches(prompts, bs)
            samples, ar = _run_case(eng, batches, new_tokens, "ar", 0, None, g["reps"])
            ar_median = float(np.median(samples))
            ok = True
            if reference_tokens is None:
                reference_tokens = [t.tolist() for t in ar["tokens"]]
            else:
                ok = [t.tolist() for t in ar["tokens"]] == reference_tokens
            cases = [("ar", 0, "-", None)]
            # Built (their truth decoded) before timing; prompt j's oracle has seed PROMPT_SEED + j
            # whatever the batch size, so batch sizes compare like with like.
            oracles = {q: [eng.oracle_drafters(b, new_tokens, q, seed=PROMPT_SEED + i * bs)
                           for i, b in enumerate(batches)] for q in g["qualities"]}
            # The engine's own drafter (the one stored with `weights`) is passed as None; another
            # folder's (block:random) as one loaded object per batch, as the engine loads its own.
            blocks = {name: None if d == weights else [_load_drafter(d, device)] * len(batches)
                      for name, d in drafter_dirs.items()}
            for budget in g["budgets"]:
                for q in g["qualities"]:
                    cases.append(("ddtree", budget, f"oracle:{q}", oracles[q]))
                for name, dr in blocks.items():
                    cases.append(("ddtree", budget, name, dr))
            for mode, budget, drafter_name, dr in cases:
                ctx.progress(done, n_cases, f"{device} bs={bs}: next {mode} B={budget} {drafter_name}")
                done += 1
                if mode == "ar":
                    s, out = samples, ar
                    valid = {"ok": ok, "check": "AR tokens == the first device's AR tokens"}
                else:
                    try:
                        s, out = _run_case(eng, batches, new_tokens, mode, budget, dr, g["reps"])
                    except (ImportError, FileNotFoundError, ValueError) as e:
                        results.append({"bench": NAME, "backend": device, "batch": bs,
                                        "case": f"{mode} B={budget} {drafter_name}",
                                        "skipped": f"{type(e).__name__}: {e}",
                                        "validation": {"ok": True, "skipped": True}})
                        continue
                    same = [t.tolist() for t in out["tokens"]] == [t.tolist() for t in ar["tokens"]]
                    valid = {"ok": bool(same), "check": "DDTree tokens == AR tokens (same device)"}
                phases = _phases(peng, batches, new_tokens, mode, budget,
                                 None if mode == "ar" else dr)
                total = len(prompts) * new_tokens
                med = float(np.median(s))
                tau = float(np.mean(out["accept"])) if out["accept"] else 0.0
                rec = {
                    "bench": NAME, "backend": device, "batch": bs, "mode": mode,
                    "budget": budget, "drafter": drafter_name,
                    "case": f"{mode} B={budget} {drafter_name} bs={bs}",
                    "samples": s, "summary": summarize(s),
                    "rates": {
                        "tokens_per_s": total / med,
                        "tokens_per_s_formula": "prompts * new_tokens / median(samples)",
                        "target_forwards_per_token": out["forwards"] / total,
                        "target_forwards_per_token_formula":
                            "sum over batches of target_forwards (prefill included) * batch size"
                            " / (prompts * new_tokens)",
                        "mean_accept_length": tau,
                        "speedup_vs_ar": ar_median / med,
                        "speedup_vs_ar_formula": "median(AR samples) / median(samples)",
                    },
                    # The last sample's rounds (each a whole graph on CUDA, its one sync
                    # included) and prefills; where a round's time goes, per phase, from the
                    # profiled engine (round.PHASES; ms per round).
                    "round": {"rounds": out["rounds"],
                              "round_ms": 1e3 * out["round_s"] / max(out["rounds"], 1),
                              "prefill_s": out["prefill_s"],
                              "phases_ms": phases,
                              "graphs": bool(eng.graphs)},
                    "validation": valid,
                }
                results.append(rec)
                rows.append([device, bs, mode, budget or "-", drafter_name,
                             round(total / med, 1), round(out["forwards"] / total, 3),
                             round(tau, 2), round(ar_median / med, 2),
                             round(1e3 * out["round_s"] / max(out["rounds"], 1), 3),
                             "ok" if valid["ok"] else "MISMATCH"])
        eng.close()
        peng.close()
    table = format_table(["device", "bs", "mode", "B", "drafter", "tok/s", "fwd/tok", "tau",
                          "x AR", "ms/round", "check"], rows)
    return {"params": params, "results": results, "table": table}
