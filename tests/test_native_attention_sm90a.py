"""The Hopper (sm_90a, wgmma) verify-attention path against the float64 reference.

Fresh random bf16 inputs at the MLA shape for every case of bench/sm90a_attention.py's CHECKS
(ragged batches, trees and prefixes that are not multiples of the 64-row tile, prefix 0, split
and unsplit key ranges, head counts 16 / 20 / 64 / 128), through kdt_verify_attention with
KDT_VERIFY_PATH=sm90a, against the float64 GPU reference of that module (itself checked against
engine.reference.mla below). Bound: max |x - ref| / max |ref| < 1e-2.
Skips without a compute capability 9.0 GPU or a library built with sm_90a.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def setup():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the sm90a path needs an sm_90 GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"compute capability {torch.cuda.get_device_capability()}: the sm90a path "
                    "runs on 9.0 only")
    from bench.sm90a_attention import load_library

    return torch, load_library(None)


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """The bench helpers set KDT_VERIFY_PATH; give later tests theirs back."""
    monkeypatch.setenv("KDT_VERIFY_PATH", "sm90a")


def _cases():
    from bench.sm90a_attention import CHECKS

    return CHECKS


@pytest.mark.parametrize("name,H,prefixes,trees", _cases(), ids=[c[0] for c in _cases()])
def test_sm90a_matches_reference(setup, name, H, prefixes, trees):
    from bench.sm90a_attention import TOL, Case, check_case

    torch, lib = setup
    seed = int(np.random.SeedSequence().entropy % 2**32)
    case = Case(torch, np.random.default_rng(seed), H, prefixes, trees)
    try:
        e_out, e_lse = check_case(lib, case)
    except RuntimeError as e:
        if "no sm_90a code" in str(e):
            pytest.skip(str(e))
        raise
    assert e_out < TOL and e_lse < TOL, (
        f"{name}: out rel err {e_out:.3g}, lse rel err {e_lse:.3g} (tol {TOL}); seed {seed}")


def test_gpu_reference_matches_engine_reference(setup):
    from bench.sm90a_attention import Case, reference_agreement

    torch, _ = setup
    case = Case(torch, np.random.default_rng(), 4, [5, 0, 40], [3, 7, 33])
    vis = case.vis_np.copy()
    vis[4] = 0  # node 1 of request 1 (no prefix) sees nothing
    case.set_visibility(vis)
    assert reference_agreement(case) < 1e-9
