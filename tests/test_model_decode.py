"""The invariant on the reference: DDTree greedy output == AR greedy output, token for token.

Fresh model weights and prompts every run (seeds printed). The noisy oracle at several qualities
must show the mean acceptance length rising and the target forwards falling with quality; the
block drafter (seeded random here; trained in tests/test_drafters.py) must keep the invariant.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.reference import model as M
from engine.drafters.oracle import NoisyOracleDrafter
from engine.reference.decode import generate
from model_helpers import single_thread_blas  # noqa: F401 (autouse fixture)

QUALITIES = [0.0, 0.3, 0.6, 0.9, 1.0]


@pytest.fixture(scope="module")
def tiny(seed):
    cfg = M.tiny_config()
    return M.Model(cfg, M.init_weights(cfg, seed))


def _prompts(seed, count, lo=1, hi=48):
    rng = np.random.default_rng(seed + 17)
    lengths = np.linspace(lo, hi, count).astype(int)  # varied lengths, short to long
    return [rng.integers(0, 512, n) for n in lengths]


def _oracle_sweep(model, prompts, new_tokens, budget, seed):
    """For each quality: totals of target forwards and mean acceptance; asserts DDTree == AR."""
    forwards = {q: 0 for q in QUALITIES}
    accept = {q: [] for q in QUALITIES}
    for i, prompt in enumerate(prompts):
        ar = generate(model, prompt, new_tokens)
        assert ar.stats.target_forwards == new_tokens
        truth = np.concatenate([prompt, ar.tokens])
        for q in QUALITIES:
            drafter = NoisyOracleDrafter(truth, model.cfg.vocab_size, depth=15, quality=q,
                                         seed=seed + i)
            dd = generate(model, prompt, new_tokens, mode="ddtree", budget=budget, drafter=drafter)
            assert (dd.tokens == ar.tokens).all(), \
                f"prompt {i} (len {len(prompt)}), quality {q}: first mismatch at " \
                f"{int(np.argmax(dd.tokens != ar.tokens))}"
            st = dd.stats
            assert st.target_forwards == 1 + st.rounds == 1 + len(st.accept_lengths)
            assert sum(st.accept_lengths) + 1 >= new_tokens  # each round commits + the last bonus
            forwards[q] += st.target_forwards
            accept[q].extend(st.accept_lengths)
    return forwards, {q: float(np.mean(a)) for q, a in accept.items()}


def _check_monotone(forwards, accept, new_tokens, count):
    print("target forwards:", forwards, "mean accept:", accept)
    qs = QUALITIES
    assert forwards[0.0] == count * new_tokens and accept[0.0] == 1.0  # always wrong: AR cost
    assert accept[1.0] == 16.0  # always right: the whole L = 15 chain plus the root
    for a, b in zip(qs, qs[1:]):
        assert accept[b] > accept[a], (a, b, accept)
        assert forwards[b] < forwards[a], (a, b, forwards)


def test_ddtree_equals_ar_with_the_oracle_quick(tiny, seed):
    prompts = _prompts(seed, 3, 1, 30)
    forwards, accept = _oracle_sweep(tiny, prompts, 32, budget=15, seed=seed)
    assert accept[1.0] == 16.0 and forwards[0.0] == 3 * 32


@pytest.mark.slow
def test_ddtree_equals_ar_on_20_prompts_x_64_tokens_with_the_oracle(tiny, seed):
    prompts = _prompts(seed, 20)
    forwards, accept = _oracle_sweep(tiny, prompts, 64, budget=15, seed=seed)
    _check_monotone(forwards, accept, 64, 20)


@pytest.mark.parametrize("budget,topk", [(1, None), (4, 1), (63, None), (40, 512)])
def test_ddtree_equals_ar_at_awkward_budgets(tiny, seed, budget, topk):
    prompt = np.random.default_rng(seed + budget).integers(0, 512, 9)
    ar = generate(tiny, prompt, 24)
    drafter = NoisyOracleDrafter(np.concatenate([prompt, ar.tokens]), 512, depth=5, quality=0.7,
                                 seed=seed)
    dd = generate(tiny, prompt, 24, mode="ddtree", budget=budget, drafter=drafter, topk=topk)
    assert (dd.tokens == ar.tokens).all()
    assert max(dd.stats.tree_sizes) <= budget + 1


def test_ddtree_with_the_seeded_block_drafter_equals_ar(tiny, seed):
    from engine.drafters import block as BD

    cfg = BD.DrafterConfig(vocab_size=512, target_hidden_size=256)
    drafter = BD.BlockDrafter(cfg, BD.init_weights(cfg, seed), backend="numpy")
    for prompt in _prompts(seed, 3, 2, 40):
        ar = generate(tiny, prompt, 32)
        dd = generate(tiny, prompt, 32, mode="ddtree", budget=15, drafter=drafter)
        assert (dd.tokens == ar.tokens).all()


def test_generate_rejects_bad_arguments(tiny):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(tiny, [], 4)
    with pytest.raises(ValueError, match="mode 'ddtree' needs a drafter"):
        generate(tiny, [1, 2], 4, mode="ddtree")
    with pytest.raises(ValueError, match="mode = 'beam'"):
        generate(tiny, [1, 2], 4, mode="beam")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_ddtree_equals_ar_on_20_prompts_x_64_tokens_with_the_block_drafter(tiny, seed, tmp_path,
                                                                            backend):
    from engine.drafters.block import BlockDrafter, init_block_drafter

    M.save_weights(tmp_path, tiny.cfg, {k: v.astype(np.float32) for k, v in tiny.w.items()})
    init_block_drafter(tmp_path, seed=seed + 1)  # untrained: the invariant holds for any drafter
    drafter = BlockDrafter.from_dir(tmp_path, backend=backend)
    for i, prompt in enumerate(_prompts(seed + 5, 20)):
        ar = generate(tiny, prompt, 64)
        dd = generate(tiny, prompt, 64, mode="ddtree", budget=15, drafter=drafter)
        assert (dd.tokens == ar.tokens).all(), f"prompt {i} (len {len(prompt)})"
        assert dd.stats.target_forwards <= ar.stats.target_forwards
