"""engine.baselines.sglang_cpu: the SGLang-style path builds the reference's tree, field by field."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.reference import ddtree
from engine.baselines import sglang_cpu
from engine.kdtr.cases import drafter_topk

FIELDS = ("tokens", "parents", "depths", "positions", "first_child", "next_sibling",
          "visibility", "num_nodes", "scores")


def _np(a):
    return a.cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _assert_same(inputs, device="cpu"):
    ref = ddtree.build_tree(*inputs)
    out = sglang_cpu.build_tree(*inputs, device=device)
    for name in FIELDS:
        got, want = _np(getattr(out, name)), getattr(ref, name)
        assert got.shape == want.shape and np.array_equal(got, want), name
    mask = ddtree.sglang_mask(ref, inputs[4])
    assert np.array_equal(_np(out.custom_mask), mask)
    bs, n = ref.tokens.shape
    assert _np(out.retrieve_index).tolist() == np.arange(bs * n).reshape(bs, n).tolist()


@st.composite
def inputs(draw):
    bs = draw(st.integers(1, 3))
    L, K = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    budget = draw(st.integers(1, 60))
    pool = draw(st.lists(st.integers(0, 64), min_size=1, max_size=3))  # exact ties
    raw = draw(st.lists(st.sampled_from(pool), min_size=bs * L * K, max_size=bs * L * K))
    lp = (-np.sort(np.array(raw, np.float64).reshape(bs, L, K), axis=2) / 16).astype(np.float32)
    ids = np.array(draw(st.lists(st.integers(0, 30), min_size=bs * L * K,
                                 max_size=bs * L * K)), np.int64).reshape(bs, L, K)
    roots = np.array(draw(st.lists(st.integers(0, 99), min_size=bs, max_size=bs)), np.int64)
    seq = np.array(draw(st.lists(st.integers(0, 9), min_size=bs, max_size=bs)), np.int64)
    return lp, ids, budget, roots, seq


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs())
def test_baseline_equals_reference_with_ties(args):
    _assert_same(args)


@pytest.mark.parametrize("bs, K, budget", [(17, 16, 16), (2, 63, 63), (1, 255, 255)])
def test_baseline_equals_reference_on_drafter_rows(bs, K, budget):
    rng = np.random.default_rng()
    lp, ids = drafter_topk(rng, bs, 15, K)
    _assert_same((lp, ids, budget, rng.integers(0, 1000, bs), rng.integers(0, 40, bs)))


def test_torch_inputs_are_taken_as_they_are():
    rng = np.random.default_rng()
    lp, ids = drafter_topk(rng, 3, 4, 5, vocab=64)
    roots, seq = rng.integers(0, 9, 3), rng.integers(0, 9, 3)
    ref = ddtree.build_tree(lp, ids, 12, roots, seq)
    out = sglang_cpu.build_tree(*(torch.from_numpy(a) for a in (lp, ids)), 12,
                                torch.from_numpy(roots), torch.from_numpy(seq))
    assert np.array_equal(_np(out.first_child), ref.first_child)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
def test_baseline_on_cuda_equals_reference():
    rng = np.random.default_rng()
    lp, ids = drafter_topk(rng, 4, 15, 31)
    _assert_same((lp, ids, 31, rng.integers(0, 1000, 4), rng.integers(0, 40, 4)), "cuda")


def test_baseline_validation():
    z = np.zeros((1, 2, 2), np.float32)
    i = np.zeros((1, 2, 2), np.int64)
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="device: 'tpu'"):
        sglang_cpu.build_tree(z, i, 3, one, one, device="tpu")
    with pytest.raises(ValueError, match="budget: 0 is outside"):
        sglang_cpu.build_tree(z, i, 0, one, one)
    with pytest.raises(ValueError, match="top_logp: expected dtype torch.float32"):
        sglang_cpu.build_tree(z.astype(np.float64), i, 3, one, one)
    with pytest.raises(ValueError, match="do not match"):
        sglang_cpu.build_tree(z, i, 3, np.zeros(2, np.int64), one)
