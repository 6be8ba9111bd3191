"""The model weights a suite decodes with: inputs, kept in a cache outside the run folder.

Weights are inputs, not results: a run folder is fetched into git (results/<host>/<run-id>/),
so the tiny model's ~17 MB of safetensors must never land there. `tiny_weights()` generates
the tiny target (`engine.model`, seed 0) and its block drafter (seed 1) once into

    $KDTREE_CACHE/weights/tiny-<digest>/    (default cache: ~/.cache/kdtree-engine)

where <digest> is derived from the tiny config and the two seeds, so a change of either gets a
fresh folder. A folder is complete when its `weights.sha256.json` (written last, after an
atomic rename of the whole folder into place) lists every file with its sha256; it is reused
only when every listed file still has that digest, else it is generated again.

`describe(folder)` is what a suite records in its JSON params so the run stays reproducible:
the folder, the target's config and the sha256 of every weights file.
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


def tiny_weights(cache: Path | None = None) -> Path:
    """The tiny target + block drafter folder in the cache, generated when missing or damaged."""
    from engine import drafters, model

    cfg = model.tiny_config()
    key = json.dumps({"config": cfg.to_dict(), "target_seed": TARGET_SEED,
                      "drafter_seed": DRAFTER_SEED}, sort_keys=True)
    folder = (cache or cache_root()) / "weights" / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if _verified(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Generate beside the final folder and rename into place: a concurrent or interrupted run
    # never sees (or leaves) a half-written folder under the final name.
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_weights(tmp, cfg, model.init_weights(cfg, TARGET_SEED))
    drafters.init_block_drafter(tmp, seed=DRAFTER_SEED)
    (tmp / DIGESTS).write_text(json.dumps(_digests(tmp), indent=1, sort_keys=True) + "\n")
    if folder.exists():
        shutil.rmtree(folder)  # damaged (failed the check above)
    try:
        tmp.rename(folder)
    except OSError:  # another process renamed its complete copy first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _verified(folder):
            raise RuntimeError(f"weights cache {folder}: could not be written or verified") from None
    return folder


def describe(folder) -> dict:
    """What a suite records about its weights: path, the target's config, sha256 per file."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"weights {folder}: no config.json (not a weights folder)")
    return {"path": str(folder), "config": json.loads(config.read_text()),
            "sha256": _digests(folder)}
