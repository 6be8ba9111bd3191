"""Shared pytest fixtures (area-specific helpers live in each area's test files).

`rng`: a numpy Generator with a fresh, printed seed per test.
`seed`: a fresh, printed seed (an int) per module, for module-scoped models built from it.
`loopback_sshd`: one throwaway sshd on 127.0.0.1 for the whole session (engine/remote/loopback.py),
with its own host key, client key and known_hosts; skipped, with the reason, where no sshd is
installed. Tests that need another "host" write another YAML for the same sshd with its own
remote_dir (`loopback_sshd.write_host_yaml(path, remote_dir=...)`).
`quick_weights`: a weights cache (a KDTREE_CACHE folder) holding what the --quick e2e and service
suites use on the CPU: the tiny model, its quick-trained block drafter and the code-small toy,
made once for the session through bench/weights.py's real paths. Tests that only need those
weights present call `quick_weights(their_cache)`, which copies them in, so the session
trains them once instead of once per test; tests of training and caching themselves start
from an empty cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.remote.loopback import LoopbackSshd, sshd_missing_reason


@pytest.fixture(scope="session")
def loopback_sshd(tmp_path_factory):
    reason = sshd_missing_reason()
    if reason:
        pytest.skip(f"loopback sshd unavailable: {reason}")
    sshd = LoopbackSshd(tmp_path_factory.mktemp("sshd"))
    sshd.start()  # a failure to start is an error, not a skip: sshd is installed but broken
    try:
        yield sshd
    finally:
        sshd.stop()


@pytest.fixture
def rng():
    """A generator with a fresh seed on every test (STYLE.md: fresh random inputs each run); the
    seed is printed, so pytest shows it with a failure and the case can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed = {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def seed():
    """A fresh seed per module, printed like rng's, for module-scoped fixtures (a model's
    weights) and the inputs tests derive from it."""
    s = int(np.random.SeedSequence().entropy % (2**31))
    print(f"seed = {s}")
    return s


@pytest.fixture(scope="session")
def quick_weights(tmp_path_factory):
    """put(cache): copies the --quick suites' CPU weights (see the module docstring) into the
    KDTREE_CACHE folder `cache`; they are made on first use, once for the session. Copies, not
    links: a test may damage its own."""
    from native_helpers import native

    from bench import models as bm

    native()  # the drafter's training data comes from the native engine (built if stale)
    made = tmp_path_factory.mktemp("quick-weights")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_CACHE", str(made))
        bm.tiny(True, "cpu")  # the seeded tiny model and its quick-trained drafter
        bm.code_small("cpu", True)  # the code-small toy and its drafter

    def put(cache: Path) -> None:
        shutil.copytree(made / "weights", Path(cache) / "weights", dirs_exist_ok=True)
    return put
