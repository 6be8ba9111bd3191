"""A throwaway sshd on 127.0.0.1, for tests and the pipeline benchmark (never another address).

    with LoopbackSshd() as sshd:                # own host key, client key, authorized_keys, port
        yaml_path = sshd.write_host_yaml(tmp / "hosts" / "loop.yaml", remote_dir=str(tmp / "remote"))
        host = load_host(str(yaml_path), hosts_dir)   # an ssh host that connects to this sshd

The sshd runs from a temp folder with ``ListenAddress 127.0.0.1``, a free ``Port``, its own
``HostKey``, ``AuthorizedKeysFile`` in the folder, password and PAM logins off and a ``PidFile``
(ARCHITECTURE.md "Testing notes"). It is stopped by the pid in its PidFile, never by name.
As root it needs ``/run/sshd``, which ``start`` creates. ``known_hosts`` is a file holding the
line ``[127.0.0.1]:PORT <key type> <base64>`` so strict host-key checking passes.

``path_without(programs, folder)`` builds a bin folder of links to everything on PATH except
the named programs: a host "without rsync" is ``env: {PATH: <that folder>}`` in its YAML.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SSHD = "/usr/sbin/sshd"
LOOPBACK = "127.0.0.1"


def sshd_missing_reason() -> str | None:
    """Why a loopback sshd cannot run here (None when it can)."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is not on PATH (apt-get install openssh-client)"
    return None


def generate_key(path: Path, kind: str = "ed25519") -> Path:
    """A passphrase-less key pair at path / path.pub."""
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "kdtree-loopback", "-f", str(path)],
                   check=True, stdout=subprocess.DEVNULL)
    return path


def known_hosts_line(port: int, pub_key_path: Path) -> str:
    """`[127.0.0.1]:PORT <type> <base64>` for the public key file."""
    kind, b64 = pub_key_path.read_text().split()[:2]
    return f"[{LOOPBACK}]:{port} {kind} {b64}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def path_without(programs: list[str], folder: Path) -> str:
    """A folder of symlinks to every program on this machine's PATH except `programs`."""
    folder.mkdir(parents=True, exist_ok=True)
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(":") + ["/usr/sbin", "/usr/bin", "/bin"]:
        if not os.path.isdir(d):
            continue
        for entry in os.scandir(d):
            link = folder / entry.name
            if entry.name in programs or link.exists() or link.is_symlink():
                continue
            if entry.is_file() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return str(folder)


class LoopbackSshd:
    """An sshd on 127.0.0.1:port, accepting only its own client key, for the current user."""

    def __init__(self, workdir: Path | None = None):
        self._own_tmp = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kdt-sshd-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.user = getpass.getuser()
        self.port: int | None = None
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self.identity_file = self.dir / "id_client"
        self.authorized_keys = self.dir / "authorized_keys"
        self.known_hosts = self.dir / "known_hosts"
        self.config = self.dir / "sshd_config"
        self.pid_file = self.dir / "sshd.pid"
        self.log = self.dir / "sshd.log"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, attempts: int = 5) -> "LoopbackSshd":
        reason = sshd_missing_reason()
        if reason:
            raise RuntimeError(f"loopback sshd: {reason}")
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        if not self.host_key.exists():
            generate_key(self.host_key)
        if not self.identity_file.exists():
            generate_key(self.identity_file)
        shutil.copyfile(self.identity_file.with_suffix(".pub"), self.authorized_keys)
        os.chmod(self.authorized_keys, 0o600)
        last_error = ""
        for _ in range(attempts):  # a free port can be taken between probing and binding
            self.port = _free_port()
            self._write_config()
            self.pid_file.unlink(missing_ok=True)
            r = subprocess.run([SSHD, "-f", str(self.config), "-E", str(self.log)],
                               capture_output=True, text=True)
            if r.returncode == 0 and self._wait_ready(10.0):
                self.known_hosts.write_text(known_hosts_line(self.port, self.host_key.with_suffix(".pub")) + "\n")
                return self
            last_error = (r.stderr + self._log_tail()).strip()
            self.stop()
        raise RuntimeError(f"loopback sshd did not start after {attempts} attempts: {last_error}")

    def _write_config(self) -> None:
        self.config.write_text("\n".join([
            f"ListenAddress {LOOPBACK}",
            f"Port {self.port}",
            f"HostKey {self.host_key}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            f"PidFile {self.pid_file}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",          # keys live in a temp folder
            "Subsystem sftp internal-sftp",
            "MaxSessions 64",
            "MaxStartups 64:30:128",
            "LogLevel VERBOSE",
        ]) + "\n")

    def _wait_ready(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.pid_file.exists():
                try:
                    with socket.create_connection((LOOPBACK, self.port), timeout=1) as s:
                        if s.recv(4).startswith(b"SSH-"):
                            return True
                except OSError:
                    pass
            time.sleep(0.05)
        return False

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-5:])
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        """TERM the daemon by the pid in its PidFile (open sessions are separate processes and end
        when their clients disconnect)."""
        pid = self.pid
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        self.pid_file.unlink(missing_ok=True)

    def __enter__(self) -> "LoopbackSshd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_tmp:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- inventory ------------------------------------------------------------------------------
    def host_fields(self, *, remote_dir: str, **extra) -> dict:
        """Inventory fields for an ssh host that reaches this sshd (extra fields override)."""
        fields = {
            "transport": "ssh",
            "hostname": LOOPBACK,
            "port": self.port,
            "user": self.user,
            "identity_file": str(self.identity_file),
            "known_hosts": str(self.known_hosts),
            "host_key_policy": "strict",
            "remote_dir": remote_dir,
            "cuda_arch": "cpu",
            # the interpreter running the tests: in a virtual environment the system python3
            # may lack the packages the pipeline needs on the "host"
            "python": sys.executable,
            "timeouts": {"connect": 10},
        }
        fields.update(extra)
        return {k: v for k, v in fields.items() if v is not None}

    def write_host_yaml(self, path: Path, *, remote_dir: str, **extra) -> Path:
        """Write hosts YAML for this sshd; the host's name is the file's stem."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.host_fields(remote_dir=remote_dir, **extra), sort_keys=False))
        return path
