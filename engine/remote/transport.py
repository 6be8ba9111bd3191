"""Transports: one interface for running commands and moving files on a host, local or SSH.

    t = open_transport(host, accept_new_host_key=False)   # LocalTransport or SshTransport
    r = t.run(["ls", "-l", "x y"], cwd="src", timeout=60)  # -> RunResult (never raises on exit != 0)
    t.put("a.txt", "runs/x/a.txt"); t.get("runs/x/b.json", "b.json")
    pid = t.spawn_detached(["python3", "-m", "bench"], cwd=..., env=..., log_path=...)
    t.which("rsync") -> bool;  t.remote_dir -> "/home/me/kdtree-engine";  t.close()

Both transports run every command through the same POSIX ``sh`` wrapper (``_wrap``): the
host's ``env`` from the inventory and the call's ``env`` are exported, ``cwd`` is entered, and
the command runs as a child of the wrapper shell, which is the leader of its own process group
(``start_new_session`` locally; sshd gives every exec its own session). A ``timeout`` kills
that whole group (TERM, then KILL after a grace period) and raises ``StepTimeout``; the remote
process never outlives the step (Fabric leaves it running: fabric/fabric#2002).

Paths given to ``run(cwd=)``, ``put``, ``get`` and ``spawn_detached`` may be absolute, ``~/...``
(the host user's home) or relative, which means relative to ``remote_dir``.

``env`` values may reference other variables as ``$NAME`` or ``${NAME}`` (e.g.
``PATH: /opt/x/bin:$PATH``); nothing else in them is expanded.

Errors: ``HostUnreachable`` (connect / auth / link lost), ``HostKeyError``, ``TransferError``
(put / get), ``StepTimeout``. A non-zero exit is not an error here: callers look at
``RunResult.exit_code`` (or ``bool(result)``) and raise what fits their step.
Fabric and Paramiko are imported only by ``engine.remote.ssh``, only for SSH hosts.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal as _signal
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .errors import Interrupted, StepTimeout, TransferError
from .inventory import Host

# on_output(stream, line): stream is "stdout" or "stderr", line has no trailing newline.
OutputCallback = Callable[[str, str], None]
KILL_GRACE_S = 2.0  # between TERM and KILL of a timed-out process group


@dataclass
class RunResult:
    command: str          # the command as given (argv joined with shlex.join)
    exit_code: int        # the wrapper shell's status: 128+N when the command died of signal N;
                          # -1 when the wrapper itself was killed and no status came back
    signal: str | None    # e.g. "SIGSEGV" when the command was killed by a signal
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def __bool__(self) -> bool:
        return self.ok

    def tail(self, n: int = 20) -> str:
        """The last n lines of stderr (else stdout), for error messages."""
        text = self.stderr.strip() or self.stdout.strip()
        return "\n".join(text.splitlines()[-n:])


def command_text(argv_or_script: Sequence[str] | str) -> str:
    """argv lists are quoted with shlex.join; a string is a shell script taken as is."""
    if isinstance(argv_or_script, str):
        return argv_or_script
    return shlex.join([str(a) for a in argv_or_script])


def signal_name(exit_code: int) -> str | None:
    """POSIX shells report death by signal N as 128+N."""
    if 128 < exit_code < 128 + 65:
        try:
            return _signal.Signals(exit_code - 128).name
        except ValueError:
            return f"SIG{exit_code - 128}"
    return None


_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def env_value_sh(value: str) -> str:
    """Quote an env value for sh, expanding only $NAME / ${NAME} references."""
    out, pos = [], 0
    for m in _VAR_RE.finditer(value):
        if m.start() > pos:
            out.append(shlex.quote(value[pos:m.start()]))
        out.append('"${%s}"' % (m.group(1) or m.group(2)))
        pos = m.end()
    if pos < len(value) or not out:
        out.append(shlex.quote(value[pos:]))
    return "".join(out)


def _wrap(command: str, *, cwd: str | None, env: Mapping[str, str], pgid_marker: bool) -> str:
    """The sh script every transport runs. The command is not the last line, so the shell never
    execs it in place: the wrapper stays the process-group leader and reports 128+N on signals."""
    lines = []
    if pgid_marker:  # SSH: tell the client which process group to kill on timeout
        lines.append("printf 'KDT-PGID %s\\n' \"$$\" >&2")
    for key, value in env.items():
        lines.append(f"export {key}={env_value_sh(value)}")
    if cwd:
        lines.append(f"cd {shlex.quote(cwd)} || exit 125")
    lines.append(command)
    lines.append("exit $?")
    return "\n".join(lines) + "\n"


class _LineSink:
    """Collects a stream's bytes and hands complete lines to on_output as they arrive."""

    def __init__(self, name: str, on_output: OutputCallback | None, skip_prefix: bytes | None = None):
        self.name, self.on_output, self.skip_prefix = name, on_output, skip_prefix
        self.chunks: list[bytes] = []
        self.partial = b""
        self.marker_value: str | None = None

    def feed(self, data: bytes) -> None:
        self.partial += data
        while b"\n" in self.partial:
            line, self.partial = self.partial.split(b"\n", 1)
            self._line(line + b"\n")

    def close(self) -> None:
        if self.partial:
            self._line(self.partial)
            self.partial = b""

    def _line(self, raw: bytes) -> None:
        if self.skip_prefix is not None and self.marker_value is None and raw.startswith(self.skip_prefix):
            self.marker_value = raw[len(self.skip_prefix):].decode().strip()
            return
        self.chunks.append(raw)
        if self.on_output:
            self.on_output(self.name, raw.decode("utf-8", "replace").rstrip("\n"))

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


