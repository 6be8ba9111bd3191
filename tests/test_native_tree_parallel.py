"""The parallel tree builds (cuda/src/tree_build_parallel.h, cuda/src/tree_build_warp.h) vs the
reference.

KDT_TREE_BUILD picks the algorithm per call: on the CPU backend "parallel" runs the CUDA
kernel's block-synchronous code thread by thread (KDT_TREE_BUILD_THREADS threads), so it is
checked here without a GPU; "parallel-strict" refuses the serial fallback, which proves that the
parallel path itself built the tree; "warp" runs the one-warp best-first build lane by lane
(budgets <= 1023; 1024 runs "parallel"). On CUDA "auto" (the default: warp up to budget 31,
parallel above), "warp", "parallel" and "serial" (the earlier kernel) must all equal the
reference. Fresh random inputs; failures carry the seed.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from engine.native import NativeError
from engine.reference import ddtree

from native_helpers import (  # noqa: F401 (fixtures)
    DEVICES, FIELDS_TREE, assert_same, cuda_ready, native, random_build_inputs,
    skip_cuda_without_gpu)

pytestmark = pytest.mark.native

# Budgets 1..1024: every small one, the powers of two and their neighbours, and a few others.
BUDGETS = sorted(set(range(1, 18)) | {b + o for b in (32, 64, 128, 256, 512, 1024)
                                      for o in (-1, 0, 1) if b + o <= 1024} | {100, 300, 777})


def _check(monkeypatch, mode, rng, bs, L, K, budget, ties, seed, device="cpu", threads=None):
    monkeypatch.setenv("KDT_TREE_BUILD", mode)
    if threads:
        monkeypatch.setenv("KDT_TREE_BUILD_THREADS", str(threads))
    args = random_build_inputs(rng, bs, L, K, ties)
    ref = ddtree.build_tree(*args[:2], budget, *args[2:])
    where = (f"seed={seed} mode={mode} device={device} bs={bs} L={L} K={K} budget={budget} "
             f"ties={ties} threads={threads}")
    try:
        got = native().build_tree(*args[:2], budget, *args[2:], device=device)
    except NativeError as e:  # e.g. parallel-strict declining: name the inputs to replay
        raise AssertionError(f"{where}: {e}") from e
    assert_same(got, ref, FIELDS_TREE, where)


@pytest.mark.parametrize("budget", BUDGETS)
def test_parallel_cpu_strict_bf16_inputs(monkeypatch, budget):
    # bf16-rounded log-softmax inputs: the parallel path must build them without the fallback.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    K = min(budget, int(rng.integers(1, 1025)))
    _check(monkeypatch, "parallel-strict", rng, 2, int(rng.integers(1, 17)), K, budget, False, seed)


@pytest.mark.parametrize("budget", BUDGETS)
def test_parallel_cpu_tie_heavy(monkeypatch, budget):
    # Exact ties everywhere; masses of equal scores may take the fallback (still exact).
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    K = min(budget, int(rng.integers(1, 1025)))
    _check(monkeypatch, "parallel", rng, 2, int(rng.integers(1, 17)), K, budget, True, seed)


@pytest.mark.parametrize("threads", [32, 64, 128, 512, 1024])
def test_parallel_cpu_thread_counts(monkeypatch, threads):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for budget, K, ties in ((63, 16, True), (255, 255, False), (1023, 1023, False), (5, 3, True)):
        _check(monkeypatch, "parallel-strict" if not ties else "parallel", rng, 2, 15, K, budget,
               ties, seed, threads=threads)


def test_parallel_cpu_strict_small_ties(monkeypatch):
    # Small exact-tie trees fit the pool: the tie-break by rank path runs in the parallel sort.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for _ in range(40):
        budget = int(rng.integers(1, 64))
        _check(monkeypatch, "parallel-strict", rng, 1, int(rng.integers(1, 6)),
               int(rng.integers(1, min(budget, 4) + 1)), budget, True, seed)


WARP_BUDGETS = BUDGETS


@pytest.mark.parametrize("budget", WARP_BUDGETS)
def test_warp_cpu_matches_reference(monkeypatch, budget):
    # The one-warp build emulated lane by lane: bf16-like and tie-heavy inputs, depths to 32.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for ties in (False, True, True):
        K = min(budget, int(rng.integers(1, 300)))
        _check(monkeypatch, "warp", rng, 2, int(rng.integers(1, 33)), K, budget, ties, seed)


def _adversarial(rng, bs, L, K, positive: bool):
    """Log-probs spanning ~60 orders of magnitude (and, with positive, values > 0)."""
    mag = 10.0 ** rng.uniform(-30, 30, size=(bs, L, K))
    lp = -mag * rng.uniform(0.5, 1.0, size=(bs, L, K))
    if positive:
        lp += rng.uniform(0, 2, size=(bs, L, 1))
    lp = -np.sort(-lp.astype(np.float32), axis=2)
    ids = rng.integers(0, 1000, size=(bs, L, K)).astype(np.int64)
    return (np.ascontiguousarray(lp), ids, rng.integers(0, 9, bs).astype(np.int64),
            rng.integers(0, 99, bs).astype(np.int64))


@pytest.mark.parametrize("positive", [False, True])
@pytest.mark.parametrize("budget", [1, 7, 63, 255, 1024])
@pytest.mark.parametrize("mode", ["parallel", "warp"])
def test_parallel_cpu_adversarial_magnitudes(monkeypatch, budget, positive, mode):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    monkeypatch.setenv("KDT_TREE_BUILD", mode)
    for _ in range(3):
        args = _adversarial(rng, 2, int(rng.integers(1, 17)), int(rng.integers(1, budget + 1)),
                            positive)
        ref = ddtree.build_tree(*args[:2], budget, *args[2:])
        got = native().build_tree(*args[:2], budget, *args[2:])
        assert_same(got, ref, FIELDS_TREE,
                    f"seed={seed} mode={mode} budget={budget} positive={positive}")


def test_parallel_strict_detects_a_child_above_its_parent(monkeypatch):
    # A positive log-prob at depth 2 puts the child above its parent: the heap then pops it out
    # of score order, so the parallel path must decline (strict) and fall back (default).
    lp = np.array([[[-1.0, -2.0], [0.5, -3.0]]], np.float32)
    ids = np.array([[[1, 2], [3, 4]]], np.int64)
    args = (lp, ids, 3, np.array([0]), np.array([0]))
    monkeypatch.setenv("KDT_TREE_BUILD", "parallel-strict")
    with pytest.raises(NativeError, match="score above its generator"):
        native().build_tree(*args)
    monkeypatch.setenv("KDT_TREE_BUILD", "parallel")
    assert_same(native().build_tree(*args), ddtree.build_tree(*args), FIELDS_TREE, "fallback")


def _queue_overflow_inputs(bs, scale):
    """Budget 63 (a pool of 512): rank-0 steps of -2^-20 and deviations of about -1 over 32
    depths, so that the first bound (the 63rd best of the chain's one-step deviations and the
    depth-2 grid) keeps each of its deviations' rank-0 descendants too: at least 540 nodes at or
    above it, more than the pool. The queue overflows and gives way to the levels, whose
    refinements fit the pool; no two paths tie. scale (a power of two) keeps every sum exact."""
    L, K = 32, 63
    d = np.arange(1, L + 1)[:, None]
    lp = np.concatenate([np.full((L, 1), -2.0 ** -20),
                         -1.0 - np.arange(1, K)[None, :] / 64.0 - d / 4096.0], axis=1) * scale
    lp = np.ascontiguousarray(np.broadcast_to(lp, (bs, L, K)), dtype=np.float32)
    ids = np.broadcast_to(np.arange(K, dtype=np.int64), (bs, L, K)).copy()
    return lp, ids, np.arange(bs, dtype=np.int64), np.full(bs, 7, np.int64)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -40, 2.0 ** 40])
def test_parallel_cpu_strict_queue_overflow(monkeypatch, scale):
    # The queue (budgets <= 63) overflows the pool on these inputs (checked with a probe when
    # written: at every scale it stops at 513 entries of 512); the levels must then build the
    # tree from the same bound, without the serial fallback (strict).
    monkeypatch.setenv("KDT_TREE_BUILD", "parallel-strict")
    args = _queue_overflow_inputs(2, scale)
    assert_same(native().build_tree(*args[:2], 63, *args[2:]),
                ddtree.build_tree(*args[:2], 63, *args[2:]), FIELDS_TREE, f"scale={scale}")


def _wide_batch_inputs(bs, L, step, tie_from):
    """Budget 40: depths 1 and 2 keep rank 0 only; depth 3 has 64 cheap ranks (each 2^-12
    below the last, equal from rank tie_from on); deeper rows a cheap rank 0 (step x 2^-12) and
    deviations near -0.5. The nodes at or above the first bound are one run of 40 under the
    depth-2 node, then their rank-0 lines. The queue's first runs (the root's and its rank-0
    child's) hold one node each, so on the GPU the warp that takes the depth-2 node expands
    batches of 40 at level after level (more than a warp's 32 lanes: GpuBlock::expand's wide
    path), while the pool stays in the queue's 512 (a probe of the warps' batches in the CPU
    emulation, when written: batches of 40 at most, pools of 227, 223, 375 and 363 entries for
    the cases below; with the wide run one level higher, the first runs would spread it over
    the warps, 6 entries a batch). Every value is a multiple of 2^-12: the sums are exact."""
    r = np.arange(64, dtype=np.float64)
    lp = np.empty((L, 64))
    lp[:2] = np.r_[-2.0 ** -10, -1.0 - r[1:] / 64]
    lp[2] = -(np.minimum(r, tie_from) + 1) * 2.0 ** -12
    lp[3:] = np.r_[-step * 2.0 ** -12, -0.5 - r[1:] / 4096]
    lp = np.ascontiguousarray(np.broadcast_to(lp, (bs, L, 64)), dtype=np.float32)
    ids = np.broadcast_to(np.arange(64, dtype=np.int64), (bs, L, 64)).copy()
    return lp, ids, np.arange(bs, dtype=np.int64), np.full(bs, 7, np.int64)


WIDE_BATCH_CASES = [(16, 8, 31), (16, 8, 63), (12, 4, 31), (12, 4, 63)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L,step,tie_from", WIDE_BATCH_CASES)
def test_parallel_queue_wide_batches(monkeypatch, device, L, step, tie_from):
    # The queue's batches wider than a warp; strict on the CPU (the parallel path itself built
    # the tree), the parallel kernel on CUDA, many blocks at once.
    monkeypatch.setenv("KDT_TREE_BUILD", "parallel-strict" if device == "cpu" else "parallel")
    args = _wide_batch_inputs(3 if device == "cpu" else 96, L, step, tie_from)
    assert_same(native().build_tree(*args[:2], 40, *args[2:], device=device),
                ddtree.build_tree(*args[:2], 40, *args[2:]), FIELDS_TREE,
                f"device={device} L={L} step={step} tie_from={tie_from}")


@pytest.mark.cuda
def test_cuda_parallel_queue(monkeypatch, cuda_ready):
    # The queue's schedule on the GPU: every warp expanding its own batches, their runs placed by
    # atomics in any order, and the overflow that hands over to the levels; bench-like inputs
    # at budgets 32..63 and the overflowing ones, many blocks at once.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    monkeypatch.setenv("KDT_TREE_BUILD", "parallel")
    from bench.inputs import tree_inputs

    for budget in (32, 47, 63):
        inp = tree_inputs(rng, 96, 15, min(budget, 64))
        args = (inp["top_logp"], inp["top_ids"], inp["root_ids"], inp["seq_lens"])
        assert_same(native().build_tree(*args[:2], budget, *args[2:], device="cuda"),
                    ddtree.build_tree(*args[:2], budget, *args[2:]), FIELDS_TREE,
                    f"seed={seed} budget={budget}")
    args = _queue_overflow_inputs(40, 1.0)
    assert_same(native().build_tree(*args[:2], 63, *args[2:], device="cuda"),
                ddtree.build_tree(*args[:2], 63, *args[2:]), FIELDS_TREE, "queue overflow")


@pytest.mark.cuda
@pytest.mark.parametrize("bs", [8, 200, 1100])
def test_cuda_parallel_both_register_caps(monkeypatch, cuda_ready, bs):
    # The launch picks the 96-register kernel when the grid fits the multiprocessors at its
    # occupancy (two blocks of 256 threads a multiprocessor), else the 80-register one: bs 8
    # takes the first at every budget, bs 1100 the second at budgets 64-255 on any device of
    # fewer than 550 multiprocessors (tree_build_parallel.cu). At budget 63 the queue's kernel
    # stands in for either: alone on its multiprocessor at bs 8, held to two blocks a
    # multiprocessor by the shared memory it asks for at bs 200 (on a device of 100 to 199
    # multiprocessors, the H100's and H200's 132 included), at three at bs 1100; a request the
    # queue cannot take is built there by the serial selection. All bit for bit.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    monkeypatch.setenv("KDT_TREE_BUILD", "parallel")
    from bench.inputs import tree_inputs

    for budget in (63, 255):
        inp = tree_inputs(rng, bs, 15, 64)
        args = (inp["top_logp"], inp["top_ids"], inp["root_ids"], inp["seq_lens"])
        assert_same(native().build_tree(*args[:2], budget, *args[2:], device="cuda"),
                    ddtree.build_tree(*args[:2], budget, *args[2:]), FIELDS_TREE,
                    f"seed={seed} bs={bs} budget={budget}")
    args = _queue_overflow_inputs(bs, 1.0)  # the queue gives way (the serial selection)
    assert_same(native().build_tree(*args[:2], 63, *args[2:], device="cuda"),
                ddtree.build_tree(*args[:2], 63, *args[2:]), FIELDS_TREE,
                f"queue overflow bs={bs}")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["auto", "warp", "parallel", "serial"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_cuda_modes_match_reference(monkeypatch, cuda_ready, mode, budget):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    K = min(budget, int(rng.integers(1, 1025)))
    for ties in (False, True):
        _check(monkeypatch, mode, rng, 3, int(rng.integers(1, 17)), K, budget, ties, seed,
               device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [64, 128])
def test_cuda_parallel_thread_counts(monkeypatch, cuda_ready, threads):
    # KDT_TREE_BUILD_THREADS sets the CUDA launch's threads per CTA too (a measurement knob).
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for budget, K, ties in ((63, 16, True), (255, 64, False), (1023, 64, False), (5, 3, True)):
        _check(monkeypatch, "parallel", rng, 3, 15, K, budget, ties, seed, device="cuda",
               threads=threads)


@pytest.mark.cuda
def test_cuda_parallel_threads_beyond_the_kernel(monkeypatch, cuda_ready):
    # 1024 threads a block launch only while the kernel takes at most 64 registers: either the
    # tree is exact, or the call is refused with the device's limit named (never a failed launch).
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    try:
        _check(monkeypatch, "parallel", rng, 2, 15, 64, 63, True, seed, device="cuda",
               threads=1024)
    except AssertionError as e:
        assert "KDT_TREE_BUILD_THREADS=1024: the parallel build's kernel takes at most" in str(e)


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [15, 63, 255, 1023])
def test_cuda_warp_large_batch(monkeypatch, cuda_ready, budget):
    # bs > 512: four requests (warps) per CTA, the last CTA partly empty.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for ties in (False, True):
        _check(monkeypatch, "warp", rng, 522, 15, min(budget, 32), budget, ties, seed,
               device="cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["warp", "parallel", "serial"])
def test_signed_zero_log_probs(monkeypatch, request, device, mode):
    # A drafter certain of its token gives log-probs of 0, of either sign: scores of -0.0 and
    # +0.0 compare equal (the reference's heap ties them and the rank path decides), and each
    # keeps the sign its chain gives it (compared bit for bit).
    if device == "cuda":
        request.getfixturevalue("cuda_ready")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for budget in (1, 7, 31, 63, 255):
        for pool in ((-0.0, 0.0), (-0.0, 0.0, -0.5, -1.0)):
            lp = rng.choice(np.array(pool, np.float32), size=(3, 6, 4))
            lp = np.ascontiguousarray(-np.sort(-lp, axis=2), np.float32)
            args = (lp, rng.integers(0, 1000, size=lp.shape).astype(np.int64),
                    rng.integers(0, 1000, size=3).astype(np.int64),
                    rng.integers(0, 5000, size=3).astype(np.int64))
            monkeypatch.setenv("KDT_TREE_BUILD", mode)
            got = native().build_tree(*args[:2], budget, *args[2:], device=device)
            assert_same(got, ddtree.build_tree(*args[:2], budget, *args[2:]), FIELDS_TREE,
                        f"seed={seed} mode={mode} device={device} budget={budget} pool={pool}")


@pytest.mark.cuda
@pytest.mark.parametrize("L,K", [(1, 1), (1, 3), (3, 5), (15, 15), (7, 31), (16, 64), (16, 65)])
def test_cuda_warp_bulk_staging(monkeypatch, cuda_ready, L, K):
    # The one-warp build stages a request's log-probs with 16-byte loads between a scalar head
    # and tail (warp_stage) and its ids with cp.async: consecutive requests of odd L K start at
    # every offset in a 16-byte unit, and the smallest arrays are all head. 16 x 64 is the
    # largest that stages the ids; 16 x 65 gathers them from global memory instead.
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for ties in (False, True):
        _check(monkeypatch, "warp", rng, 7, L, K, 31, ties, seed, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["parallel", "warp"])
@pytest.mark.parametrize("positive", [False, True])
def test_cuda_parallel_adversarial(monkeypatch, cuda_ready, positive, mode):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    monkeypatch.setenv("KDT_TREE_BUILD", mode)
    for budget in (1, 63, 255, 1023):
        args = _adversarial(rng, 4, 15, min(budget, 64), positive)
        ref = ddtree.build_tree(*args[:2], budget, *args[2:])
        got = native().build_tree(*args[:2], budget, *args[2:], device="cuda")
        assert_same(got, ref, FIELDS_TREE,
                    f"seed={seed} mode={mode} budget={budget} positive={positive}")


# The one-copy layout of the parallel build (tree::par::plan): where a block's shared memory
# holds no second pool copy (sm_120's 99 KB at budgets 1023 and 1024), the pool compacts in place
# and the order reads scores through the sorted indices. KDT_TREE_BUILD_SMEM emulates the
# smaller device, on the CPU emulation and on CUDA alike.
SM120_SMEM = 100352  # sm_120's 99 KB per block, less the kernel's static kilobyte
# At budget 255 and L <= 16 this fits one copy of the smallest pool (512 entries), never two: the
# pool overflows and compacts often.
TIGHT_SMEM_255 = 32000


@pytest.mark.parametrize("budget", [1023, 1024])
def test_one_copy_cpu_strict_bench_inputs(monkeypatch, budget):
    # bench-like inputs under sm_120's limit: the one-copy layout builds them without the
    # fallback (fixed seeds: a pool overflow would decline, and strict would then fail).
    from bench.inputs import tree_inputs

    monkeypatch.setenv("KDT_TREE_BUILD_SMEM", str(SM120_SMEM))
    monkeypatch.setenv("KDT_TREE_BUILD", "parallel-strict")
    for seed in range(3):
        inp = tree_inputs(np.random.default_rng([15, seed, budget]), 4, 15, 64)
        args = (inp["top_logp"], inp["top_ids"], inp["root_ids"], inp["seq_lens"])
        ref = ddtree.build_tree(*args[:2], budget, *args[2:])
        got = native().build_tree(*args[:2], budget, *args[2:], device="cpu")
        assert_same(got, ref, FIELDS_TREE, f"seed={seed} budget={budget} one copy")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("smem,budget", [(SM120_SMEM, 1023), (SM120_SMEM, 1024),
                                         (TIGHT_SMEM_255, 255)])
def test_one_copy_matches_reference(monkeypatch, device, smem, budget):
    # Random and tie-heavy inputs (a declined request falls back: still exact).
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    monkeypatch.setenv("KDT_TREE_BUILD_SMEM", str(smem))
    for ties in (False, True, True):
        K = min(budget, int(rng.integers(1, 1025)))
        _check(monkeypatch, "parallel", rng, 3, int(rng.integers(1, 17)), K, budget, ties, seed,
               device=device)
