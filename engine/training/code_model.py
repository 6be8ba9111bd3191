"""The trained target `code-small`: corpus -> tokenizer -> target -> block drafter, in one timed run.

    python -m engine.cli.model train --out DIR --device cuda [--corpus DIR] [--minutes 4]
                                     [--seed 0] [--config small|toy] [--steps N]

1. The corpus (engine.training.corpus: the running interpreter's stdlib *.py, split by file,
   digested; the toy takes a fixed sample of it, `corpus_bytes`) and a byte-level BPE of
   PRESETS[...]["vocab"] ids trained on the training files (engine.training.bpe), saved as
   DIR/tokenizer.json.
2. The target (engine.training.target.TargetNet, the engine's MLA + MoE architecture) trained on
   random windows of the training files' token stream (files joined by <|endoftext|>): AdamW,
   linear warmup then cosine decay to a tenth, bf16 autocast on CUDA, gradient clipping, the
   router's correction bias moved by DeepSeek-V3's load balancing. It stops at the first of
   `steps` and the time budget's target share; then the train and held-out losses (float32,
   nats/token) and a unigram model's held-out loss (add-one counts of the training stream) are
   measured, and DIR/config.json + DIR/model.safetensors are written (the engine's format).
3. The block drafter (engine.training.drafter) trained against that target on the greedy
   continuations of prompts cut from the TRAINING files (held-out top-1 from held-out files), in
   the rest of the budget; saved beside the target and bound to it.
4. tau: the native engine decodes a few held-out prompts with AR and DDTree (the trained drafter)
   and records the mean acceptance length and that both gave the same tokens (skipped, with the
   reason, without libkdtree).
5. DIR/train.json records all of it (docs/TRAINING.md lists the fields).

`--minutes` is the whole budget, tokenizer and data included: the target trains until
`target_share` of it is spent (or `max_epochs` passes over the training stream are done), the
drafter until all of it is; the evaluations come after.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from engine.training.corpus import RECORD_FILE, cut_prompts, load_corpus, sample

SCHEMA = 1

_SMALL_MODEL = {
    "vocab_size": 4096, "hidden_size": 384, "intermediate_size": 1536, "moe_intermediate_size": 384,
    "num_hidden_layers": 6, "num_attention_heads": 6, "q_lora_rank": 192, "kv_lora_rank": 128,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4,
    "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}

# The toy keeps every feature of the format (q_lora, YaRN with mscale != mscale_all_dim, MoE
# groups, a shared expert, a dense first layer) at a size that trains in seconds on a CPU.
_TOY_MODEL = {
    **_SMALL_MODEL,
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "n_group": 4, "topk_group": 2, "max_position_embeddings": 128,
    "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 1.0},
}

PRESETS = {
    "small": {
        "model": _SMALL_MODEL, "seq_len": 512, "batch": 64, "lr": 2e-3, "min_lr_ratio": 0.1,
        "dropout": 0.1,  # a 12-30 MB corpus is seen many times in the budget
        "max_epochs": 8,  # past that a small corpus is overfitted: the drafter gets the time
        "warmup": 0.03, "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0,
        "router_balance_rate": 1e-3, "eval_tokens": 1 << 20, "eval_tokens_cpu": 1 << 15,
        "curve_tokens": 1 << 16,
        "minutes": 4.0, "target_share": 0.62, "cpu_threads": None,
        "corpus_bytes": None,  # every file of the corpus
        # sequences: an upper bound; collection stops at 40% of the drafter's time (drafter.py)
        "drafter": {"sequences": 8192, "held_out": 64, "prompt_tokens": (16, 128), "new_tokens": 96,
                    "batch": 256, "lr": 2e-3, "steps": 1_000_000, "data_batch": 128},
        "tau": {"prompts": 8, "prompt_tokens": 64, "new_tokens": 64, "budget": 63},
    },
    "toy": {
        "model": _TOY_MODEL, "seq_len": 64, "batch": 8, "lr": 3e-3, "min_lr_ratio": 0.1,
        "dropout": 0.0, "max_epochs": None,
        "warmup": 0.05, "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0,
        "router_balance_rate": 1e-3, "eval_tokens": 8192, "eval_tokens_cpu": 8192,
        "curve_tokens": 2048, "minutes": 0.5,
        "target_share": 0.6,
        # a sample of the corpus (a quarter of it held out): the whole stdlib takes ~15 s to
        # tokenize, most of the target's 18 s, and a toy sees a few hundred thousand tokens
        "corpus_bytes": 1 << 20,
        "cpu_threads": 1,  # matrices of tens of columns: a second thread only spins
        "drafter": {"sequences": 12, "held_out": 4, "prompt_tokens": (8, 16), "new_tokens": 12,
                    "batch": 16, "lr": 3e-3, "steps": 20, "data_batch": 16},
        "tau": {"prompts": 2, "prompt_tokens": 12, "new_tokens": 8, "budget": 15},
    },
}


def preset(name: str, overrides: dict | None = None) -> dict:
    """PRESETS[name], with `overrides` merged in (one level deep for the "model", "drafter" and
    "tau" sections; unknown keys are an error): for measurements, never for the cache."""
    if name not in PRESETS:
        raise ValueError(f"config {name!r}: expected one of {sorted(PRESETS)}")
    p = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PRESETS[name].items()}
    for k, v in (overrides or {}).items():
        if k not in p:
            raise ValueError(f"preset override {k!r}: not a key of the preset ({sorted(p)})")
        if isinstance(p[k], dict):
            unknown = sorted(set(v) - set(p[k]))
            if unknown:
                raise ValueError(f"preset override {k}: unknown keys {unknown}")
            p[k].update(v)
        else:
            p[k] = v
    return p


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train_code_model(out_dir, device: str = "cpu", corpus=None, minutes: float | None = None,
                     seed: int = 0, config: str = "small", steps: int | None = None,
                     log=None, progress: bool | None = None, overrides: dict | None = None) -> dict:
    """Runs steps 1-5 of the module docstring into out_dir; returns the train.json record.
    overrides: changes to the preset (preset()), recorded in train.json."""
    import torch

    log = log or _stderr
    p = preset(config, overrides)
    minutes = float(p["minutes"] if minutes is None else minutes)
    if not minutes > 0:
        raise ValueError(f"minutes = {minutes}: need a positive time budget")
    if steps is not None and steps < 1:
        raise ValueError(f"steps = {steps}: need >= 1")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch sees no CUDA device")
    t_start = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    if dev.type == "cpu" and p.get("cpu_threads"):
        torch.set_num_threads(p["cpu_threads"])
    try:
        return _run(out, p, dev, corpus, minutes, seed, config, steps, log, progress, t_start,
                    overrides)
    finally:
        torch.set_num_threads(threads)


def _run(out, p, dev, corpus, minutes, seed, config, steps, log, progress, t_start,
         overrides) -> dict:
    import torch

    from engine.drafters.block import init_block_drafter
    from engine.reference.model import ModelConfig
    from engine.text import load_tokenizer
    from engine.training.bpe import train_bpe
    from engine.training.target import TargetNet, export, init_parameters

    budget = 60.0 * minutes

    # 1. corpus and tokenizer
    corp = load_corpus(corpus)
    log(f"corpus {corp.root}: {len(corp.train)} training + {len(corp.heldout)} held-out files, "
        f"digest {corp.digest[:16]}")
    cap = p["corpus_bytes"]
    train_paths = sample(corp.train, cap)
    held_paths = sample(corp.heldout, None if cap is None else cap // 4)
    train_texts = [corp.train[k] for k in train_paths]
    held_texts = [corp.heldout[k] for k in held_paths]
    used = None
    if cap is not None:
        used = {"max_bytes": cap, "train_files": len(train_texts),
                "train_bytes": sum(len(t.encode()) for t in train_texts),
                "heldout_files": len(held_texts),
                "heldout_bytes": sum(len(t.encode()) for t in held_texts)}
        log(f"corpus sample (at most {cap:,} bytes): {used['train_files']} training files "
            f"({used['train_bytes']:,} bytes) + {used['heldout_files']} held-out "
            f"({used['heldout_bytes']:,} bytes)")
    t = time.monotonic()
    train_bpe(train_texts, p["model"]["vocab_size"], out)
    tok = load_tokenizer(out, p["model"]["vocab_size"])
    tokenizer_s = time.monotonic() - t
    t = time.monotonic()
    train_ids = _stream(tok, train_texts)
    held_ids = _stream(tok, held_texts)
    encode_s = time.monotonic() - t
    log(f"tokenizer: {tok.vocab_size} ids in {tokenizer_s:.1f} s; {len(train_ids):,} training + "
        f"{len(held_ids):,} held-out tokens ({encode_s:.1f} s)")

    # 2. target
    cfg = ModelConfig.from_dict(p["model"], f"preset {config}")
    net = TargetNet(cfg, p["dropout"])
    init_parameters(net, seed)
    net.to(dev)
    fit = _fit(net, train_ids, held_ids, p, dev, seed, t_start + p["target_share"] * budget, steps, log,
               progress)
    net.eval()
    t = time.monotonic()
    losses = _evaluate(net, train_ids, held_ids, p, dev)
    eval_s = time.monotonic() - t
    log(f"target: train loss {losses['train_loss']:.4f}, held-out {losses['heldout_loss']:.4f}, "
        f"unigram held-out {losses['unigram_heldout_loss']:.4f} nats/token ({eval_s:.1f} s)")
    net.to("cpu").float()
    export(net, out)
    n_params, n_active = net.num_parameters(), net.active_parameters()
    del net
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # 3. drafter
    dp = p["drafter"]
    init_block_drafter(out, seed=seed + 1)
    t = time.monotonic()
    prompts = cut_prompts(train_texts, tok, dp["sequences"], tuple(dp["prompt_tokens"]), seed + 2)
    held_prompts = cut_prompts(held_texts, tok, dp["held_out"], tuple(dp["prompt_tokens"]), seed + 3)
    from engine.training.drafter import train as train_drafter

    drafter = train_drafter(out, steps=dp["steps"], new_tokens=dp["new_tokens"],
                            batch=dp["batch"], lr=dp["lr"], seed=seed, device=str(dev), log=log,
                            prompts=prompts, held_out_prompts=held_prompts,
                            prompt_source="training files", deadline=t_start + budget,
                            data_batch=dp["data_batch"])
    drafter.pop("saved", None)
    drafter_s = time.monotonic() - t

    # 4. tau on held-out prompts
    tp = p["tau"]
    t = time.monotonic()
    try:
        tau = estimate_tau(out, cut_prompts(held_texts, tok, tp["prompts"], tp["prompt_tokens"],
                                            seed + 4), tp["new_tokens"], tp["budget"], str(dev), tok)
    except Exception as e:  # noqa: BLE001 - recorded and reported; the trained weights stay
        tau = {"error": f"{type(e).__name__}: {e}"}
    tau_s = time.monotonic() - t
    if "tau" in tau:
        log(f"tau {tau['tau']:.2f} at budget {tp['budget']} on {tp['prompts']} held-out prompts "
            f"({tau['device']}), DDTree tokens == AR tokens: {tau['same_tokens']}")
    else:
        log(f"tau: {'skipped' if 'skipped' in tau else 'FAILED'} "
            f"({tau.get('skipped') or tau.get('error')})")

    record = {
        "schema": SCHEMA, "config_name": config, "overrides": overrides or None,
        "seed": seed, "minutes": minutes,
        "steps_limit": steps, "device": str(dev), "device_name": _device_name(dev),
        "python": platform.python_version(), "torch": torch.__version__,
        "parameters": n_params, "active_parameters": n_active,
        "corpus": corp.record(), "corpus_sample": used,
        "tokenizer": {"vocab_size": tok.vocab_size, "train_tokens": len(train_ids),
                      "heldout_tokens": len(held_ids),
                      "bytes_per_token": round(sum(len(s.encode()) for s in train_texts)
                                               / max(len(train_ids), 1), 4)},
        "training": {k: (list(v) if isinstance(v, tuple) else v) for k, v in p.items()
                     if k not in ("model", "drafter", "tau")},
        "target": {**fit, **losses},
        "drafter": drafter,
        "tau": tau,
        "seconds": {"tokenizer": round(tokenizer_s, 2), "encode": round(encode_s, 2),
                    "target": fit["seconds"], "eval": round(eval_s, 2),
                    "drafter": round(drafter_s, 2), "tau": round(tau_s, 2),
                    "wall": round(time.monotonic() - t_start, 2)},
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def _stream(tok, texts: list[str]) -> np.ndarray:
    """The texts' ids joined by <|endoftext|> (after each file), int32."""
    parts = []
    for ids in tok.encode_batch(texts):
        parts.append(np.asarray(ids, np.int32))
        parts.append(np.array([tok.eos_id], np.int32))
    return np.concatenate(parts)


