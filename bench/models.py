"""The targets the e2e and service suites decode: `tiny` and `code-small`.

    tiny        the seeded random MLA + MoE test model (bench/weights.tiny_weights) and its
                block drafters: the one trained against it (bench/weights.trained_drafter_weights)
                and the seeded untrained one (a floor). Prompts: seeded random ids.
    code-small  the small MLA + MoE target trained on the host's Python standard library, with
                its block drafter trained against it and its byte-level BPE tokenizer.json
                (bench/weights.code_small_weights: trained once per host and settings into the
                cache, then reused; `toy` is the seconds-long CPU version for CI). Prompts: cut
                from the held-out files of its training split (engine.training.corpus).

`code_small(device, quick, minutes)` returns a Target; `code_small_prompts(target, n,
prompt_tokens, seed)` its held-out prompts. `code_small_weights` and `heldout_prompts` are the
only places the suites reach the training code (tests point them at a toy trained on a small
corpus: tests/code_small_toy.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

MODELS = ("tiny", "code-small")


@dataclasses.dataclass
class Target:
    name: str                 # "tiny" | "code-small"
    folder: Path              # the target's weights (params record it: bench.weights.describe)
    engine_weights: Path      # the folder the engine loads: its stored drafter is the trained one
    drafters: dict            # {case name: folder}
    training: dict | None = None  # code-small: bench/weights.code_small_record (train.json)
    toy: bool = False


def check_models(names) -> list:
    names = [names] if isinstance(names, str) else list(names)
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise ValueError(f"models {names}: expected a non-empty list of {', '.join(MODELS)}")
    return names


def tiny(quick: bool, device: str, block: bool = True, block_random: bool = True,
         drafter_steps=None) -> Target:
    """The tiny model from the cache, with its trained drafter ("block:trained", the engine's
    own) and, with block_random, the seeded untrained one ("block:random")."""
    from bench import weights as bw

    base = bw.tiny_weights()
    if not block:
        return Target("tiny", base, base, {})
    settings = dict(bw.DRAFTER_TRAIN_QUICK if quick else bw.DRAFTER_TRAIN)
    if drafter_steps:
        settings["steps"] = int(drafter_steps)
    trained = bw.trained_drafter_weights(base, settings, device=device)
    drafters = {"block:trained": trained}
    if block_random:
        drafters["block:random"] = base
    return Target("tiny", base, trained, drafters)


def code_small_weights(device: str, minutes, toy: bool) -> Path:
    """The cached code-small folder (trained now when missing): bench/weights.py."""
    from bench import weights as bw

    kwargs = {} if minutes is None else {"minutes": float(minutes)}
    return Path(bw.code_small_weights(device, toy=toy, **kwargs))


def code_small(device: str, quick: bool, minutes=None) -> Target:
    """code-small with its trained drafter (stored in its folder: "block:trained"); quick: the
    toy version."""
    from bench import weights as bw

    folder = code_small_weights(device, minutes, toy=quick)
    return Target("code-small", folder, folder, {"block:trained": folder},
                  bw.code_small_record(folder), toy=quick)


def heldout_prompts(folder, n: int, prompt_tokens, seed: int) -> list:
    """n prompts (token ids) cut from the held-out files of the target in folder."""
    from engine.training.corpus import heldout_prompts as cut

    return cut(folder, n, prompt_tokens, seed)


def code_small_prompts(target: Target, n: int, prompt_tokens, seed: int) -> list:
    """Held-out prompts of code-small: prompt_tokens an int or [lo, hi] (a length per prompt)."""
    pt = tuple(prompt_tokens) if isinstance(prompt_tokens, (list, tuple)) else int(prompt_tokens)
    prompts = heldout_prompts(target.folder, n, pt, seed)
    if len(prompts) != n or not all(len(p) for p in prompts):
        raise ValueError(f"code-small: asked for {n} held-out prompts, got "
                         f"{[len(p) for p in prompts]} tokens")
    return [list(map(int, p)) for p in prompts]


def tokenizer(target: Target):
    """The target's text tokenizer as the server loads it (engine/serving/tokenizer.py)."""
    from engine.serving.tokenizer import load_tokenizer

    cfg = json.loads((Path(target.folder) / "config.json").read_text())
    return load_tokenizer(target.folder, int(cfg["vocab_size"]))
