"""Suite `e2e`: end-to-end greedy decoding on the native engine, AR vs DDTree, per target and
backend.

Targets (`models`, bench/models.py): `tiny` (the seeded random test model) and `code-small` (a
small MLA + MoE target trained on the host's Python standard library, trained once per host
into the weights cache; --quick: its seconds-long toy version). For each target, each device in
ctx.devices, each batch size and each case below, `Engine.generate` decodes `new_tokens` tokens
for every prompt (prompts split into batches decoded together); a sample is the wall-clock time
of decoding all prompts once (prefill included; every round ends with its one synchronisation,
so the host clock is the device time too). Each case also records its rounds (mean ms per
round, each a whole CUDA graph on CUDA), the histogram of accept lengths, and where a round's
time goes per phase (draft, tree, verify, accept, commit, copy: round.PHASES), from a second,
profiled engine.

Cases, tiny: AR; DDTree at budgets {15, 63, 255} x drafters: the noisy ORACLE at several
qualities (handed the true greedy continuation, built before timing) and the block drafter: by
default `block:trained` (trained once per weights digest and training settings, on the run's
device, and cached beside the weights: bench/weights.trained_drafter_weights; --quick trains
less) and `block:random` (the seeded untrained one, a cheap floor: tau about 1); with a
`weights` option, `block`, the drafter stored in that folder as it is. Prompts: seeded random
ids. When the run also has a GPU, the CPU backend runs tiny's grid trimmed by `cpu` (one
oracle, no block:random, one rep, no profiled pass: there it is a check and a floor, the GPU
gives the figures and the round breakdown).

Cases, code-small: AR; DDTree at budgets {15, 63, 255} with its trained block drafter
(`block:trained`), at bs 1 and 8; the CPU beside a GPU: budget 15 at bs 8, 32 tokens, one rep
(the check that AR == DDTree there too: a 512-token verify takes seconds on the CPU backend). Prompts: `prompts` of 64-128 tokens cut from the held-out files of
its training split (engine.training.corpus.heldout_prompts, seeded). One sample is kept for the
report: the first prompt and both modes' continuations at budget 63, ids and text (its
tokenizer.json, decoded as the server decodes).

Validation before timing: every DDTree case's tokens must equal the AR tokens of the same device
(a difference makes the record invalid, the suite's status `invalid`, the table say MISMATCH,
and a line on stderr name the prompt and token), and the AR tokens of every device must equal
the first device's (the CPU's).

Derived rates (formula beside each):
  tokens_per_s            = new tokens of all prompts / median(samples)
  target_forwards_per_token = (prefill + decode target forwards, batched) x batch / new tokens
  mean_accept_length      = tau: mean over requests and rounds of accepted tokens per round
                            (the root, i.e. the last round's bonus token, included)
  speedup_vs_ar           = median(AR samples) / median(samples), same target, device and batch

Options (ctx.args): `weights` (a folder; then that target alone, with its stored drafter;
default: the tiny model with seed 0 and its block drafter with seed 1, from the weights cache
of bench/weights.py: weights are inputs and never land in the run folder), and any key of
`grid()` (`models`, `prompts`, `new_tokens`, `budgets`, `qualities`, `batches`, `reps`,
`block`, `block_random`, `drafter_steps`, `profile`, `cpu`, `code_small`: a dict whose keys
merge, an empty one clears) to
override the default grid. params["weights"] records tiny's folder, config and the sha256 of
every weights file; params["drafters"] each block drafter used (trained or random, steps, data
source, held-out top-1 accuracy by depth, the target sha256 it is bound to);
params["code_small"] the same for code-small plus its training record (train.json: corpus
digest, split, steps, tokens, losses), its prompts and the sample.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from bench import format_table
from bench import models as bm
from bench.models import MODELS, check_models
from bench.timing import summarize, time_cpu

NAME = "e2e"
PROMPT_SEED = 1234  # fixed: runs compare like with like


def grid(quick: bool) -> dict:
    """The default grid: tiny's keys at the top (any of them a driver may override through
    ctx.args), `models`, `cpu` (what the CPU backend trims from tiny's grid when the run also has
    a GPU: there the CPU backend is a check and a floor, the GPU gives the figures) and
    `code_small` (code-small's own grid, with its own `cpu` trims)."""
    if quick:
        return {"budgets": [15, 63], "qualities": [0.5, 0.9], "batches": [1], "prompts": 2,
                "new_tokens": 32, "reps": 2, "block": True, "block_random": True,
                "drafter_steps": None, "profile": True, "models": list(MODELS), "cpu": {},
                "code_small": {"budgets": [15, 63], "batches": [1, 2], "prompts": 2,
                               "prompt_tokens": [16, 24], "new_tokens": 16, "reps": 1,
                               "profile": True, "minutes": None, "cpu": {}}}
    return {"budgets": [15, 63, 255], "qualities": [0.3, 0.6, 0.8, 0.95], "batches": [1, 8],
            "prompts": 8, "new_tokens": 64, "reps": 3, "block": True, "block_random": True,
            "drafter_steps": None, "profile": True, "models": list(MODELS),
            "cpu": {"qualities": [0.8], "block_random": False, "reps": 1, "profile": False},
            # code-small on the CPU backend: ~4 s per 512-token verify on a 2-core box, so
            # budget 15 and 32 tokens (DDTree B=63 at bs 8 took 245 s there with tau 1.1)
            "code_small": {"budgets": [15, 63, 255], "batches": [1, 8], "prompts": 8,
                           "prompt_tokens": [64, 128], "new_tokens": 64, "reps": 3,
                           "profile": True, "minutes": None,
                           "cpu": {"budgets": [15], "batches": [8], "reps": 1, "new_tokens": 32,
                                   "profile": False}}}


def _grid(ctx) -> dict:
    """grid() with ctx.args' overrides (dict-valued keys merge: {"code_small": {"reps": 1}};
    an empty dict clears: cpu={} runs the CPU backend's full grid)."""
    g = grid(ctx.quick)
    for key in g:
        v = ctx.args.get(key)
        if v is None:
            continue
        merge = isinstance(g[key], dict) and isinstance(v, dict) and v
        g[key] = {**g[key], **v} if merge else v
    g["models"] = check_models(g["models"])
    # The CPU trims leave alone what the caller chose: a key given explicitly stays as given.
    if ctx.args.get("cpu") is None:
        g["cpu"] = {k: v for k, v in g["cpu"].items() if ctx.args.get(k) is None}
    given = ctx.args.get("code_small") or {}
    if "cpu" not in given:
        g["code_small"]["cpu"] = {k: v for k, v in g["code_small"]["cpu"].items()
                                  if k not in given}
    return g


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


def _targets(ctx, g) -> list:
    """[(Target, prompts, its grid, its CPU trims)] in g["models"] order. With a `weights`
    option: that folder alone, with the drafter stored there ("block")."""
    device = "cuda" if "cuda" in ctx.devices else "cpu"  # where drafters / code-small train
    w = ctx.args.get("weights")
    tiny_grid = {k: g[k] for k in ("budgets", "qualities", "batches", "reps", "new_tokens",
                                   "block_random", "profile")}
    if w:
        t = bm.Target("tiny", Path(w), Path(w), {"block": Path(w)})
        return [(t, None, tiny_grid, g["cpu"])]
    out = []
    for name in g["models"]:
        if name == "tiny":
            t = bm.tiny(ctx.quick, device, g["block"], g["block_random"], g["drafter_steps"])
            out.append((t, None, tiny_grid, g["cpu"]))
        else:
            cs = dict(g["code_small"])
            t = bm.code_small(device, ctx.quick, cs.get("minutes"))
            prompts = bm.code_small_prompts(t, int(cs["prompts"]), cs["prompt_tokens"],
                                            PROMPT_SEED)
            tg = {"budgets": cs["budgets"], "qualities": [], "batches": cs["batches"],
                  "reps": cs["reps"], "new_tokens": cs["new_tokens"], "block_random": False,
                  "profile": cs["profile"]}
            out.append((t, [np.asarray(p, np.int64) for p in prompts], tg, cs.get("cpu") or {}))
    return out


def _first_difference(got: list, want: list) -> str | None:
    """Where two token lists (per prompt) first differ, or None when they are equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            return (f"prompt {i}, token {j}: {a[j:j + 4]} != {b[j:j + 4]} "
                    f"(lengths {len(a)}, {len(b)})")
    if len(got) != len(want):
        return f"{len(got)} prompts != {len(want)}"
    return None


def _sample(target, tok, prompt, ar_ids, dd_ids, device, bs, budget) -> dict:
    """One held-out prompt and both modes' continuations, as ids and text (the report's)."""
    text = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: None)
    return {"model": target.name, "device": device, "batch": bs, "budget": budget,
            "drafter": "block:trained", "prompt_ids": [int(t) for t in prompt],
            "prompt_text": text(prompt), "ar_ids": ar_ids, "ddtree_ids": dd_ids,
            "ar_text": text(ar_ids), "ddtree_text": text(dd_ids), "identical": ar_ids == dd_ids}


def _run_target(ctx, lib, target, prompts, tg, cpu_trims, n_prompts, reference) -> dict:
    """Every device's cases for one target; {"results", "rows", "sample", "reference"}."""
    from engine.native.engine import Engine

    tag = "" if target.name == "tiny" else f"{target.name} "  # tiny keeps its case names
    results, rows, sample = [], [], None
    drafter_dirs = target.drafters
    tok = bm.tokenizer(target) if target.name != "tiny" else None
    for device in ctx.devices:
        if device == "cuda" and (not lib.has_cuda or lib.cuda_device_count() == 0):
            results.append({"bench": NAME, "backend": device, "model": target.name,
                            "case": f"{tag}all", "skipped":
                            f"{lib.path} has no CUDA backend or no GPU is visible",
                            "validation": {"ok": True, "skipped": True}})
            continue
        # On the CPU beside a GPU: the trimmed grid (a check and a floor; the GPU's figures).
        dg = {**tg, **cpu_trims} if device == "cpu" and _gpu(ctx, lib) else dict(tg)
        new_tokens = int(dg["new_tokens"])
        names = [n for n in drafter_dirs if dg["block_random"] or n != "block:random"]
        longest = 64 if prompts is None else max(len(p) for p in prompts)
        max_seq = longest + new_tokens + max(dg["budgets"]) + 32
        eng = Engine(target.engine_weights, device=device, max_slots=max(dg["batches"]),
                     max_seq=max_seq)
        # The same engine with per-phase timing (per-phase graphs on CUDA): the breakdown only
        # (not on a trimmed CPU grid: the report breaks down the GPU's rounds).
        peng = Engine(target.engine_weights, device=device, max_slots=max(dg["batches"]),
                      max_seq=max_seq, profile=True) if dg["profile"] else None
        dev_prompts = _prompts(n_prompts, eng.vocab_size) if prompts is None else prompts
        n_cases = len(dg["batches"]) * (1 + len(dg["budgets"]) * (len(dg["qualities"]) + len(names)))
        done = 0
        for bs in dg["batches"]:
            batches = _batches(dev_prompts, bs)
            samples, ar = _run_case(eng, batches, new_tokens, "ar", 0, None, dg["reps"])
            ar_median = float(np.median(samples))
            ar_tokens = [t.tolist() for t in ar["tokens"]]
            if reference.get("tokens") is None:
                reference.update(tokens=ar_tokens, device=device)
                diff = None
            else:
                n = min(len(reference["tokens"][0]), new_tokens)  # grids may differ in length
                diff = _first_difference([t[:n] for t in ar_tokens],
                                         [t[:n] for t in reference["tokens"]])
            cases = [("ar", 0, "-", None)]
            # Built (their truth decoded) before timing; prompt j's oracle has seed PROMPT_SEED + j
            # whatever the batch size, so batch sizes compare like with like.
            oracles = {q: [eng.oracle_drafters(b, new_tokens, q, seed=PROMPT_SEED + i * bs)
                           for i, b in enumerate(batches)] for q in dg["qualities"]}
            # The engine's own drafter (the one stored with its weights) is passed as None;
            # another folder's (block:random) as one loaded object per batch, as the engine
            # loads its own.
            blocks = {name: None if drafter_dirs[name] == target.engine_weights else
                      [_load_drafter(drafter_dirs[name], device)] * len(batches) for name in names}
            for budget in dg["budgets"]:
                for q in dg["qualities"]:
                    cases.append(("ddtree", budget, f"oracle:{q}", oracles[q]))
                for name, dr in blocks.items():
                    cases.append(("ddtree", budget, name, dr))
            for mode, budget, drafter_name, dr in cases:
                ctx.progress(done, n_cases, f"{target.name} {device} bs={bs}: next {mode} "
                             f"B={budget} {drafter_name}")
                done += 1
                if mode == "ar":
                    s, out = samples, ar
                    valid = {"ok": diff is None, "check": f"AR tokens == the {reference['device']} "
                             "AR tokens (the first device's)"}
                    if diff:
                        valid["error"] = f"{device} AR != {reference['device']} AR: {diff}"
                else:
                    try:
                        s, out = _run_case(eng, batches, new_tokens, mode, budget, dr, dg["reps"])
                    except (ImportError, FileNotFoundError, ValueError) as e:
                        results.append({"bench": NAME, "backend": device, "batch": bs,
                                        "model": target.name,
                                        "case": f"{tag}{mode} B={budget} {drafter_name}",
                                        "skipped": f"{type(e).__name__}: {e}",
                                        "validation": {"ok": True, "skipped": True}})
                        continue
                    got = [t.tolist() for t in out["tokens"]]
                    bad = _first_difference(got, ar_tokens)
                    valid = {"ok": bad is None, "check": "DDTree tokens == AR tokens (same device)"}
                    if bad:  # loud: the suite's status becomes invalid and the table says so
                        valid["error"] = f"{target.name} {device} bs={bs} B={budget} " \
                                         f"{drafter_name}: DDTree != AR at {bad}"
                        print(f"e2e: MISMATCH: {valid['error']}", file=sys.stderr, flush=True)
                    if (tok is not None and bs == dg["batches"][0] and drafter_name == "block:trained"
                            and budget == _sample_budget(dg["budgets"])):
                        sample = _sample(target, tok, dev_prompts[0], ar_tokens[0], got[0],
                                         device, bs, budget)
                phases = _phases(peng, batches, new_tokens, mode, budget,
                                 None if mode == "ar" else dr) if peng is not None else {}
                total = len(dev_prompts) * new_tokens
                med = float(np.median(s))
                tau = float(np.mean(out["accept"])) if out["accept"] else 0.0
                rec = {
                    "bench": NAME, "backend": device, "model": target.name, "batch": bs,
                    "mode": mode, "budget": budget, "drafter": drafter_name,
                    "case": f"{tag}{mode} B={budget} {drafter_name} bs={bs}",
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
                    # accept_hist[k]: rounds (all requests, the last sample) that accepted k
                    # tokens, the bonus token included (k >= 1; AR: every round is 1).
                    "accept_hist": np.bincount(np.asarray(out["accept"], np.int64)).tolist()
                    if out["accept"] else [],
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
                rows.append([target.name, device, bs, mode, budget or "-", drafter_name,
                             round(total / med, 1), round(out["forwards"] / total, 3),
                             round(tau, 2), round(ar_median / med, 2),
                             round(1e3 * out["round_s"] / max(out["rounds"], 1), 3),
                             "ok" if valid["ok"] else "MISMATCH"])
        eng.close()
        if peng is not None:
            peng.close()
    return {"results": results, "rows": rows, "sample": sample}


def _gpu(ctx, lib) -> bool:
    """The run has a usable GPU (then the CPU backend runs the trimmed grids)."""
    return "cuda" in ctx.devices and bool(lib.has_cuda) and lib.cuda_device_count() > 0


def _sample_budget(budgets) -> int:
    """The budget of the sample continuation: 63 when the grid has it, else the largest."""
    return 63 if 63 in budgets else max(budgets)


def run(ctx) -> dict:
    lib = ctx.require_library("suite e2e")
    from bench.weights import describe, drafter_record

    g = _grid(ctx)
    n_prompts, new_tokens = int(g["prompts"]), int(g["new_tokens"])
    targets = _targets(ctx, g)
    params = {"models": [t.name for t, *_ in targets], "prompts": n_prompts,
              "new_tokens": new_tokens, "prompt_seed": PROMPT_SEED, "budgets": g["budgets"],
              "oracle_qualities": g["qualities"], "batches": g["batches"], "reps": g["reps"],
              "devices": list(ctx.devices), "oracle_depth": 15, "block_drafter": g["block"],
              "cpu_trims": g["cpu"] if _gpu(ctx, lib) else {}}
    results, rows = [], []
    for target, prompts, tg, cpu_trims in targets:
        rec = {"weights": describe(target.folder), "engine_weights": str(target.engine_weights),
               "drafters": {name: drafter_record(d) for name, d in target.drafters.items()}}
        if target.name == "tiny":
            params.update(rec)  # tiny's params stay where earlier runs have them
        else:
            cs = g["code_small"]
            params["code_small"] = {
                **rec, "toy": target.toy, "training": target.training,
                "prompts": {"n": len(prompts), "prompt_tokens": cs["prompt_tokens"],
                            "lengths": [len(p) for p in prompts], "seed": PROMPT_SEED,
                            "source": "held-out files of the target's train.json split"},
                "new_tokens": tg["new_tokens"], "budgets": tg["budgets"], "batches": tg["batches"],
                "reps": tg["reps"], "cpu_trims": cpu_trims if _gpu(ctx, lib) else {}}
        out = _run_target(ctx, lib, target, prompts, tg, cpu_trims, n_prompts, {})
        results += out["results"]
        rows += out["rows"]
        if target.name != "tiny":
            params["code_small"]["sample"] = out["sample"]
    table = format_table(["model", "device", "bs", "mode", "B", "drafter", "tok/s", "fwd/tok",
                          "tau", "x AR", "ms/round", "check"], rows)
    return {"params": params, "results": results, "table": table}
