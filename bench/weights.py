"""The model weights a suite decodes with: inputs, kept in a cache outside the run folder.

Weights are inputs, not results: a run folder is fetched into git (results/<host>/<run-id>/),
so the tiny model's ~17 MB of safetensors must never land there. `tiny_weights()` generates
the tiny target (`engine.reference.model`, seed 0) and its block drafter (seed 1) once into

    $KDTREE_CACHE/weights/tiny-<digest>/    (default cache: ~/.cache/kdtree-engine)

where <digest> is derived from the tiny config and the two seeds, so a change of either gets a
fresh folder. A folder is complete when its `weights.sha256.json` (written last, after an
atomic rename of the whole folder into place) lists every file with its sha256; it is reused
only when every listed file still has that digest, else it is generated again.

`describe(folder)` is what a suite records in its JSON params so the run stays reproducible:
the folder, the target's config and the sha256 of every weights file.

`trained_drafter_weights(base, settings, device)` is the same target with a TRAINED block
drafter (engine.training.drafter, greedy data from the native engine), in a sibling folder

    $KDTREE_CACHE/weights/tiny-<digest>-drafter-<key>/

(target files hard-linked from `base`, else copied; the drafter trained from base's seeded one),
where <key> is derived from the target's sha256 and the training settings: trained once per
weights digest and settings, on the run's device, then reused. It is complete and verified like
the base folder, and reused only when its drafter is bound to the target beside it (a drafter
trained against other target weights is never used: the folder is trained again).
`drafter_record(folder)` is what a suite records about the drafter it used.

`code_small_weights(device, minutes)` is the TRAINED target `code-small` (engine.training.code_model:
the stdlib's sources, a BPE tokenizer, the MLA + MoE target, its block drafter trained against it
on prompts from the training files), trained once into

    $KDTREE_CACHE/weights/code-small-<key>/    (code-toy-<key> for the CI-sized toy)

where <key> is derived from the config preset, the corpus digest, the seed, the time budget (and
a step limit, if any): a new stdlib, seed or budget gets a fresh folder. Its files: config.json,
model.safetensors, tokenizer.json, train.json (the training record), drafter_config.json,
drafter.safetensors, and weights.sha256.json (written last). It is reused only when every
digest matches, the drafter is trained and bound to the target beside it, and train.json is
complete; else trained again. `code_small_record(folder)` is what a suite records about it.
Held-out prompts: engine.training.corpus.heldout_prompts(folder, n, prompt_tokens, seed); the
tokenizer: engine.text.load_tokenizer(folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from engine.remote.provenance import sha256_file

TARGET_SEED, DRAFTER_SEED = 0, 1
DIGESTS = "weights.sha256.json"  # {file name: sha256}; its presence marks a complete folder


def cache_root() -> Path:
    """$KDTREE_CACHE, else ~/.cache/kdtree-engine."""
    env = os.environ.get("KDTREE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kdtree-engine"


def _digests(folder: Path) -> dict:
    """{name: sha256} of the weights files (config JSON and safetensors) in folder."""
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != DIGESTS and p.suffix in (".json", ".safetensors")}


def _verified(folder: Path) -> bool:
    listed = folder / DIGESTS
    if not listed.is_file():
        return False
    try:
        want = json.loads(listed.read_text())
    except json.JSONDecodeError:
        return False
    return isinstance(want, dict) and bool(want) and _digests(folder) == want


def _publish(tmp: Path, folder: Path, ok) -> Path:
    """Digests tmp's files, then renames tmp into place as `folder` (atomic: a concurrent or
    interrupted run never sees, or leaves, a half-written folder under the final name)."""
    (tmp / DIGESTS).write_text(json.dumps(_digests(tmp), indent=1, sort_keys=True) + "\n")
    if folder.exists():
        shutil.rmtree(folder)  # damaged (failed the caller's check)
    try:
        tmp.rename(folder)
    except OSError:  # another process renamed its complete copy first
        shutil.rmtree(tmp, ignore_errors=True)
        if not ok(folder):
            raise RuntimeError(f"weights cache {folder}: could not be written or verified") from None
    return folder


def tiny_weights(cache: Path | None = None) -> Path:
    """The tiny target + block drafter folder in the cache, generated when missing or damaged."""
    from engine.drafters.block import init_block_drafter
    from engine.reference import model

    cfg = model.tiny_config()
    key = json.dumps({"config": cfg.to_dict(), "target_seed": TARGET_SEED,
                      "drafter_seed": DRAFTER_SEED}, sort_keys=True)
    folder = (cache or cache_root()) / "weights" / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if _verified(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Generated beside the final folder and renamed into place (_publish).
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_weights(tmp, cfg, model.init_weights(cfg, TARGET_SEED))
    init_block_drafter(tmp, seed=DRAFTER_SEED)
    return _publish(tmp, folder, _verified)


# Training settings of the benchmarks' trained drafter (engine.training.drafter.train arguments).
# Default: held-out depth-1 top-1 ~0.4 and tau ~2.4 at B=63 on the tiny model; QUICK trains on
# less data for fewer steps (a clearly non-trivial drafter still, in well under a minute).
DRAFTER_TRAIN = {"steps": 800, "sequences": 192, "new_tokens": 96, "seed": 0}
DRAFTER_TRAIN_QUICK = {"steps": 200, "sequences": 64, "new_tokens": 64, "seed": 0}
TARGET_FILES = ("config.json", "model.safetensors")


def _bound(folder: Path) -> bool:
    """Verified digests, a trained drafter, and that drafter bound to the target beside it."""
    from engine.drafters import block as BD

    if not _verified(folder):
        return False
    try:
        cfg, _ = BD.load(folder)  # refuses a drafter made for other target weights
    except (OSError, ValueError):
        return False
    return cfg.trained_steps > 0 and bool(cfg.target_sha256)


def trained_drafter_weights(base: Path, settings: dict | None = None, device: str = "cpu",
                            log=None) -> Path:
    """base's target with a block drafter trained with `settings` (DRAFTER_TRAIN's keys), from
    the cache when present and bound to that target, else trained now on `device` (the torch
    device for training; the native engine that generates the data runs there too)."""
    from engine.drafters import block as BD
    from engine.training.drafter import train

    base = Path(base)
    settings = dict(DRAFTER_TRAIN if settings is None else settings)
    unknown = sorted(set(settings) - set(DRAFTER_TRAIN))
    if unknown:
        raise ValueError(f"trained_drafter_weights: unknown training settings {unknown} "
                         f"(known: {sorted(DRAFTER_TRAIN)})")
    settings = {**DRAFTER_TRAIN, **settings}
    key = json.dumps({"target_sha256": BD.target_sha256(base),
                      "drafter_init_sha256": sha256_file(base / BD.WEIGHTS_FILE),
                      "train": settings}, sort_keys=True)
    folder = base.parent / f"{base.name}-drafter-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if _bound(folder):
        return folder
    if str(device).startswith("cuda") and not _torch_cuda():
        device = "cpu"  # a CUDA suite whose torch has no GPU still gets the same drafter
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TARGET_FILES + (BD.CONFIG_FILE, BD.WEIGHTS_FILE):
        src, dst = base / name, tmp / name
        if name in TARGET_FILES:
            try:
                os.link(src, dst)  # the target is read-only here: share its bytes
                continue
            except OSError:
                pass
        shutil.copyfile(src, dst)  # the drafter files are rewritten by training: copies
    try:
        train(tmp, device=device, log=log, **settings)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, folder, _bound)


CODE_SMALL_LAYOUT = 1  # bump when a trained folder's contents change meaning: older keys retire
RECORD_KEYS = ("schema", "corpus", "tokenizer", "target", "drafter", "tau", "seconds")


def code_small_key(toy: bool = False, minutes: float | None = None, seed: int = 0,
                   corpus=None, steps: int | None = None) -> tuple[str, float]:
    """(folder name, the budget in minutes) of a code-small training in the cache."""
    from engine.training.code_model import preset
    from engine.training.corpus import load_corpus

    name = "toy" if toy else "small"
    p = preset(name)
    minutes = float(p["minutes"] if minutes is None else minutes)
    key = json.dumps({"layout": CODE_SMALL_LAYOUT, "config": name, "preset": p,
                      "corpus_digest": load_corpus(corpus).digest, "seed": int(seed),
                      "minutes": minutes, "steps": steps}, sort_keys=True, default=list)
    return f"code-{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}", minutes


def _trained_complete(folder: Path) -> bool:
    """Verified digests, a bound trained drafter, a tokenizer and a complete train.json."""
    if not _bound(folder) or not (folder / "tokenizer.json").is_file():
        return False
    try:
        rec = json.loads((folder / "train.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(rec, dict) and all(k in rec for k in RECORD_KEYS)


def code_small_weights(device: str = "cuda", minutes: float | None = None,
                       cache: Path | None = None, toy: bool = False, corpus=None, seed: int = 0,
                       steps: int | None = None, log=None) -> Path:
    """The trained code-small folder (code-toy with toy=True) from the cache when complete, else
    trained now on `device` (a torch device; the native engine generating the drafter's data
    runs there too). minutes: the whole training budget (default: the preset's, 4 for small);
    corpus: a folder of *.py files instead of this Python's stdlib; steps: a cap on the
    target's steps (tests). A CUDA device that torch cannot see is an error, not a silent CPU
    run: three minutes of CPU training would be cached under the same key as the GPU's."""
    from engine.training.code_model import train_code_model

    name, minutes = code_small_key(toy, minutes, seed, corpus, steps)
    folder = (cache or cache_root()) / "weights" / name
    if _trained_complete(folder):
        return folder
    if str(device).startswith("cuda") and not _torch_cuda():
        raise RuntimeError(f"code_small_weights: device {device!r}, but torch sees no CUDA "
                           f"device (train on a GPU host, or pass device='cpu' knowingly)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        train_code_model(tmp, device=device, corpus=corpus, minutes=minutes, seed=seed,
                         config="toy" if toy else "small", steps=steps, log=log, progress=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, folder, _trained_complete)


def code_small_record(folder) -> dict:
    """What a suite records about a trained target (beside describe(folder)'s sha256 per file):
    config preset, corpus digest and split, seed, budget, device, steps, tokens, losses, the
    drafter's training and the tau estimate of the training run."""
    rec = json.loads((Path(folder) / "train.json").read_text())
    tg, corpus = rec["target"], rec["corpus"]
    return {"path": str(folder), "config_name": rec["config_name"], "seed": rec["seed"],
            "minutes": rec["minutes"], "device": rec["device"], "device_name": rec["device_name"],
            "parameters": rec["parameters"], "active_parameters": rec["active_parameters"],
            "corpus_root": corpus["root"], "corpus_digest": corpus["digest"],
            "corpus_files": corpus["files"], "corpus_sample": rec.get("corpus_sample"),
            "train_files": corpus["split"]["train_files"],
            "heldout_files": corpus["split"]["heldout_files"],
            "heldout_list_sha256": corpus["split"]["heldout_list_sha256"],
            "vocab_size": rec["tokenizer"]["vocab_size"], "steps": tg["steps"],
            "tokens_seen": tg["tokens_seen"], "tokens_per_second": tg["tokens_per_second"],
            "train_loss": tg["train_loss"], "heldout_loss": tg["heldout_loss"],
            "unigram_heldout_loss": tg["unigram_heldout_loss"],
            "drafter_steps": rec["drafter"]["steps"],
            "drafter_held_out_top1_by_depth": rec["drafter"]["held_out_top1_by_depth"],
            "tau_estimate": rec["tau"].get("tau"), "tau_budget": rec["tau"].get("budget"),
            "tau_sample": rec["tau"].get("sample"), "seconds": rec["seconds"]}


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def drafter_record(folder) -> dict:
    """What a suite records about the block drafter in `folder`: trained or random, its steps,
    the training run (data source, seed, held-out top-1 by depth) and the target it is bound to."""
    from engine.drafters import block as BD

    cfg, _ = BD.load(folder)
    t = cfg.training or {}
    return {"kind": "trained" if cfg.trained_steps else "random", "path": str(folder),
            "trained_steps": cfg.trained_steps, "target_sha256": cfg.target_sha256,
            "data_source": t.get("data_source"), "train_seed": t.get("seed"),
            "train_sequences": t.get("sequences"), "train_device": t.get("device"),
            "held_out_top1_by_depth": t.get("held_out_top1_by_depth"),
            "drafter_sha256": sha256_file(Path(folder) / BD.WEIGHTS_FILE)}


def describe(folder) -> dict:
    """What a suite records about its weights: path, the target's config, sha256 per file."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"weights {folder}: no config.json (not a weights folder)")
    return {"path": str(folder), "config": json.loads(config.read_text()),
            "sha256": _digests(folder)}
