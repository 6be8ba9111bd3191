"""<remote_dir>/.lock (engine/remote/locks.py) over the local transport."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from engine.remote import locks
from engine.remote.errors import LockTimeout
from engine.remote.inventory import parse_host
from engine.remote.transport import LocalTransport


def owner_of(t) -> dict:
    return json.loads(Path(t.remote_dir, ".lock", "owner.json").read_text())


@pytest.fixture
def transport(tmp_path):
    host = parse_host("lk", {"transport": "local", "remote_dir": str(tmp_path / "rd"), "cuda_arch": "cpu"}, source=None)
    return LocalTransport(host)


def test_second_holder_waits_naming_the_holder_then_times_out(transport, monkeypatch):
    monkeypatch.setattr(locks, "POLL_S", 0.05)
    first = locks.RemoteLock(transport, purpose="deploy", wait_s=1, hold_s=600)
    first.acquire()
    owner = owner_of(transport)
    assert owner["purpose"] == "deploy" and owner["token"] == first.token
    said = []
    second = locks.RemoteLock(transport, purpose="test run", wait_s=0.3, hold_s=600, log=said.append)
    t0 = time.monotonic()
    with pytest.raises(LockTimeout) as e:
        second.acquire()
    assert time.monotonic() - t0 >= 0.3
    assert e.value.exit_code == 3 and "deploy" in str(e.value) and owner["holder"] in str(e.value)
    assert len(said) == 1 and said[0].startswith("waiting for") and owner["holder"] in said[0]
    first.release()
    with second:
        assert owner_of(transport)["token"] == second.token
    assert not list(Path(transport.remote_dir).glob(".lock*"))


def test_release_leaves_someone_elses_lock_alone(transport):
    a = locks.RemoteLock(transport, purpose="a", wait_s=1, hold_s=600)
    a.acquire()
    b = locks.RemoteLock(transport, purpose="b", wait_s=1, hold_s=600)
    b.held = True  # pretend: b thinks it holds the lock, a really does
    b.release()
    assert owner_of(transport)["token"] == a.token


def test_stale_locks_are_broken(transport, monkeypatch):
    monkeypatch.setattr(locks, "POLL_S", 0.05)
    said = []
    # 1. expired
    old = locks.RemoteLock(transport, purpose="old", wait_s=1, hold_s=-1)
    old.acquire()
    new = locks.RemoteLock(transport, purpose="new", wait_s=2, hold_s=600, log=said.append)
    new.acquire()
    assert "expired" in said[-1]
    new.release()
    # 2. its client on this machine is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    ghost = locks.RemoteLock(transport, purpose="ghost", wait_s=1, hold_s=600)
    monkeypatch.setattr(ghost, "owner", lambda host_pid=None: {**locks.RemoteLock.owner(ghost, host_pid), "client_pid": dead.pid})
    ghost.acquire()
    new = locks.RemoteLock(transport, purpose="new", wait_s=2, hold_s=600, log=said.append)
    new.acquire()
    assert f"pid {dead.pid}" in said[-1]
    # 3. handed to a detached process on the host that is gone
    sleeper = subprocess.Popen(["sleep", "30"])
    new.handoff(sleeper.pid)
    third = locks.RemoteLock(transport, purpose="third", wait_s=0.3, hold_s=600, log=said.append)
    with pytest.raises(LockTimeout):
        third.acquire()  # the detached holder is alive: wait, then time out
    sleeper.kill()
    sleeper.wait()
    third.wait_s = 2
    third.acquire()
    assert f"process {sleeper.pid} on the host is gone" in said[-1]
    third.release()


def test_a_running_runner_keeps_the_lock_when_its_client_is_killed(transport, monkeypatch):
    """Seen on the H200: `timeout` killed an attached `invoke bench`, its runner went on, and the
    next bench broke the 'stale' lock and ran beside it. The runner now claims the lock."""
    from engine.remote.runner import claim_lock, release_lock

    monkeypatch.setattr(locks, "POLL_S", 0.05)
    dead = subprocess.Popen(["true"])
    dead.wait()
    client = locks.RemoteLock(transport, purpose="bench run", wait_s=1, hold_s=600)
    monkeypatch.setattr(client, "owner",
                        lambda host_pid=None: {**locks.RemoteLock.owner(client, host_pid), "client_pid": dead.pid})
    client.acquire()
    lock = {"path": str(Path(transport.remote_dir, ".lock")), "token": client.token}
    claim_lock(lock)  # what the runner does first; here the runner is this (live) process
    assert owner_of(transport)["host_pid"] > 0
    second = locks.RemoteLock(transport, purpose="bench run", wait_s=0.3, hold_s=600)
    with pytest.raises(LockTimeout):
        second.acquire()  # the client is gone but the run is not: wait
    claim_lock({**lock, "token": "someone else's"})  # a foreign token changes nothing
    assert owner_of(transport)["token"] == client.token
    release_lock(lock)  # the runner, after its manifest
    second.wait_s = 2
    with second:
        assert owner_of(transport)["token"] == second.token
