"""Shared pytest fixtures (area-specific helpers live in each area's test files).

`rng`: a numpy Generator with a fresh, printed seed per test.
`loopback_sshd`: one throwaway sshd on 127.0.0.1 for the whole session (engine/remote/loopback.py),
with its own host key, client key and known_hosts; skipped, with the reason, where no sshd is
installed. Tests that need another "host" write another YAML for the same sshd with its own
remote_dir (`loopback_sshd.write_host_yaml(path, remote_dir=...)`).
"""

from __future__ import annotations

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
