"""Block-drafter training on data from the native engine (engine.training.drafter): a tiny budget
beats the seeded random drafter on held-out rounds, the config records the run and the target
it is bound to, a drafter beside other target weights is refused, and DDTree == AR with it.

Fresh seeds every run (printed). Not timed: training time is a benchmark figure (docs/MODEL.md).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from engine.drafters import block as BD
from engine.reference import model as M
from native_helpers import native

pytestmark = pytest.mark.native

STEPS, SEQUENCES, NEW_TOKENS, HELD_OUT = 60, 16, 48, 16  # seconds on 2 shared cores


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(folder, seed, train() result): the tiny target + its drafter trained on a tiny budget."""
    native()  # builds / points KDTREE_LIB at libkdtree.so
    from engine.drafters.block import init_block_drafter
    from engine.training.drafter import train

    M.limit_blas_threads(1)
    seed = int(np.random.SeedSequence().entropy % (2**31))
    print(f"seed = {seed}")
    w = tmp_path_factory.mktemp("trained")
    cfg = M.tiny_config()
    M.save_weights(w, cfg, M.init_weights(cfg, seed))
    init_block_drafter(w, seed=seed + 1)
    # HELD_OUT held-out prompts instead of train's default for 16 sequences (4): the
    # held-out accuracy of 4 sequences swings with what they happen to be (below).
    rng = np.random.default_rng(seed + 1)
    held = [rng.integers(0, cfg.vocab_size, int(rng.integers(4, 25))) for _ in range(HELD_OUT)]
    result = train(w, steps=STEPS, sequences=SEQUENCES, new_tokens=NEW_TOKENS, seed=seed,
                   data="native", log=print, held_out_prompts=held)
    return w, seed, result


def test_tiny_budget_beats_the_random_drafter_and_records_the_run(trained):
    w, seed, result = trained
    before, after = result["held_out_top1_by_depth_before"], result["held_out_top1_by_depth"]
    print(f"seed = {seed}; held-out top-1 before {before[:3]}, after {after[:3]}")
    # Same held-out rounds (same rng) before and after training: 512 of them (depth_accuracy's
    # 8 batches of 64) from 16 held-out sequences. The seeded random drafter hits up to ~5% at
    # depth 1, so with no learning the two would differ by about 0.014 (sqrt(2 x 0.05 x 512) /
    # 512): a gain of 0.03 is over 2 of those, and training gains far more: over 16 fresh
    # seeds, 60 steps gained 0.125 at the least and 0.18 typically. With 4 held-out sequences
    # (train's default here) the gain swung with the four: seed 1550170278's gave 0.0703 ->
    # 0.0684, while its 16 give 0.0547 -> 0.1895 (seed 624816846: 0.0391 -> 0.1641).
    assert after[0] > before[0] + 0.03, (seed, before, after)
    cfg, _ = BD.load(w)
    assert cfg.trained_steps == STEPS
    assert cfg.target_sha256 == BD.target_sha256(w)
    t = cfg.training
    assert t["data_source"] == "native-cpu" and t["steps"] == STEPS and t["seed"] == seed
    assert t["sequences"] == SEQUENCES and t["new_tokens"] == NEW_TOKENS
    assert t["held_out_top1_by_depth"] == after and len(after) == cfg.depth


def test_a_drafter_beside_other_target_weights_is_refused(trained, tmp_path):
    w, seed, _ = trained
    other = tmp_path / "other"
    cfg = M.tiny_config()
    M.save_weights(other, cfg, M.init_weights(cfg, seed + 7))
    for name in (BD.CONFIG_FILE, BD.WEIGHTS_FILE):
        shutil.copyfile(w / name, other / name)
    with pytest.raises(ValueError, match=r"drafter_config.json: this block drafter was made for "
                                         r"target weights with sha256 .* refusing it"):
        BD.load(other)
    from engine.native.engine import Engine

    with Engine(other, device="cpu", max_slots=1, max_seq=64) as eng:
        with pytest.raises(ValueError, match="refusing it"):
            eng.generate([1, 2, 3], 4, mode="ddtree", budget=7)
    # the binding covers the target's config too
    (w / "config.json").rename(tmp_path / "config.json")
    shutil.copyfile(tmp_path / "config.json", w / "config.json")
    with open(w / "config.json", "a") as f:
        f.write("\n")
    try:
        with pytest.raises(ValueError, match="refusing it"):
            BD.load(w)
    finally:
        shutil.copyfile(tmp_path / "config.json", w / "config.json")
    BD.load(w)  # restored: accepted again


def test_ddtree_equals_ar_with_the_trained_drafter_native_cpu(trained):
    from engine.native.engine import Engine

    w, seed, _ = trained
    rng = np.random.default_rng(seed)
    with Engine(w, device="cpu", max_slots=4, max_seq=160) as eng:
        prompts = [rng.integers(0, eng.vocab_size, int(rng.integers(4, 30))) for _ in range(4)]
        ar = eng.generate(prompts, 40, mode="ar").tokens
        for budget in (15, 63):
            dd = eng.generate(prompts, 40, mode="ddtree", budget=budget)
            for i, (a, d) in enumerate(zip(ar, dd.tokens)):
                assert a.tolist() == d.tolist(), f"seed {seed}, budget {budget}, prompt {i}"
            print(f"budget {budget}: tau {dd.stats.mean_accept_length:.3f}")
            assert dd.stats.mean_accept_length > 1.0, (seed, budget)
