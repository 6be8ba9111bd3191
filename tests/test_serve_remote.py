"""`invoke serve` (engine/remote/serve.py) over the local transport against a deployed-looking
remote folder, and `invoke bench --url` reaching `python -m bench --url` in the plan."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from native_helpers import native

REPO = Path(__file__).resolve().parents[1]


def _host(remote_dir: Path):
    from engine.remote.inventory import parse_host

    return parse_host("lo", {"transport": "local", "remote_dir": str(remote_dir),
                             "cuda_arch": "cpu",
                             "python": sys.executable}, source=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(pid: int) -> None:
    """SIGTERM the server we started (by its pid), then wait until it is gone (bounded)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def deployed(tmp_path):
    """<remote_dir>/src -> this checkout, build/cpu/libkdtree.so -> the local CPU build."""
    lib = Path(native().library().path).resolve()
    rd = tmp_path / "rd"
    (rd / "build" / "cpu").mkdir(parents=True)
    (rd / "src").symlink_to(REPO)
    (rd / "build" / "cpu" / "libkdtree.so").symlink_to(lib)
    return rd


@pytest.mark.native
def test_start_server_on_a_host_then_fail_on_the_taken_port(deployed):
    from engine.remote.serve import ServerFailed, start_server

    host = _host(deployed)
    port = _free_port()
    info = start_server(host, mode="ar", port=port, max_batch=2)
    try:
        assert info.url == f"http://127.0.0.1:{port}" and info.health["mode"] == "ar"
        assert (deployed / "weights" / "tiny" / "config.json").is_file()
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
        req = urllib.request.Request(f"{info.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 4
        assert any(f"kill {info.pid}" in line for line in info.lines())
        # A second server on the same port exits; the error carries its log's tail.
        with pytest.raises(ServerFailed, match="the server exited") as e:
            extra = start_server(host, mode="ar", port=port, max_batch=2)
            _stop(extra.pid)  # reached only when the test is about to fail: leave nothing running
        assert "address already in use" in str(e.value).lower() or str(port) in str(e.value)
    finally:
        _stop(info.pid)


def test_start_server_needs_a_deployed_engine(tmp_path):
    from engine.remote.errors import UsageError
    from engine.remote.serve import start_server

    (tmp_path / "rd").mkdir()
    with pytest.raises(UsageError, match="invoke deploy --host lo"):
        start_server(_host(tmp_path / "rd"), port=_free_port())
    with pytest.raises(UsageError, match="--mode 'beam'"):
        start_server(_host(tmp_path / "rd"), mode="beam")


def test_bench_url_reaches_the_bench_command():
    from engine.remote.plan import Layout, Options, runner_steps_bench

    host = _host(Path("/srv/kd/lo"))
    lay = Layout("/srv/kd/lo", "cpu")
    (step,) = runner_steps_bench(host, lay, "/srv/kd/lo/runs/x",
                                 Options(suite="service", url="http://127.0.0.1:30000"))
    assert step.argv[-2:] == ["--url", "http://127.0.0.1:30000"]
    assert step.argv[step.argv.index("--suite") + 1] == "service"
    (step,) = runner_steps_bench(host, lay, "/srv/kd/lo/runs/x", Options(suite="service"))
    assert "--url" not in step.argv
