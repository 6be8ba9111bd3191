"""The SSH transport: Fabric for ~/.ssh/config (alias, ProxyJump, identity), Paramiko channels
for commands, SFTP for files. Imported only when an SSH host is used.

Host keys are checked, unlike Fabric's default (AutoAddPolicy, fabric/fabric#2071): keys come
from the host's ``known_hosts`` (else ssh_config's ``UserKnownHostsFile``, else
``~/.ssh/known_hosts``), for the target and every ProxyJump hop.
- ``strict`` (default): an unknown key or a changed key raises ``HostKeyError`` with the key's
  ``SHA256:`` fingerprint and how to accept it.
- ``accept-new`` (``host_key_policy: accept-new`` or ``--accept-new-host-key``): an unknown key
  is appended to that known_hosts file; a changed key is still refused.

``KDTREE_SSH_CONFIG`` (a path) replaces ``~/.ssh/config`` for this process (tests use it).
Connect timeout is ``host.timeouts.connect`` (never unbounded), keepalive every 15 s.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import posixpath
import secrets
import select
import shlex
import socket
import time
from pathlib import Path

import fabric
import paramiko

from .errors import ConfigError, HostKeyError, HostUnreachable, TransferError
from .inventory import Host
from .transport import KILL_GRACE_S, RunResult, Transport, _LineSink, _wrap, command_text, signal_name

# Paramiko's transport thread logs a failed handshake (a port that is not SSH: "Exception
# (client): Error reading SSH protocol banner" and a traceback); with no handler configured
# Python's last-resort handler prints it to stderr. Our one error line already says it.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

KEEPALIVE_S = 15
EXIT_GRACE_S = 2.0  # after the exit status, how long silent output is awaited before giving up on EOF
_PGID_PREFIX = b"KDT-PGID "


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's `SHA256:<base64, no padding>` fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _known_hosts_name(hostname: str, port: int) -> str:
    return hostname if port == 22 else f"[{hostname}]:{port}"


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by Paramiko for a key not in known_hosts (a changed key raises BadHostKeyException)."""

    def __init__(self, host: Host, known_hosts: Path, accept_new: bool):
        self.host, self.known_hosts, self.accept_new = host, known_hosts, accept_new

    def missing_host_key(self, client, hostname, key):
        fp = fingerprint(key)
        if not self.accept_new:
            where = f" in {self.host.source}" if self.host.source else ""
            raise HostKeyError(
                f"host key of {hostname} is not known ({key.get_name()} {fp}, checked {self.known_hosts})",
                host=self.host.name, step="connect",
                hint=f"verify the fingerprint, then rerun with --accept-new-host-key or set host_key_policy: accept-new{where}")
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class SshTransport(Transport):
    def __init__(self, host: Host, *, accept_new_host_key: bool = False):
        super().__init__(host)
        self.accept_new = accept_new_host_key or host.host_key_policy == "accept-new"
        config_path = os.environ.get("KDTREE_SSH_CONFIG")
        config = fabric.Config(runtime_ssh_path=config_path) if config_path else fabric.Config()
        target = host.ssh_config_alias or host.hostname
        connect_kwargs = {"banner_timeout": host.timeouts.connect, "auth_timeout": host.timeouts.connect}
        if host.identity_file:
            key_path = self._local_path(host.identity_file)
            if not key_path.is_file():
                raise ConfigError(f"{host.source or '<embedded>'}: identity_file: {key_path} does not exist",
                                  host=host.name, step="connect", hint="fix the path, or drop it to use the agent")
            connect_kwargs["key_filename"] = [str(key_path)]
        # The YAML's port wins when the host is addressed directly or the port is not the default.
        port = host.port if (host.hostname and not host.ssh_config_alias) or host.port != 22 else None
        self.conn = fabric.Connection(target, user=host.user, port=port, config=config,
                                      connect_timeout=int(host.timeouts.connect), connect_kwargs=connect_kwargs)
        if host.hostname and host.ssh_config_alias:
            self.conn.host = host.hostname  # alias for settings, explicit address wins
        self.known_hosts = self._known_hosts_path()
        self._sftp = None
        self._connect()

    # -- connection ---------------------------------------------------------------------------
    def _local_path(self, path: str) -> Path:
        p = Path(os.path.expanduser(path))
        if not p.is_absolute() and self.host.source is not None:
            p = self.host.source.parent / p  # relative to the host's YAML file
        return p

    def _known_hosts_path(self) -> Path:
        if self.host.known_hosts:
            return self._local_path(self.host.known_hosts)
        configured = self.conn.ssh_config.get("userknownhostsfile")
        if configured:
            return Path(os.path.expanduser(configured.split()[0]))
        return Path(os.path.expanduser("~/.ssh/known_hosts"))

    def _connect(self) -> None:
        hops, c = [], self.conn
        while isinstance(c, fabric.Connection):  # the target and every ProxyJump hop
            hops.append(c)
            c = c.gateway
        for c in hops:
            keys = c.client.get_host_keys()
            keys.clear()
            if self.known_hosts.exists():
                try:
                    keys.load(str(self.known_hosts))
                except (OSError, paramiko.SSHException) as exc:
                    raise HostKeyError(f"cannot read known_hosts {self.known_hosts}: {exc}",
                                       host=self.host.name, step="connect") from None
            c.client.set_missing_host_key_policy(_HostKeyPolicy(self.host, self.known_hosts, self.accept_new))
        where = f"{self.conn.user}@{self.conn.host}:{self.conn.port}"
        try:
            self.conn.open()
        except HostKeyError:
            raise
        except paramiko.BadHostKeyException as exc:
            name = _known_hosts_name(exc.hostname, self.conn.port)
            raise HostKeyError(
                f"host key of {exc.hostname} CHANGED: known {fingerprint(exc.expected_key)}, offered "
                f"{exc.key.get_name()} {fingerprint(exc.key)} (known_hosts {self.known_hosts})",
                host=self.host.name, step="connect",
                hint=f"if the change is expected, remove the old key: ssh-keygen -R '{name}' -f {self.known_hosts}") from None
        except paramiko.AuthenticationException as exc:
            raise HostUnreachable(f"authentication failed for {where}: {exc}", host=self.host.name, step="connect",
                                  hint="check user and identity_file, or load the key into ssh-agent") from None
        except (socket.timeout, TimeoutError) as exc:
            raise HostUnreachable(f"connect to {where} timed out after {self.host.timeouts.connect:g} s",
                                  host=self.host.name, step="connect",
                                  hint="is the host up and reachable? raise timeouts.connect if it is slow") from None
        except socket.gaierror as exc:
            alias = self.host.ssh_config_alias
            if alias and not self.host.hostname and self.conn.host == alias:
                what = (f"cannot resolve {alias!r}: it is the host's ssh_config_alias, and ~/.ssh/config "
                        f"has no `Host {alias}` entry with a HostName ({exc.strerror})")
                hint = f"add `Host {alias}` with `HostName` to ~/.ssh/config, or set hostname in {self.host.source}"
            else:
                origin = "hostname" if self.host.hostname else f"ssh_config_alias {alias!r} -> HostName"
                what = f"cannot resolve the host name {self.conn.host!r} ({origin}; {exc.strerror})"
                hint = f"check the name in {self.host.source or 'the host file'} and this machine's DNS"
            raise HostUnreachable(what, host=self.host.name, step="connect", hint=hint) from None
        except paramiko.SSHException as exc:
            msg = str(exc)
            if "protocol banner" in msg:
                msg = f"{where} does not speak SSH (no SSH banner: {msg})"
            raise HostUnreachable(f"cannot connect to {where}: {msg}" if "does not speak" not in msg else msg,
                                  host=self.host.name, step="connect",
                                  hint="check hostname/port or the ssh_config alias") from None
        except (OSError, EOFError) as exc:
            raise HostUnreachable(f"cannot connect to {where}: {exc}", host=self.host.name, step="connect",
                                  hint="check hostname/port or the ssh_config alias") from None
        for c in hops:
            if c.transport is not None:
                c.transport.set_keepalive(KEEPALIVE_S)

    def _transport(self) -> paramiko.Transport:
        t = self.conn.transport
        if t is None or not t.is_active():
            raise HostUnreachable("the SSH connection was lost", host=self.host.name,
                                  hint="rerun; a detached run keeps going on the host")
        return t

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        self.conn.close()

    def ssh_command(self) -> tuple[list[str], str]:
        """(OpenSSH argv, target) reaching the same host with the same keys and host-key file, for
        tools that spawn ssh themselves (rsync -e). Strict checking: this transport has already
        verified (or, with accept-new, recorded) the host key in that file."""
        h = self.host
        argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", f"ConnectTimeout={int(h.timeouts.connect)}", "-o", f"ServerAliveInterval={KEEPALIVE_S}"]
        config_path = os.environ.get("KDTREE_SSH_CONFIG")
        if config_path:
            argv += ["-F", config_path]
        if h.identity_file:
            argv += ["-i", str(self._local_path(h.identity_file)), "-o", "IdentitiesOnly=yes"]
        if h.user:
            argv += ["-l", h.user]
        if h.hostname and not h.ssh_config_alias or h.port != 22:
            argv += ["-p", str(h.port)]
        if h.hostname and h.ssh_config_alias:
            argv += ["-o", f"HostName={h.hostname}"]
        return argv, h.ssh_config_alias or h.hostname

    # -- commands -----------------------------------------------------------------------------
    def run(self, argv_or_script, *, cwd=None, env=None, timeout=None, stdin=None, on_output=None, cancel=None):
        command = command_text(argv_or_script)
        script = _wrap(command, cwd=self.abspath(cwd) if cwd else None, env=self._env(env), pgid_marker=True)
        start = time.monotonic()
        try:
            chan = self._transport().open_session(timeout=self.host.timeouts.connect)
            chan.exec_command("exec /bin/sh -c " + shlex.quote(script))
        except paramiko.SSHException as exc:
            raise HostUnreachable(f"cannot start a command: {exc}", host=self.host.name) from None
        out = _LineSink("stdout", on_output)
        err = _LineSink("stderr", on_output, skip_prefix=_PGID_PREFIX)
        if stdin is not None:
            data = stdin.encode() if isinstance(stdin, str) else stdin
            self._send_stdin(chan, data, out, err)
        else:
            chan.shutdown_write()
        deadline = None if timeout is None else start + timeout
        fd = chan.fileno()  # readable when stdout or stderr data (or EOF) arrives
        last_data = time.monotonic()
        while True:
            if self._drain(chan, out, err):
                last_data = time.monotonic()
            if chan.eof_received:  # all output is in; the exit status follows
                if chan.status_event.wait(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
                    self._drain(chan, out, err)
                    break
            elif chan.exit_status_ready() and time.monotonic() - last_data > EXIT_GRACE_S:
                # sshd may send the exit status before the last output, so output is awaited until
                # EOF; but a background child can hold the output open forever: stop once it has
                # been silent for EXIT_GRACE_S after the exit.
                break
            if chan.closed:
                break  # closed without EOF: no exit status will come (handled below)
            if deadline is not None and time.monotonic() > deadline:
                self._kill_remote_group(err.marker_value)
                chan.close()
                raise self._timeout_error(command, timeout)
            if cancel is not None and cancel.is_set():  # Ctrl-C on the client
                self._kill_remote_group(err.marker_value)
                chan.close()
                raise self._cancelled(command)
            if not self._transport().is_active():
                raise HostUnreachable(f"connection lost while running `{command[:80]}`", host=self.host.name)
            if not chan.eof_received:
                wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
                select.select([fd], [], [], wait)
        out.close(), err.close()
        code = chan.recv_exit_status()
        chan.close()
        if code == -1:  # no exit-status: the link dropped, or the wrapper shell itself was killed
            self._transport()  # raises HostUnreachable when the link is gone
            # Paramiko ignores the "exit-signal" message, so the signal's name is not known.
            return RunResult(command, -1, "unknown (killed; sshd sent no exit status)", out.text(), err.text(),
                             time.monotonic() - start)
        return RunResult(command, code, signal_name(code), out.text(), err.text(), time.monotonic() - start)

    @staticmethod
    def _drain(chan, out: _LineSink, err: _LineSink) -> bool:
        got = False
        while chan.recv_ready():
            out.feed(chan.recv(65536))
            got = True
        while chan.recv_stderr_ready():
            err.feed(chan.recv_stderr(65536))
            got = True
        return got

    def _send_stdin(self, chan, data: bytes, out: _LineSink, err: _LineSink) -> None:
        """Send stdin in window-sized pieces, draining output between them so neither side stalls."""
        view = memoryview(data)
        while view:
            if chan.send_ready():
                n = chan.send(view[:65536])
                view = view[n:]
            else:
                if not self._drain(chan, out, err):
                    if chan.exit_status_ready() or chan.closed:
                        break  # the command exited without reading everything
                    time.sleep(0.001)
        chan.shutdown_write()

    def _kill_remote_group(self, pgid: str | None) -> None:
        if not pgid or not pgid.isdigit():
            return
        kill = (f"kill -TERM -- -{pgid} 2>/dev/null; sleep {KILL_GRACE_S:g}; "
                f"kill -KILL -- -{pgid} 2>/dev/null; true")
        try:
            chan = self._transport().open_session(timeout=self.host.timeouts.connect)
            chan.exec_command(kill)
            chan.recv_exit_status()
            chan.close()
        except (paramiko.SSHException, HostUnreachable, OSError):
            pass  # the link is gone; the caller raises StepTimeout anyway

    # -- files --------------------------------------------------------------------------------
    def _sftp_client(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            try:
                self._sftp = self.conn.client.open_sftp()
            except (paramiko.SSHException, OSError) as exc:
                raise TransferError(f"cannot open SFTP: {exc}", host=self.host.name,
                                    hint="the host's sshd needs an sftp Subsystem") from None
        return self._sftp

    def put(self, local_path, remote_path):
        local_path = Path(local_path)
        dst = self.abspath(remote_path)
        if not local_path.is_file():
            raise TransferError(f"put: {local_path} is not a file", host=self.host.name, step="put")
        tmp = f"{posixpath.dirname(dst)}/.{posixpath.basename(dst)}.{secrets.token_hex(4)}.part"
        mkdir = self.run(["mkdir", "-p", posixpath.dirname(dst)], timeout=self.host.timeouts.connect)
        if not mkdir.ok:
            raise TransferError(f"put: cannot create {posixpath.dirname(dst)}: {mkdir.tail()}",
                                host=self.host.name, step="put")
        sftp = self._sftp_client()
        try:
            sftp.put(str(local_path), tmp)
            sftp.chmod(tmp, local_path.stat().st_mode & 0o777)
            sftp.posix_rename(tmp, dst)
        except (OSError, paramiko.SSHException) as exc:
            try:
                sftp.remove(tmp)
            except (OSError, paramiko.SSHException):
                pass
            raise TransferError(f"put: {local_path} -> {dst}: {exc}", host=self.host.name, step="put") from None

    def get(self, remote_path, local_path):
        src = self.abspath(remote_path)
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.with_name(f".{local_path.name}.{secrets.token_hex(4)}.part")
        try:
            self._sftp_client().get(src, str(tmp))
            os.replace(tmp, local_path)
        except (OSError, paramiko.SSHException) as exc:
            raise TransferError(f"get: {src} -> {local_path}: {exc}", host=self.host.name, step="get") from None
        finally:
            tmp.unlink(missing_ok=True)


