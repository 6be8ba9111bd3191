"""End-to-end on the local transport: live progress of a remote run, and Ctrl-C on `invoke bench`.

A real `python -m invoke bench` subprocess on a throwaway local host runs the built-in selftest
bench made slow (KDTREE_SELFTEST_SECONDS, one `progress:` line a second). Without a terminal,
its progress arrives as `[host]`-prefixed lines while it runs; a SIGINT stops the remote run:
exit 130, one `error:` line, the runner's process group gone, the lock released, the manifest
marked interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from e2e_helpers import GIT_ENV, make_clone

pytestmark = pytest.mark.e2e


def _host(tmp_path: Path, seconds: int) -> Path:
    p = tmp_path / "hosts" / "lh.yaml"
    p.parent.mkdir()
    p.write_text(yaml.safe_dump({"transport": "local", "remote_dir": str(tmp_path / "remote"), "cuda_arch": "cpu",
                                 "python": sys.executable, "env": {"KDTREE_SELFTEST_SECONDS": str(seconds)}}))
    return p


def _start(clone: Path, host: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, **GIT_ENV}
    env.pop("KDTREE_LIB", None)
    return subprocess.Popen([sys.executable, "-m", "invoke", "bench", "--host", str(host), "--no-build",
                             "--suite", "selftest", *extra], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def clone(tmp_path):
    return make_clone(tmp_path / "repo")


def test_progress_lines_arrive_while_the_run_goes(clone, tmp_path):
    p = _start(clone, _host(tmp_path, 4), "--json")
    seen_at = None
    t0 = time.monotonic()
    for line in p.stderr:  # read as it comes: the progress must arrive before the end
        if "selftest (1/1) case 1/4" in line and seen_at is None:
            seen_at = time.monotonic() - t0
            assert line.startswith("[lh] ") and "s elapsed" in line and "s left" in line, line
    out = p.stdout.read()
    assert p.wait(timeout=60) == 0
    total = time.monotonic() - t0
    assert seen_at is not None and seen_at < total - 1.5, (seen_at, total)
    doc = json.loads(out)  # --json: stdout stays JSON; the progress went to stderr
    assert doc["exit_code"] == 0 and doc["hosts"][0]["run_ids"]


def test_ctrl_c_stops_the_remote_run_and_exits_130(clone, tmp_path):
    remote = tmp_path / "remote"
    p = _start(clone, _host(tmp_path, 120))
    status = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the runner is on its step
        runs = list((remote / "runs").glob("*-bench/status.json")) if (remote / "runs").is_dir() else []
        if runs:
            status = json.loads(runs[0].read_text())
            if status.get("state") == "running":
                break
        time.sleep(0.2)
    assert status and status["state"] == "running", status
    runner_pid = status["pid"]
    assert (remote / ".lock").is_dir()
    time.sleep(1.0)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    seconds = time.monotonic() - t0
    print(f"Ctrl-C to exit: {seconds:.1f} s; stderr:\n{err}")
    assert p.returncode == 130, (p.returncode, out, err)
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "interrupted: run" in errors[0] and errors[0] == err.strip().splitlines()[-1], err
    assert not _alive(runner_pid), "the runner still runs"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(remote) not in ps, "a process of the run (the runner's group, the bench step) still runs"
    assert not (remote / ".lock").exists(), "the lock was not released"
    (run,) = (remote / "runs").glob("*-bench")
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["state"] == "interrupted" and manifest["ok"] is False, manifest["summary"]
    assert manifest["status"]["bench"]["status"] == "interrupted"
    assert manifest["summary"].startswith("INTERRUPTED")


def test_ctrl_c_on_a_terminal_asks_and_n_leaves_the_run_going(clone, tmp_path):
    """On a terminal Ctrl-C asks "stop the remote run? [y/N]"; N leaves the run going (it
    finishes ok and releases the lock by itself) and the command says how to follow and fetch it."""
    import pty
    import select

    remote = tmp_path / "remote"
    host = _host(tmp_path, 10)
    env = {**os.environ, **GIT_ENV, "TERM": "dumb", "COLUMNS": "200"}
    env.pop("KDTREE_LIB", None)
    pid, fd = pty.fork()
    if pid == 0:  # the child: invoke on the pty's terminal
        os.chdir(clone)
        os.execve(sys.executable, [sys.executable, "-m", "invoke", "bench", "--host", str(host), "--no-build",
                                   "--suite", "selftest"], env)
    buf = b""

    def read_until(pattern: bytes, seconds: float) -> bool:
        nonlocal buf
        end = time.monotonic() + seconds
        while time.monotonic() < end and pattern not in buf:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    buf += os.read(fd, 65536)
                except OSError:
                    return pattern in buf
        return pattern in buf

    try:
        assert read_until(b"runner: step bench (1/1) started", 120), buf.decode(errors="replace")
        os.write(fd, b"\x03")  # Ctrl-C from the terminal
        assert read_until(b"stop the remote run? [y/N]", 30), buf.decode(errors="replace")
        os.write(fd, b"n\n")
        read_until(b"fetch-results", 60)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    text = buf.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "left " in text and "tail -f" in text and "invoke fetch-results --host lh --run" in text, text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list((remote / "runs").glob("*-bench/manifest.json")):
        time.sleep(0.2)
    (m,) = (remote / "runs").glob("*-bench/manifest.json")
    manifest = json.loads(m.read_text())
    assert manifest["ok"] and manifest["state"] == "complete", manifest["summary"]
    time.sleep(1.0)
    assert not (remote / ".lock").exists()