class Transport(ABC):
    """What the pipeline needs from a host. Use as a context manager or call close()."""

    def __init__(self, host: Host):
        self.host = host
        self._remote_dir: str | None = None
        self._home: str | None = None

    # -- the interface ------------------------------------------------------------------------
    @abstractmethod
    def run(self, argv_or_script: Sequence[str] | str, *, cwd: str | None = None,
            env: Mapping[str, str] | None = None, timeout: float | None = None,
            stdin: bytes | str | None = None, on_output: OutputCallback | None = None,
            cancel: threading.Event | None = None) -> RunResult:
        """Run a command (argv list, or a sh script string) on the host. When `cancel` is set
        (Ctrl-C on the client) the command's process group is killed and Interrupted raised."""

    @abstractmethod
    def put(self, local_path: str | Path, remote_path: str) -> None:
        """Copy one local file to the host (temp name + rename: never half-written)."""

    @abstractmethod
    def get(self, remote_path: str, local_path: str | Path) -> None:
        """Copy one file from the host (temp name + rename: never half-written)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def home(self) -> str:
        """The host user's home folder (absolute)."""
        if self._home is None:
            r = self.run('printf "%s" "$HOME"', timeout=self.host.timeouts.connect)
            if not r.ok or not r.stdout.startswith("/"):
                raise TransferError(f"cannot read $HOME on the host: {r.tail()}", host=self.host.name,
                                    step="connect")
            self._home = r.stdout.rstrip("/") or "/"
        return self._home

    @property
    def remote_dir(self) -> str:
        """host.remote_dir, absolute, with ~ expanded on the host."""
        if self._remote_dir is None:
            rd = self.host.remote_dir
            self._remote_dir = self.home + rd[1:] if rd.startswith("~/") else rd
        return self._remote_dir

    def abspath(self, path: str) -> str:
        """Absolute host path for an absolute, ~/..., or remote_dir-relative path."""
        path = str(path)
        if path.startswith("/"):
            return path
        if path == "~" or path.startswith("~/"):
            return self.home + path[1:]
        return f"{self.remote_dir}/{path}"

    def which(self, program: str) -> bool:
        """Whether `program` is on the host's PATH (with the inventory's env applied)."""
        r = self.run(f"command -v {shlex.quote(program)} >/dev/null 2>&1", timeout=self.host.timeouts.connect)
        return r.ok

    def spawn_detached(self, argv: Sequence[str], *, cwd: str, env: Mapping[str, str] | None,
                       log_path: str) -> int:
        """Start argv in its own session (setsid + nohup), output to log_path; returns its pid.
        It survives the end of this connection; the caller tracks it by pid or by its files."""
        log = self.abspath(log_path)
        script = (
            f"mkdir -p {shlex.quote(os.path.dirname(log))} || exit 125\n"
            "if command -v setsid >/dev/null 2>&1; then S=setsid; else S=; fi\n"
            f"nohup $S {command_text(argv)} > {shlex.quote(log)} 2>&1 < /dev/null &\n"
            "echo $!"
        )
        r = self.run(script, cwd=self.abspath(cwd), env=env, timeout=self.host.timeouts.connect)
        if not r.ok or not r.stdout.strip().isdigit():
            raise TransferError(f"could not start {command_text(argv)!r} detached: {r.tail()}",
                                host=self.host.name)
        return int(r.stdout.strip())

    # -- shared helpers -----------------------------------------------------------------------
    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        merged = dict(self.host.env)
        merged.update(env or {})
        return merged

    def _cancelled(self, command: str) -> Interrupted:
        return Interrupted(f"stopped `{_short(command)}` (Ctrl-C); its process group was killed", host=self.host.name)

    def _timeout_error(self, command: str, timeout: float) -> StepTimeout:
        return StepTimeout(f"`{_short(command)}` ran past its {timeout:g} s timeout; its process group was killed",
                           host=self.host.name, hint="if the step needs longer: --timeout STEP=SECONDS for this run, or "
                           f"timeouts.STEP in hosts/{self.host.name}.local.yaml (git-ignored)")


