"""Shared helpers of the reference-model tests (test_model.py, test_model_decode.py and
test_drafters.py).

`rel_err(out, ref)`: the norm-wise relative error |out - ref| / |ref| in float64 (shapes must
match); each test file states the tolerance it compares it with, and why.
`single_thread_blas`: an autouse, module-scoped fixture; a module that imports it by name runs
with one OpenBLAS thread (engine.reference.model.limit_blas_threads: small matrices, where BLAS
threads only spin).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.reference import model as M


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


@pytest.fixture(autouse=True, scope="module")
def single_thread_blas():
    M.limit_blas_threads(1)