def _device_name(dev) -> str:
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def _lr_factor(frac: float, p: dict) -> float:
    """Linear warmup over the first `warmup` of the budget, then cosine to min_lr_ratio."""
    if frac < p["warmup"]:
        return max(frac / p["warmup"], 1e-3)
    x = min(1.0, (frac - p["warmup"]) / (1.0 - p["warmup"]))
    return p["min_lr_ratio"] + (1 - p["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * x))


def _fit(net, train_ids: np.ndarray, held_ids: np.ndarray, p: dict, dev, seed: int,
         deadline: float, steps: int | None, log, progress) -> dict:
    """The training loop: random windows, AdamW, until `steps`, `deadline` or `max_epochs` passes
    over the training stream, whichever comes first (the schedule follows the nearest). At a quarter, half
    and three quarters of the budget it measures the held-out loss on a sample (`curve`, for
    the record only: nothing is selected by it), outside the throughput figure."""
    import torch
    import torch.nn.functional as F

    from engine.training.progress import Progress

    T, B = p["seq_len"], p["batch"]
    if len(train_ids) < T + 2:
        raise ValueError(f"training stream of {len(train_ids)} tokens is shorter than one "
                         f"window of {T + 1}: a larger corpus is needed")
    ids = torch.as_tensor(train_ids.astype(np.int64), device=dev)
    offsets = torch.arange(T + 1, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    decay = [q for q in net.parameters() if q.ndim >= 2]
    keep = [q for q in net.parameters() if q.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": p["weight_decay"]},
                             {"params": keep, "weight_decay": 0.0}], lr=p["lr"],
                            betas=tuple(p["betas"]), **({"fused": True} if dev.type == "cuda" else {}))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
                else contextlib.nullcontext())
    t0 = time.monotonic()
    span = max(deadline - t0, 1e-6)
    step, first, recent = 0, None, []
    curve, marks, eval_s = [], [0.25, 0.5, 0.75], 0.0
    loss_sum = torch.zeros((), device=dev)
    net.train()
    with Progress("target", span, log=log, rich=progress) as bar:
        while True:
            now = time.monotonic()
            by = {"time": (now - t0) / span, "steps": step / steps if steps else 0.0,
                  "epochs": step * B * T / (p["max_epochs"] * len(train_ids))
                  if p.get("max_epochs") else 0.0}
            frac = max(by.values())
            if frac >= 1.0:
                stopped_by = max(by, key=by.get)
                break
            if marks and frac >= marks[0]:
                marks.pop(0)
                te = time.monotonic()
                net.eval()
                cap = p["curve_tokens"] if dev.type == "cuda" else \
                    min(p["curve_tokens"], p["eval_tokens_cpu"])
                ce, _ = _window_losses(net, held_ids, min(T, len(held_ids) - 1), cap, dev)
                net.train()
                curve.append({"step": step, "heldout_loss": round(float(ce.mean()), 4)})
                eval_s += time.monotonic() - te
            for g in opt.param_groups:
                g["lr"] = p["lr"] * _lr_factor(frac, p)
            starts = torch.randint(0, len(ids) - T - 1, (B,), generator=gen, device=dev)
            batch = ids[starts[:, None] + offsets]                                  # [B, T + 1]
            with autocast:
                logits, _ = net(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), p["grad_clip"])
            opt.step()
            net.balance_router(p["router_balance_rate"])
            loss_sum += loss.detach()
            step += 1
            if step == 1 or step % 10 == 0:  # a host sync every 10 steps, not every step
                mean = float(loss_sum) / (1 if step == 1 else 10)
                loss_sum.zero_()
                first = mean if first is None else first
                recent = (recent + [mean])[-5:]
                el = time.monotonic() - t0 - eval_s
                bar.update(frac, step=step, loss=mean, **{"tok/s": int(step * B * T / max(el, 1e-9))})
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.monotonic() - t0
        tokens = step * B * T
        rate = tokens / max(seconds - eval_s, 1e-9)
        bar.update(1.0, step=step, loss=recent[-1] if recent else float("nan"),
                   **{"tok/s": int(rate)})
    return {"steps": step, "stopped_by": stopped_by, "tokens_seen": tokens,
            "epochs": round(tokens / len(train_ids), 3),
            "seconds": round(seconds, 2), "tokens_per_second": round(rate, 1),
            "curve_eval_seconds": round(eval_s, 2), "first_loss": first,
            "last_loss": float(np.mean(recent)) if recent else None, "heldout_curve": curve}


