"""`invoke serve --host H`: start our server (engine/serving/server.py) on a host and print its URL.

    info = start_server(host, mode="ddtree", budget=63, port=8000)
    info.url   # http://127.0.0.1:8000 on the host (ssh -L 8000:127.0.0.1:8000 user@host to reach
               # it from here); info.pid, info.log (host paths), info.health (the /health body)

Runs against what `invoke deploy` put on the host: <remote_dir>/src (the package) and
<remote_dir>/build/<arch>/libkdtree.so. Weights: `weights` (a host path), else the tiny model
in <remote_dir>/weights/tiny, created there once by `python -m engine.cli.model init`. The server
starts detached (transport.spawn_detached: setsid + nohup; it outlives the connection), binds
127.0.0.1 on the host, and logs to <remote_dir>/serve/serve-<port>-<id>.log; start_server returns once
GET /health answers 200 on the host, or raises with the log's tail if the server exits first.
Stop it with `kill <pid>` on the host (SIGTERM: the server finishes its cleanup and exits).
"""

from __future__ import annotations

import json
import shlex
import uuid
from dataclasses import dataclass

from .errors import ConfigError, KdtError, TransferError, UsageError
from .inventory import Host
from .plan import Layout, python_env
from .connect import open_transport
from .transport import Transport

HEALTH_WAIT_S = 300.0  # engine creation, drafter load and a CUDA context on a busy host

# Runs on the host: polls /health until it answers 200 with our instance id (prints the body),
# or the server's pid is gone. Another server already on the port answers with another id.
_WAIT_HEALTH = """
import json, os, sys, time, urllib.request
pid, url, limit, iid = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
end = time.monotonic() + limit
while time.monotonic() < end:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            body = r.read().decode()
        if json.loads(body).get("instance_id") == iid:
            print(body); sys.exit(0)
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(3)
    time.sleep(0.3)
sys.exit(4)
"""


class ServerFailed(KdtError):
    exit_code = 1


@dataclass
class ServeInfo:
    host: str
    url: str     # as seen on the host
    pid: int
    log: str     # host path
    health: dict

    def lines(self) -> list[str]:
        port = self.url.rsplit(":", 1)[1]
        return [f"{self.host}: serving {self.url} (pid {self.pid}, log {self.log})",
                f"{self.host}: mode {self.health.get('mode')}, device {self.health.get('device')}"
                f", model {self.health.get('model')}",
                f"{self.host}: from here: ssh -N -L {port}:127.0.0.1:{port} <host>; stop: "
                f"kill {self.pid} (on the host)"]


def _check(t: Transport, host: Host, lay: Layout) -> None:
    r = t.run(f"test -f {shlex.quote(lay.src)}/engine/serving/server.py && test -f {shlex.quote(lay.lib)}",
              timeout=host.timeouts.connect)
    if not r.ok:
        raise UsageError(f"no deployed engine at {lay.src} with {lay.lib}", host=host.name,
                         step="serve", hint=f"run `invoke deploy --host {host.name}` first")


def _weights(t: Transport, host: Host, lay: Layout, weights: str | None) -> str:
    if weights:
        path = t.abspath(weights)
        if not t.run(f"test -f {shlex.quote(path)}/config.json", timeout=host.timeouts.connect).ok:
            raise ConfigError(f"--weights {weights}: no config.json in {path} on the host",
                              host=host.name, step="serve")
        return path
    path = f"{lay.remote_dir}/weights/tiny"
    if t.run(f"test -f {shlex.quote(path)}/config.json", timeout=host.timeouts.connect).ok:
        return path
    r = t.run([host.python, "-m", "engine.cli.model", "init", "--out", path], cwd=lay.src,
              env=python_env(lay), timeout=host.timeouts.build)
    if not r.ok:
        raise ServerFailed(f"creating the tiny weights in {path} failed: {r.tail(5)}",
                           host=host.name, step="serve")
    return path


def start_server(host: Host, *, mode: str = "ddtree", budget: int = 63, port: int = 8000,
                 device: str | None = None, weights: str | None = None, max_batch: int = 32,
                 accept_new_host_key: bool = False) -> ServeInfo:
    """Start engine.serve on the host (detached), wait for /health, return where it is."""
    if mode not in ("ar", "ddtree"):
        raise UsageError(f"--mode {mode!r}: expected ar or ddtree", host=host.name, step="serve")
    if budget < 1 or not 1 <= port <= 65535 or max_batch < 1:
        raise UsageError(f"--budget {budget} / --port {port} / --max-batch {max_batch}: need "
                         "budget >= 1, a port in 1..65535, max_batch >= 1", host=host.name,
                         step="serve")
    device = device or ("cpu" if host.cuda_arch == "cpu" else "cuda")
    with open_transport(host, accept_new_host_key=accept_new_host_key) as t:
        lay = Layout(t.remote_dir, host.cuda_arch)
        _check(t, host, lay)
        w = _weights(t, host, lay, weights)
        iid = uuid.uuid4().hex
        log = f"{lay.remote_dir}/serve/serve-{port}-{iid[:8]}.log"
        argv = [host.python, "-m", "engine.serving", "--weights", w, "--mode", mode, "--budget",
                str(budget), "--port", str(port), "--bind", "127.0.0.1", "--device", device,
                "--max-batch", str(max_batch), "--instance-id", iid]
        pid = t.spawn_detached(argv, cwd=lay.src, env={**python_env(lay), "KDTREE_LIB": lay.lib},
                               log_path=log)
        url = f"http://127.0.0.1:{port}"
        r = t.run([host.python, "-c", _WAIT_HEALTH, str(pid), url, str(HEALTH_WAIT_S), iid],
                  timeout=HEALTH_WAIT_S + host.timeouts.connect)
        if not r.ok:
            tail = t.run(["tail", "-n", "15", log], timeout=host.timeouts.connect).stdout
            why = {3: "the server exited", 4: f"/health did not answer within {HEALTH_WAIT_S:g} s"}
            raise ServerFailed(f"{why.get(r.exit_code, f'waiting for /health failed ({r.exit_code})')}"
                               f"; {log} ends:\n{tail}", host=host.name, step="serve",
                               hint="a port in use? pick another with --port")
        try:
            health = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise TransferError(f"/health answered something that is not JSON: {r.tail(3)}",
                                host=host.name, step="serve") from None
    return ServeInfo(host.name, url, pid, log, health)
