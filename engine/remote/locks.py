"""`<remote_dir>/.lock`: held while a step changes the remote folder (sync, build, a run).

The lock is a directory (mkdir is atomic on every POSIX file system) holding `owner.json`:

    {"token", "holder": "user@client-host pid N", "purpose": "deploy", "client_host",
     "client_pid", "host_pid": pid on the host or null, "since": UTC, "expires": epoch seconds}

    with RemoteLock(transport, purpose="deploy", wait_s=600, log=print):
        ...                                     # sync and build

A second client waits, printing the holder once, and raises LockTimeout after wait_s. A lock
is stale, and is broken (renamed away, then removed), when its `expires` has passed, when its
`host_pid` (a detached runner) is gone on the host, or when its client runs on this machine
and that pid is gone (a killed `invoke`). `handoff(pid)` gives the lock to a detached runner,
which releases it after its manifest (engine/remote/runner.py release_lock).
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import socket
import time
import uuid
from typing import Callable

from .errors import KdtError, LockTimeout, TransferError
from .transport import Transport

LOCK_NAME = ".lock"
POLL_S = 1.0
ACQUIRED = "KDT-LOCK-ACQUIRED"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RemoteLock:
    def __init__(self, transport: Transport, *, purpose: str, wait_s: float, hold_s: float,
                 log: Callable[[str], None] = print, step: str = "lock"):
        """hold_s: how long the holder may keep it before others may break it (expiry)."""
        self.t = transport
        self.path = f"{transport.remote_dir}/{LOCK_NAME}"
        self.purpose, self.wait_s, self.hold_s, self.log, self.step = purpose, wait_s, hold_s, log, step
        self.token = uuid.uuid4().hex
        self.held = False
        self.handed_off = False

    def owner(self, host_pid: int | None = None) -> dict:
        me = f"{getpass.getuser()}@{socket.gethostname()}"
        return {"token": self.token, "holder": f"{me} pid {os.getpid()}", "purpose": self.purpose,
                "client_host": socket.gethostname(), "client_pid": os.getpid(), "host_pid": host_pid,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "expires": time.time() + self.hold_s}

    def _run(self, script: str, stdin: str | None = None):
        r = self.t.run(script, stdin=stdin, timeout=self.t.host.timeouts.connect)
        if r.exit_code not in (0, 1):
            raise TransferError(f"lock {self.path}: {r.tail()}", host=self.t.host.name, step=self.step)
        return r

    def _try(self) -> dict | None:
        """None when acquired, else the current owner (possibly {} while it is being written)."""
        q = shlex.quote(self.path)
        script = (f"mkdir -p {shlex.quote(self.t.remote_dir)} || exit 3\n"
                  f"if mkdir {q} 2>/dev/null; then cat > {q}/owner.json && echo {ACQUIRED}; exit 0; fi\n"
                  f"cat {q}/owner.json 2>/dev/null; exit 1")
        r = self._run(script, stdin=json.dumps(self.owner()))
        if ACQUIRED in r.stdout:
            return None
        try:
            return json.loads(r.stdout) if r.stdout.strip() else {}
        except ValueError:
            return {}

    def _stale(self, owner: dict) -> str | None:
        """Why the owner's lock is stale, or None while it is live."""
        if not owner:
            return None
        if owner.get("expires", float("inf")) < time.time():
            return f"it expired at {time.strftime('%H:%M:%SZ', time.gmtime(owner['expires']))}"
        pid = owner.get("host_pid")
        if pid:
            r = self._run(f"kill -0 {int(pid)} 2>/dev/null")
            return None if r.ok else f"its process {pid} on the host is gone"
        if owner.get("client_host") == socket.gethostname() and owner.get("client_pid"):
            if not _pid_alive(int(owner["client_pid"])):
                return f"its client (pid {owner['client_pid']} on this machine) is gone"
        return None

    def acquire(self) -> None:
        deadline = time.monotonic() + self.wait_s
        told = None
        while True:
            owner = self._try()
            if owner is None:
                self.held = True
                return
            why = self._stale(owner)
            if why:
                self.log(f"breaking the stale lock {self.path} held by {owner.get('holder')} "
                         f"for {owner.get('purpose')}: {why}")
                q = shlex.quote(self.path)
                self._run(f"mv {q} {q}.stale.$$ 2>/dev/null && rm -rf {q}.stale.$$; exit 0")
                continue
            desc = (f"{owner.get('holder', 'another client')} ({owner.get('purpose', '?')}, since "
                    f"{owner.get('since', '?')})")
            if time.monotonic() >= deadline:
                raise LockTimeout(f"{self.path} is held by {desc}; waited {self.wait_s:g} s",
                                  host=self.t.host.name, step=self.step,
                                  hint="wait for it to finish; if that process is gone, remove the folder")
            if desc != told:
                self.log(f"waiting for {self.path}: held by {desc}")
                told = desc
            time.sleep(POLL_S)

    def handoff(self, host_pid: int) -> dict:
        """Give the lock to a detached runner (host_pid); it releases the lock when done."""
        q = shlex.quote(self.path)
        # The runner may already have finished and released it: then there is nothing to hand.
        self._run(f"[ -d {q} ] || exit 0\ncat > {q}/owner.json.tmp && mv {q}/owner.json.tmp {q}/owner.json",
                  stdin=json.dumps(self.owner(host_pid)))
        self.handed_off = True
        return {"path": self.path, "token": self.token}

    def release(self) -> None:
        if not self.held or self.handed_off:
            return
        q = shlex.quote(self.path)
        tok = shlex.quote(f'"token": "{self.token}"')
        try:
            self._run(f"grep -qF {tok} {q}/owner.json 2>/dev/null || exit 0\n"
                      f"mv {q} {q}.released.$$ && rm -rf {q}.released.$$")
        except KdtError as e:  # the link is gone: say so, never mask the error that got us here
            self.log(f"could not release {self.path} ({e.what}); it expires, or its holder's "
                     "absence is noticed, on the next attempt")
        self.held = False

    def __enter__(self) -> "RemoteLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