def _window_losses(net, ids: np.ndarray, T: int, max_tokens: int, dev, batch: int = 16):
    """Per-token cross-entropy (float64 numpy) and the target ids of non-overlapping windows of
    T + 1 tokens spread evenly over `ids`, at most max_tokens targets; float32, no autocast."""
    import torch
    import torch.nn.functional as F

    n_win = max(1, min((len(ids) - 1) // T, max_tokens // T))
    stride = max(T, (len(ids) - 1 - T) // max(n_win - 1, 1)) if n_win > 1 else T
    starts = [min(i * stride, len(ids) - 1 - T) for i in range(n_win)]
    ce, tgt = [], []
    with torch.no_grad():
        for i in range(0, n_win, batch):
            rows = np.stack([ids[s:s + T + 1] for s in starts[i:i + batch]]).astype(np.int64)
            x = torch.as_tensor(rows, device=dev)
            logits, _ = net(x[:, :-1])
            ce.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                      x[:, 1:].reshape(-1), reduction="none").double().cpu().numpy())
            tgt.append(rows[:, 1:].reshape(-1))
    return np.concatenate(ce), np.concatenate(tgt)


def _evaluate(net, train_ids: np.ndarray, held_ids: np.ndarray, p: dict, dev) -> dict:
    T = min(p["seq_len"], len(held_ids) - 1)
    cap = p["eval_tokens"] if dev.type == "cuda" else p["eval_tokens_cpu"]
    tr_ce, _ = _window_losses(net, train_ids, T, cap, dev)
    ho_ce, ho_tgt = _window_losses(net, held_ids, T, cap, dev)
    V = net.cfg.vocab_size
    counts = np.bincount(train_ids, minlength=V).astype(np.float64) + 1.0  # add-one
    unigram = -np.log(counts[ho_tgt] / counts.sum())
    return {"train_loss": float(tr_ce.mean()), "heldout_loss": float(ho_ce.mean()),
            "unigram_heldout_loss": float(unigram.mean()), "eval_window": T,
            "train_eval_tokens": len(tr_ce), "heldout_eval_tokens": len(ho_ce)}


def estimate_tau(folder, prompts: list[list[int]], new_tokens: int, budget: int, device: str,
                 tok=None) -> dict:
    """AR and DDTree (the folder's block drafter) on the native engine over `prompts` decoded
    together: tau (mean accepted nodes per round, root included), whether both modes gave the
    same tokens, the seconds of each, and prompt 0 with its continuation as text when `tok` is
    given. {"skipped": why} without libkdtree."""
    try:
        from engine.native._lib import library

        lib = library()
    except Exception as e:  # noqa: BLE001 - no library, or one that does not load
        return {"skipped": f"libkdtree unavailable: {type(e).__name__}: {e}"}
    from engine.native.engine import Engine

    on = "cuda" if str(device).startswith("cuda") and lib.has_cuda and \
        lib.cuda_device_count() > 0 else "cpu"
    longest = max(len(q) for q in prompts)
    with Engine(folder, device=on, max_slots=len(prompts),
                max_seq=longest + new_tokens + budget + 8) as eng:
        ar = eng.generate(prompts, new_tokens, mode="ar")
        dd = eng.generate(prompts, new_tokens, mode="ddtree", budget=budget)
    same = all(np.array_equal(a, b) for a, b in zip(ar.tokens, dd.tokens))
    out = {"tau": round(dd.stats.mean_accept_length, 4), "same_tokens": bool(same),
           "device": on, "budget": budget, "prompts": len(prompts), "new_tokens": new_tokens,
           "prompt_tokens": [len(q) for q in prompts],
           "ar_seconds": round(ar.stats.seconds, 4), "ddtree_seconds": round(dd.stats.seconds, 4),
           "ddtree_target_forwards": dd.stats.target_forwards}
    if tok is not None:
        out["sample"] = {"prompt": tok.decode(prompts[0]),
                         "continuation": tok.decode(list(ar.tokens[0]))}
    return out
