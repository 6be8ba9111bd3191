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
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

TARGET_SEED, DRAFTER_SEED = 0, 1
DIGESTS = "weights.sha256.json"  # {file name: sha256}; its presence marks a complete folder


def cache_root() -> Path:
    """$KDTREE_CACHE, else ~/.cache/kdtree-engine."""
    env = os.environ.get("KDTREE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kdtree-engine"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digests(folder: Path) -> dict:
    """{name: sha256} of the weights files (config JSON and safetensors) in folder."""
    return {p.name: _sha256(p) for p in sorted(folder.iterdir())
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
                      "drafter_init_sha256": _sha256(base / BD.WEIGHTS_FILE),
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
            "drafter_sha256": _sha256(Path(folder) / BD.WEIGHTS_FILE)}


def describe(folder) -> dict:
    """What a suite records about its weights: path, the target's config, sha256 per file."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"weights {folder}: no config.json (not a weights folder)")
    return {"path": str(folder), "config": json.loads(config.read_text()),
            "sha256": _digests(folder)}
