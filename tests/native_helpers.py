"""Shared helpers of the native-vs-reference tests (test_native_tree*.py, test_native_kdtr*.py).

`native()` returns the `engine.native` module after making sure a library is there: with
KDTREE_LIB set it uses that file; otherwise it (re)builds build/cpu when it is missing or older
than cuda/ sources (cuda/build.sh --arch cpu --out build/cpu) and points KDTREE_LIB at it.
`bench_library()` is that library as bench loads it (bench.load_library), for the benchmark
suites' tests; either step failing skips the test with the reason.
`fresh_tiny_weights(tmp_path_factory, name, drafter=...)` writes a tiny model with fresh random
weights (and, with drafter=True, a random block drafter beside it) for the engine and server tests.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import numpy as np
import pytest

FIELDS_TREE = ["tokens", "parents", "depths", "positions", "first_child", "next_sibling",
               "visibility", "num_nodes", "scores"]
FIELDS_ACCEPT = ["accept_index", "accept_len", "bonus", "status"]

# Device parameter for backend-generic tests; the cuda case skips (with the reason) without a
# CUDA build or a visible GPU through the autouse fixture `skip_cuda_without_gpu`.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

_READY = None


def native():
    global _READY
    if _READY is None:
        from engine.native import _lib

        if not os.environ.get("KDTREE_LIB"):
            try:
                os.environ["KDTREE_LIB"] = str(_lib.build_if_stale("cpu"))
            except RuntimeError as e:
                pytest.fail(f"building the native library failed: {e}")
        import engine.native

        _READY = engine.native
    return _READY


def bench_library():
    """bench.load_library()'s library, after native() made sure one is there; skips the test,
    with the reason, when either fails."""
    import bench

    try:
        native()
    except Exception as e:
        pytest.skip(f"libkdtree.so is not available: {e}")
    lib, why = bench.load_library()
    if lib is None:
        pytest.skip(f"libkdtree.so is not available: {why}")
    return lib


def fresh_tiny_weights(tmp_path_factory, name: str, *, drafter: bool):
    """(folder, seed): a new temporary folder `name` holding the tiny model (docs/MODEL.md) with
    random weights from a fresh seed; drafter=True adds a random block drafter seeded seed + 1.
    Tests put the seed in their failure messages."""
    from engine.drafters.block import init_block_drafter
    from engine.reference import model

    seed = secrets.randbelow(2**31)
    d = tmp_path_factory.mktemp(name)
    cfg = model.tiny_config()
    model.save_weights(d, cfg, model.init_weights(cfg, seed))
    if drafter:
        init_block_drafter(d, seed=seed + 1)
    return d, seed


def cuda_skip_reason() -> str | None:
    lib = native().library()
    if not lib.has_cuda:
        return f"{lib.path} is a CPU-only build (set KDTREE_LIB to a CUDA build to run this)"
    if lib.cuda_device_count() == 0:
        return "no CUDA device is visible to libkdtree"
    return None


@pytest.fixture(autouse=True)
def skip_cuda_without_gpu(request):
    callspec = getattr(request.node, "callspec", None)
    wants_cuda = (callspec is not None and callspec.params.get("device") == "cuda") or \
        "cuda_ready" in request.fixturenames
    if wants_cuda:
        reason = cuda_skip_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture
def cuda_ready():
    """Marks a test as needing the CUDA backend (skip logic in skip_cuda_without_gpu)."""
    return True


@dataclass
class Links:
    """The accept inputs of a hand-made tree (kdt_tree_accept reads these fields)."""
    tokens: np.ndarray
    first_child: np.ndarray
    next_sibling: np.ndarray
    num_nodes: np.ndarray | None


def random_build_inputs(rng, bs: int, L: int, K: int, ties: bool):
    """(top_logp float32 [bs, L, K] rows sorted descending, top_ids int64 [bs, L, K],
    root_ids int64 [bs], seq_lens int64 [bs]). ties=True draws log-probs from a few repeated
    values (exact float64 score ties); else log-softmax of bf16-rounded random logits."""
    if ties:
        if rng.integers(0, 2):
            pool = -0.25 * np.arange(6)  # dyadic: sums are exact, ties everywhere
        else:
            pool = np.log(rng.uniform(0.01, 1.0, size=4))
        lp = rng.choice(pool, size=(bs, L, K)).astype(np.float32)
    else:
        V = max(K, 2 * K)
        logits = rng.normal(0.0, 3.0, size=(bs, L, V)).astype(np.float32)
        # bf16 rounding of the logits (drop the low 16 bits): what a real drafter gives.
        logits = (logits.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        m = logits.max(axis=2, keepdims=True)
        lse = m + np.log(np.exp(logits - m).sum(axis=2, keepdims=True))
        lp = (logits - lse).astype(np.float32)
        lp = -np.sort(-lp, axis=2)[:, :, :K]
    lp = -np.sort(-lp, axis=2)
    lp = np.ascontiguousarray(lp, np.float32)
    ids = rng.integers(0, 1000, size=(bs, L, K)).astype(np.int64)
    root = rng.integers(0, 1000, size=bs).astype(np.int64)
    seq = rng.integers(0, 5000, size=bs).astype(np.int64)
    return lp, ids, root, seq


def assert_same(got, ref, fields, context: str) -> None:
    """Exact equality per field: shape, dtype, then the first differing index and both values.
    Floats compare bit for bit (-0.0 is not +0.0)."""
    for f in fields:
        g, r = np.asarray(getattr(got, f)), np.asarray(getattr(ref, f))
        assert g.shape == r.shape, f"{context}: {f}: shape {g.shape} != reference {r.shape}"
        assert g.dtype == r.dtype, f"{context}: {f}: dtype {g.dtype} != reference {r.dtype}"
        if g.dtype.kind == "f":
            bits = np.dtype(f"u{g.dtype.itemsize}")
            diff = np.argwhere(g.view(bits) != r.view(bits))
        else:
            diff = np.argwhere(g != r)
        if len(diff):
            at = tuple(int(v) for v in diff[0])
            raise AssertionError(f"{context}: {f}: {len(diff)} elements differ; first at {at}: "
                                 f"native {g[at]!r} != reference {r[at]!r}")
