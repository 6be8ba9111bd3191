"""Brief training of the block drafter on the target's own greedy outputs (torch, CPU or CUDA).

Data: prompts (random ids by default, or given: the trained target's prompts are cut from its
training files, engine.training.code_model), the target's greedy continuation and its hidden states at every position
(one prefill over the finished sequence), from the native engine (engine.native.Engine: batched
prompts, on CUDA when training on CUDA and the library has it, else its CPU backend); only when
libkdtree is missing, from the float64 reference model (engine.reference.decode, ~20x slower), and
the log says so. The drafter's config records the data source, steps, seed, the held-out
accuracy per depth and the sha256 of the target weights (a load beside other weights fails). A sample is a
round as the decoder sees it: committed length P (P >= the prompt length, so the root is a greedy
token), the last C hidden states before P, root = token P, labels = tokens P+1 .. P+L (ignored
past the end). Loss: cross-entropy per depth, weighted exp(-(d-1)/7) (DFlash's decay: early
depths decide most of the acceptance); dropout 0.3 on the context features (it lifted held-out
depth-1 accuracy from 0.39 to 0.41 and the mean acceptance at budget 63 from 2.17 to 2.37).

    python -m engine.cli.drafter train --weights DIR [--steps N] [--sequences N] [--seed S]

A `deadline` (time.monotonic() value) stops the steps early: the learning-rate schedule then
follows whichever of steps and time is nearer its end, and the record says how many steps ran.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import numpy as np

from engine.drafters import block as BD
from engine.reference.model import Model
from engine.reference.decode import generate

IGNORE = -100


@dataclasses.dataclass
class Sequence:
    tokens: np.ndarray  # int64 [T]
    hidden: np.ndarray  # float32 [T, D]: row j is the state at position j (it predicts token j+1)
    prompt_len: int


def collect(model: Model, n_seqs: int, new_tokens: int, seed: int,
            prompts=None) -> list[Sequence]:
    """Greedy sequences from the float64 reference model (the fallback: slow). prompts: token
    id lists to continue instead of n_seqs random ones."""
    out = []
    for prompt in _prompts(model.cfg.vocab_size, n_seqs, seed, prompts):
        gen = generate(model, prompt, new_tokens).tokens
        seq = np.concatenate([prompt, gen])
        _, hidden = model.forward(seq, np.arange(len(seq)), model.new_cache(len(seq)))
        out.append(Sequence(seq, hidden.astype(np.float32), len(prompt)))
    return out


def _prompts(vocab: int, n_seqs: int, seed: int, given=None) -> list:
    if given is not None:
        out = [np.asarray(p, dtype=np.int64) for p in given]
        bad = [i for i, p in enumerate(out) if len(p) == 0 or p.min() < 0 or p.max() >= vocab]
        if bad:
            raise ValueError(f"drafter training: prompts {bad[:5]} are empty or hold ids "
                             f"outside [0, {vocab})")
        return out
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(4, 25))) for _ in range(n_seqs)]


def causal_visibility(n: int, words: int) -> np.ndarray:
    """uint32 [n, words]: row i has bits 0..i set (a prefill's lower-triangular mask)."""
    bits = np.tril(np.ones((n, words * 32), bool))
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def collect_native(weights_dir, n_seqs: int, new_tokens: int, seed: int, device: str = "cpu",
                   batch: int = 32, prompts=None) -> list[Sequence]:
    """collect() on the native engine: `batch` prompts decoded together (AR), then one causal
    forward over the finished sequences for the final-norm hidden states (not committed, so the
    slots stay empty)."""
    from engine.native.engine import Engine

    longest = 24 if prompts is None else max(len(p) for p in prompts)
    with Engine(weights_dir, device=device, max_slots=batch,
                max_seq=longest + new_tokens + 8) as eng:
        prompts = _prompts(eng.vocab_size, n_seqs, seed, prompts)
        out = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            gen = eng.generate(chunk, new_tokens, mode="ar").tokens
            seqs = [np.concatenate([p, g]).astype(np.int64) for p, g in zip(chunk, gen)]
            words = (max(len(s) for s in seqs) + 31) // 32
            _, hidden = eng.forward(list(range(len(seqs))), seqs,
                                    [np.arange(len(s)) for s in seqs],
                                    [causal_visibility(len(s), words) for s in seqs],
                                    capture=[eng.num_layers + 1])
            start = 0
            for p, s in zip(chunk, seqs):
                out.append(Sequence(s, hidden[start:start + len(s), 0].copy(), len(p)))
                start += len(s)
    return out


def collect_any(weights_dir, n_seqs: int, new_tokens: int, seed: int, device: str,
                data: str = "auto", log=None, prompts=None,
                batch: int = 32) -> tuple[list[Sequence], str]:
    """(sequences, source): data "native", "reference" or "auto" (native unless libkdtree is
    missing). The native engine runs on CUDA when `device` is a CUDA device and the library
    has the CUDA backend, else on its CPU backend. source: "native-cpu", "native-cuda" or
    "reference"."""
    if data not in ("auto", "native", "reference"):
        raise ValueError(f"drafter training: data = {data!r}, expected auto, native or reference")
    if data != "reference":
        try:
            from engine.native._lib import library

            lib = library()
        except Exception as e:  # noqa: BLE001 - any failure to find or load the library
            if data == "native":
                raise
            if log:
                log(f"native library unavailable ({type(e).__name__}: {e}); generating the "
                    "training data with the float64 reference model instead (much slower)")
        else:
            want_cuda = str(device).startswith("cuda")
            on = "cuda" if want_cuda and lib.has_cuda and lib.cuda_device_count() > 0 else "cpu"
            return (collect_native(weights_dir, n_seqs, new_tokens, seed, on, batch, prompts),
                    f"native-{on}")
    return collect(Model.from_dir(weights_dir), n_seqs, new_tokens, seed, prompts), "reference"


def make_batch(data: list[Sequence], cfg: BD.DrafterConfig, rng, batch: int):
    """Random rounds -> ctx [B, C, Dt] (left-padded), valid [B, C], root [B], labels [B, L]."""
    C, L = cfg.context_size, cfg.depth
    ctx = np.zeros((batch, C, cfg.target_hidden_size), np.float32)
    valid = np.zeros((batch, C), bool)
    root = np.zeros(batch, np.int64)
    labels = np.full((batch, L), IGNORE, np.int64)
    for b in range(batch):
        s = data[int(rng.integers(len(data)))]
        T = len(s.tokens)
        P = int(rng.integers(s.prompt_len, T - 1))
        h = s.hidden[max(0, P - C):P]
        ctx[b, C - len(h):] = h
        valid[b, C - len(h):] = True
        root[b] = s.tokens[P]
        lab = s.tokens[P + 1:P + 1 + L]
        labels[b, :len(lab)] = lab
    return ctx, valid, root, labels


def depth_accuracy(net, data, cfg, rng, batches: int = 8, batch: int = 64, device="cpu"):
    """Top-1 accuracy per depth [L] on random rounds of `data` (no gradient)."""
    import torch

    hits, count = np.zeros(cfg.depth), np.zeros(cfg.depth)
    with torch.no_grad():
        for _ in range(batches):
            ctx, valid, root, labels = make_batch(data, cfg, rng, batch)
            pred = net(*(torch.as_tensor(a, device=device) for a in (ctx, valid, root))).argmax(-1)
            ok = labels != IGNORE
            hits += ((pred.cpu().numpy() == labels) & ok).sum(0)
            count += ok.sum(0)
    return hits / np.maximum(count, 1)


def train(weights_dir, steps: int = 800, sequences: int = 192, new_tokens: int = 96,
          batch: int = 64, lr: float = 3e-3, seed: int = 0, device: str = "cpu",
          ctx_dropout: float = 0.3, data: str = "auto", log=None, prompts=None,
          held_out_prompts=None, prompt_source: str | None = None, deadline: float | None = None,
          data_batch: int = 32) -> dict:
    """Trains the drafter in weights_dir (from its current weights) and saves it there, its
    config recording the run (DrafterConfig.training) and the target's sha256.

    prompts / held_out_prompts: token id lists whose greedy continuations are the training and
    held-out data (default: `sequences` random prompts, and sequences // 8 from another seed);
    prompt_source names them in the record. deadline: a time.monotonic() value that ends the
    steps early. data_batch: prompts the native engine decodes together."""
    import torch

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if steps < 1:
        raise ValueError(f"drafter training: steps = {steps}, need >= 1")
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    if not str(device).startswith("cuda"):
        # Matrices of a few hundred columns: extra threads only spin on a shared machine (the
        # CLI's setting since the first trainer; also for in-process callers such as the bench
        # cache); restored when done.
        torch.set_num_threads(1)
    try:
        return _train(weights_dir, steps, sequences, new_tokens, batch, lr, seed, device,
                      ctx_dropout, data, log, prompts, held_out_prompts, prompt_source, deadline,
                      data_batch)
    finally:
        torch.set_num_threads(threads)


def _train(weights_dir, steps, sequences, new_tokens, batch, lr, seed, device, ctx_dropout,
           data, log, prompts, held_out_prompts, prompt_source, deadline, data_batch) -> dict:
    import torch

    cfg, weights = BD.load(weights_dir)
    t0 = time.monotonic()
    if prompts is not None:
        sequences = len(prompts)
        if held_out_prompts is None:  # the last eighth of the given prompts, never trained on
            cut = max(1, len(prompts) // 8)
            prompts, held_out_prompts = prompts[:-cut], prompts[-cut:]
    # Held-out sequences come from other prompts: accuracy on rounds never trained on.
    train_data, source = collect_any(weights_dir, sequences, new_tokens, seed, device, data, log,
                                     prompts, data_batch)
    held_out, _ = collect_any(weights_dir, max(4, sequences // 8), new_tokens, seed + 1, device,
                              source.split("-")[0], log, held_out_prompts, data_batch)
    data_seconds = time.monotonic() - t0
    log(f"collected {len(train_data)} + {len(held_out)} greedy sequences of {new_tokens} tokens "
        f"({source}) in {data_seconds:.1f} s")
    data = train_data
    net = BD.make_net(cfg, weights, device)
    # The same held-out rounds (same rng seed) before and after: the gain is training's.
    acc_before = depth_accuracy(net.eval(), held_out, cfg, np.random.default_rng(seed + 3),
                                device=device)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    t1 = time.monotonic()

    def spent(s):  # how much of the budget step s has used: steps, or time when nearer
        by_time = (time.monotonic() - t1) / (deadline - t1) if deadline and deadline > t1 else 0.0
        return min(1.0, max(s / steps, by_time))

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * spent(s))))
    decay = torch.tensor([math.exp(-d / 7.0) for d in range(cfg.depth)], device=device)
    rng = np.random.default_rng(seed + 2)
    losses = []
    done = 0
    for step in range(steps):
        if deadline is not None and step > 0 and time.monotonic() >= deadline:
            log(f"step {step:5d}: the time budget is spent; stopping")
            break
        ctx, valid, root, labels = (torch.as_tensor(a, device=device)
                                    for a in make_batch(data, cfg, rng, batch))
        # Feature dropout on the context: with ~10k rounds the net otherwise memorises rounds by
        # their exact hidden states instead of learning the root -> next-token structure.
        ctx = torch.nn.functional.dropout(ctx, p=ctx_dropout)
        logits = net(ctx, valid, root)  # [B, L, V]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels,
                                               ignore_index=IGNORE, reduction="none")  # [B, L]
        ok = (labels != IGNORE).float()
        loss = (ce * ok * decay).sum() / (ok * decay).sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(f"step {step:5d}  loss {np.mean(losses[-50:]):.4f}")
    acc = depth_accuracy(net.eval(), held_out, cfg, np.random.default_rng(seed + 3), device=device)
    record = {"steps": done, "seed": seed, "sequences": len(train_data), "new_tokens": new_tokens,
              "batch": batch, "lr": lr, "ctx_dropout": ctx_dropout, "data_source": source,
              "device": str(device), "data_seconds": round(data_seconds, 3),
              "train_seconds": round(time.monotonic() - t1, 3),
              "first_loss": losses[0] if losses else None,
              "final_loss": float(np.mean(losses[-50:])) if losses else None,
              "held_out_top1_by_depth": [round(float(a), 4) for a in acc],
              "held_out_top1_by_depth_before": [round(float(a), 4) for a in acc_before]}
    if prompts is not None:
        record.update(prompts=prompt_source or "given", held_out_sequences=len(held_out),
                      steps_planned=steps)
    new_cfg = dataclasses.replace(cfg, trained_steps=cfg.trained_steps + done,
                                  target_sha256=BD.target_sha256(weights_dir), training=record)
    paths = BD.save(weights_dir, new_cfg, net.state_numpy())
    result = dict(record, saved=[str(p) for p in paths])
    log(f"held-out top-1 accuracy by depth: {result['held_out_top1_by_depth']}")
    return result