def _short(command: str, n: int = 120) -> str:
    one = " ".join(command.split())
    return one if len(one) <= n else one[: n - 3] + "..."


class LocalTransport(Transport):
    """Runs on this machine (hosts with `transport: local`, e.g. the default and the H200)."""

    def run(self, argv_or_script, *, cwd=None, env=None, timeout=None, stdin=None, on_output=None, cancel=None):
        command = command_text(argv_or_script)
        script = _wrap(command, cwd=self.abspath(cwd) if cwd else None, env=self._env(env), pgid_marker=False)
        start = time.monotonic()
        proc = subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        sinks = {"stdout": _LineSink("stdout", on_output), "stderr": _LineSink("stderr", on_output)}
        lock = threading.Lock()  # on_output is called from two reader threads

        def pump(stream, sink):
            for chunk in iter(lambda: stream.read1(65536), b""):
                with lock:
                    sink.feed(chunk)
            with lock:
                sink.close()

        threads = [threading.Thread(target=pump, args=(proc.stdout, sinks["stdout"]), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, sinks["stderr"]), daemon=True)]
        if stdin is not None:
            data = stdin.encode() if isinstance(stdin, str) else stdin
            threads.append(threading.Thread(target=_feed_stdin, args=(proc.stdin, data), daemon=True))
        for t in threads:
            t.start()
        try:
            if cancel is None:
                proc.wait(timeout=timeout)
            else:  # poll, so that a Ctrl-C (cancel set by the client) stops the command's group
                deadline = None if timeout is None else start + timeout
                while proc.poll() is None:
                    if cancel.is_set():
                        _kill_group(proc.pid, proc)
                        raise self._cancelled(command)
                    if deadline is not None and time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(command, timeout)
                    time.sleep(0.1)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, proc)
            raise self._timeout_error(command, timeout) from None
        finally:
            # A background child may hold the output open: collect for a few seconds at most.
            until = time.monotonic() + 5.0
            for t in threads:
                t.join(timeout=max(0.0, until - time.monotonic()))
        code = proc.returncode
        sig = _signal.Signals(-code).name if code < 0 else signal_name(code)
        return RunResult(command, code if code >= 0 else 128 - code, sig, sinks["stdout"].text(),
                         sinks["stderr"].text(), time.monotonic() - start)

    def put(self, local_path, remote_path):
        _copy_atomic(Path(local_path), Path(self.abspath(remote_path)), self.host.name, "put")

    def get(self, remote_path, local_path):
        _copy_atomic(Path(self.abspath(remote_path)), Path(local_path), self.host.name, "get")

    @property
    def home(self) -> str:
        return os.path.expanduser("~")


def _feed_stdin(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except BrokenPipeError:  # the command exited without reading everything; its status says why
        pass
    finally:
        try:
            pipe.close()
        except BrokenPipeError:
            pass


def _kill_group(pgid: int, proc: subprocess.Popen) -> None:
    """TERM the group, give it KILL_GRACE_S, then KILL whatever of it is left."""
    for sig in (_signal.SIGTERM, _signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def _copy_atomic(src: Path, dst: Path, host: str, step: str) -> None:
    if not src.is_file():
        raise TransferError(f"{step}: {src} is not a file", host=host, step=step)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            shutil.copymode(src, tmp)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise TransferError(f"{step}: {src} -> {dst}: {exc.strerror or exc}", host=host, step=step) from None
