"""Shared pytest fixtures (area-specific helpers live in each area's test files).

`loopback_sshd`: one throwaway sshd on 127.0.0.1 for the whole session (engine/remote/loopback.py),
with its own host key, client key and known_hosts; skipped, with the reason, where no sshd is
installed. Tests that need another "host" write another YAML for the same sshd with its own
remote_dir (`loopback_sshd.write_host_yaml(path, remote_dir=...)`).
"""

from __future__ import annotations

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
