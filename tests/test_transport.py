"""Transports: the same behaviour from LocalTransport and SshTransport (against the loopback sshd),
then what only SSH has: host keys, unreachable hosts, ssh_config aliases."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.remote.errors import HostKeyError, HostUnreachable, StepTimeout, TransferError
from engine.remote.inventory import load_host, parse_host
from engine.remote.loopback import generate_key, known_hosts_line
from engine.remote.connect import open_transport
from engine.remote.transport import LocalTransport, env_value_sh

HOSTS = Path(__file__).resolve().parents[1] / "hosts"
HOSTILE = ["a b", "$(touch PWNED)", "`touch PWNED`", "'", '"', "\\", "; touch PWNED", "*", "-n", "", "x\ny", "$HOME", "é ü"]


def ssh_host(sshd, tmp_path: Path, name: str = "loop", **extra):
    path = sshd.write_host_yaml(tmp_path / "hosts" / f"{name}.yaml", remote_dir=str(tmp_path / "remote"), **extra)
    return load_host(str(path), HOSTS)


def local_host(tmp_path: Path, **extra):
    return parse_host("loc", dict({"transport": "local", "remote_dir": str(tmp_path / "remote"), "cuda_arch": "cpu"}, **extra),
                      source=None)


@pytest.fixture(params=["local", "ssh"])
def make_transport(request, tmp_path):
    """A factory: make_transport(**host_fields) -> an open transport of the parametrized kind."""
    opened = []

    def make(**extra):
        if request.param == "local":
            t = open_transport(local_host(tmp_path, **extra))
        else:
            t = open_transport(ssh_host(request.getfixturevalue("loopback_sshd"), tmp_path, **extra))
        opened.append(t)
        return t

    yield make
    for t in opened:
        t.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_run_quotes_hostile_argv(make_transport, tmp_path):
    t = make_transport()
    r = t.run(["printf", "%s\\0"] + HOSTILE, cwd=str(tmp_path))
    assert r.ok, r
    assert r.stdout.split("\0")[:-1] == HOSTILE
    assert not (tmp_path / "PWNED").exists()
    assert r.command.startswith("printf ") and r.signal is None and r.seconds >= 0


def test_run_script_exit_cwd_env(make_transport, tmp_path):
    t = make_transport(env={"KDT_A": "from-host", "KDT_P": "${HOME}/x:$KDT_A", "KDT_Q": "$(touch PWNED) '\""})
    (tmp_path / "remote" / "sub").mkdir(parents=True)
    r = t.run('pwd; printf "%s|%s|%s|%s\\n" "$KDT_A" "$KDT_P" "$KDT_Q" "$KDT_B"; echo oops >&2; exit 7',
              cwd="sub", env={"KDT_B": "call env", "KDT_A": "call wins"})
    assert r.exit_code == 7 and not r and r.signal is None
    home = t.home
    assert r.stdout.splitlines() == [str(tmp_path / "remote" / "sub"),
                                     f"call wins|{home}/x:call wins|$(touch PWNED) '\"|call env"]
    assert r.stderr == "oops\n" and r.tail() == "oops"
    assert not list(tmp_path.rglob("PWNED"))


def test_run_missing_cwd_fails_clearly(make_transport):
    r = make_transport().run(["true"], cwd="/nonexistent/kdt")
    assert r.exit_code == 125 and "nonexistent" in r.stderr


def test_stdin_and_streaming_output(make_transport):
    t = make_transport()
    data = os.urandom(3 * 1024 * 1024 + 17)
    r = t.run("sha256sum", stdin=data)
    assert r.ok and r.stdout.split()[0] == hashlib.sha256(data).hexdigest()
    seen = []
    r = t.run("echo one; echo two >&2; printf three", on_output=lambda s, line: seen.append((s, line)))
    assert sorted(seen) == [("stderr", "two"), ("stdout", "one"), ("stdout", "three")]
    assert r.stdout == "one\nthree" and r.stderr == "two\n"


def test_signal_is_reported(make_transport):
    r = make_transport().run("sh -c 'kill -SEGV $$'; status=$?; exit $status")
    assert (r.exit_code, r.signal) == (139, "SIGSEGV")


def test_timeout_kills_the_process_group(make_transport, tmp_path):
    t = make_transport()
    pids = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(StepTimeout) as err:
        t.run(f"sleep 300 & echo $! > {pids}; sh -c 'echo $$ >> {pids}; exec sleep 301' & wait", timeout=1.0)
    assert time.monotonic() - start < 15
    assert err.value.exit_code == 3 and err.value.host == t.host.name and "timeout" in str(err.value)
    recorded = [int(p) for p in pids.read_text().split()]
    assert len(recorded) == 2
    deadline = time.monotonic() + 5
    while any(alive(p) for p in recorded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in recorded if alive(p)], "a timed-out step left processes running"
    assert t.run(["true"]).ok  # the transport is still usable after a timeout


def test_put_get_atomic(make_transport, tmp_path):
    t = make_transport()
    src = tmp_path / "payload.bin"
    data = os.urandom(200_001)
    src.write_bytes(data)
    src.chmod(0o750)
    t.put(src, "deep/er/payload.bin")
    there = tmp_path / "remote" / "deep" / "er" / "payload.bin"
    assert there.read_bytes() == data and there.stat().st_mode & 0o777 == 0o750
    back = tmp_path / "back" / "p.bin"
    t.get(f"{t.remote_dir}/deep/er/payload.bin", back)
    assert back.read_bytes() == data
    assert not [p for p in tmp_path.rglob("*.part")]
    with pytest.raises(TransferError) as err:
        t.get("deep/missing.bin", tmp_path / "m.bin")
    assert "missing.bin" in str(err.value) and not (tmp_path / "m.bin").exists()
    with pytest.raises(TransferError):
        t.put(tmp_path / "absent", "x")


def test_remote_dir_and_which(make_transport, tmp_path):
    t = make_transport()
    assert t.remote_dir == str(tmp_path / "remote")
    assert t.which("sh") and not t.which("kdt-no-such-program-xyz")
    assert t.abspath("~/a") == t.home + "/a" and t.abspath("rel/x") == f"{t.remote_dir}/rel/x"


def test_spawn_detached_survives_close(make_transport, tmp_path):
    t = make_transport()
    (tmp_path / "remote").mkdir(exist_ok=True)
    pid = t.spawn_detached(["sh", "-c", "sleep 1; echo done; ps -o sid= -p $$"], cwd=".", env={"K": "v"},
                           log_path="logs/detached.log")
    t.close()
    log = tmp_path / "remote" / "logs" / "detached.log"
    deadline = time.monotonic() + 20
    while len((log.read_text() if log.exists() else "").split()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = log.read_text().split()
    assert lines[0] == "done"
    assert int(lines[1]) == pid, "the detached process should lead its own session"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12), min_size=1, max_size=6),
       st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0$"), max_size=20))
def test_local_quoting_roundtrip(tmp_path, args, value):
    t = LocalTransport(local_host(tmp_path))
    r = t.run(["printf", "%s\\0"] + args + ["--"], env={"KDT_V": value})
    assert r.ok and r.stdout.split("\0")[:-1] == args + ["--"]
    r = t.run('printf "%s" "$KDT_V"', env={"KDT_V": value})
    assert r.stdout == value
    assert env_value_sh(value)  # never empty: an empty value is ''


# --- SSH only -------------------------------------------------------------------------------------

def fingerprint_of(pub: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(pub)], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]


def test_strict_refuses_unknown_key(loopback_sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    host = ssh_host(loopback_sshd, tmp_path, known_hosts=str(kh))
    with pytest.raises(HostKeyError) as err:
        open_transport(host)
    msg = str(err.value)
    assert fingerprint_of(loopback_sshd.host_key.with_suffix(".pub")) in msg
    assert "--accept-new-host-key" in msg and "host_key_policy: accept-new" in msg and str(kh) in msg
    assert err.value.exit_code == 3 and kh.read_text() == ""


def test_accept_new_records_key(loopback_sshd, tmp_path):
    kh = tmp_path / "known_hosts"
    host = ssh_host(loopback_sshd, tmp_path, known_hosts=str(kh))
    with open_transport(host, accept_new_host_key=True) as t:
        assert t.run(["true"]).ok
    assert kh.read_text().split() == known_hosts_line(loopback_sshd.port, loopback_sshd.host_key.with_suffix(".pub")).split()
    with open_transport(host) as t:  # strict now passes
        assert t.run(["true"]).ok
    kh.unlink()
    policy_host = ssh_host(loopback_sshd, tmp_path, name="tofu", known_hosts=str(kh), host_key_policy="accept-new")
    with open_transport(policy_host) as t:
        assert t.run(["true"]).ok
    assert len(kh.read_text().splitlines()) == 1


def test_changed_key_refused_even_with_accept_new(loopback_sshd, tmp_path):
    other = generate_key(tmp_path / "other_host_key")
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts_line(loopback_sshd.port, other.with_suffix(".pub")) + "\n")
    before = kh.read_text()
    host = ssh_host(loopback_sshd, tmp_path, known_hosts=str(kh), host_key_policy="accept-new")
    with pytest.raises(HostKeyError) as err:
        open_transport(host, accept_new_host_key=True)
    msg = str(err.value)
    assert "CHANGED" in msg and fingerprint_of(other.with_suffix(".pub")) in msg
    assert fingerprint_of(loopback_sshd.host_key.with_suffix(".pub")) in msg
    assert f"ssh-keygen -R '[127.0.0.1]:{loopback_sshd.port}'" in msg
    assert kh.read_text() == before


def test_unreachable_and_bad_auth(loopback_sshd, tmp_path):
    import socket
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    host = ssh_host(loopback_sshd, tmp_path, name="dead", port=dead_port, timeouts={"connect": 3})
    with pytest.raises(HostUnreachable) as err:
        open_transport(host)
    assert f"127.0.0.1:{dead_port}" in str(err.value) and err.value.exit_code == 3
    stranger = generate_key(tmp_path / "stranger")
    host = ssh_host(loopback_sshd, tmp_path, name="stranger", identity_file=str(stranger))
    with pytest.raises(HostUnreachable, match="authentication failed"):
        open_transport(host)


def test_ssh_config_alias(loopback_sshd, tmp_path, monkeypatch):
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host kdt-loop\n  HostName 127.0.0.1\n  Port {loopback_sshd.port}\n  User {loopback_sshd.user}\n"
                   f"  IdentityFile {loopback_sshd.identity_file}\n  UserKnownHostsFile {loopback_sshd.known_hosts}\n")
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(cfg))
    path = tmp_path / "alias.yaml"
    path.write_text(f"transport: ssh\nssh_config_alias: kdt-loop\nremote_dir: {tmp_path}/remote\ncuda_arch: cpu\n")
    with open_transport(load_host(str(path), HOSTS)) as t:
        assert t.known_hosts == loopback_sshd.known_hosts  # taken from the alias's UserKnownHostsFile
        assert t.run(["echo", "via alias"]).stdout == "via alias\n"
        argv, target = t.ssh_command()
        r = subprocess.run(argv + [target, "echo", "plain ssh"], capture_output=True, text=True, timeout=30)
        assert r.stdout == "plain ssh\n", r.stderr


def test_proxyjump_checks_every_hop(loopback_sshd, tmp_path, monkeypatch):
    """ProxyJump from ssh_config: both hops are the loopback sshd; both are host-key checked."""
    kh = tmp_path / "known_hosts"
    block = (f"  HostName 127.0.0.1\n  Port {loopback_sshd.port}\n  User {loopback_sshd.user}\n"
             f"  IdentityFile {loopback_sshd.identity_file}\n  UserKnownHostsFile {kh}\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host kdt-jump\n{block}Host kdt-target\n{block}  ProxyJump kdt-jump\n")
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(cfg))
    path = tmp_path / "jumped.yaml"
    path.write_text(f"transport: ssh\nssh_config_alias: kdt-target\nremote_dir: {tmp_path}/remote\ncuda_arch: cpu\n")
    kh.write_text("")
    with pytest.raises(HostKeyError, match="not known"):  # the jump hop is refused first
        open_transport(load_host(str(path), HOSTS))
    kh.write_text(loopback_sshd.known_hosts.read_text())
    with open_transport(load_host(str(path), HOSTS)) as t:
        assert t.conn.gateway is not None
        assert t.run(["echo", "through the jump"]).stdout == "through the jump\n"


def test_output_after_exit_and_background_holders(make_transport):
    """Output written just after the command's shell exits is kept (sshd may report the exit
    first); a background child holding the output open does not hang the call."""
    t = make_transport()
    r = t.run("(sleep 0.3; echo late) & echo early")
    assert r.ok and r.stdout == "early\nlate\n"
    start = time.monotonic()
    r = t.run("sleep 30 & echo $!")
    seconds = time.monotonic() - start
    os.kill(int(r.stdout), 9)  # the loopback host is this machine
    assert r.ok and seconds < 20, f"the call waited {seconds:.1f} s for a background child"


def test_missing_identity_file_is_a_config_error(loopback_sshd, tmp_path):
    from engine.remote.errors import ConfigError
    host = ssh_host(loopback_sshd, tmp_path, name="nokey", identity_file=str(tmp_path / "no_such_key"))
    with pytest.raises(ConfigError) as err:
        open_transport(host)
    assert "identity_file" in str(err.value) and "no_such_key" in str(err.value) and err.value.exit_code == 5


def test_ssh_errors_name_the_host_and_leave_no_stray_banner_traceback(tmp_path, capfd):
    """An unresolvable name says which name and where it came from; a port that is not SSH says
    so in one line, without paramiko's "Exception (client)" traceback on stderr."""
    import socket as _socket
    import threading as _threading

    from engine.remote.errors import HostUnreachable
    from engine.remote.inventory import parse_host
    from engine.remote.ssh import SshTransport

    base = {"transport": "ssh", "remote_dir": "~/kd", "cuda_arch": "cpu", "host_key_policy": "accept-new",
            "known_hosts": str(tmp_path / "kh"), "timeouts": {"connect": 5}}
    h = parse_host("nx", {**base, "hostname": "nosuchhost.invalid"}, source=tmp_path / "nx.yaml")
    with pytest.raises(HostUnreachable, match=r"cannot resolve the host name 'nosuchhost.invalid' \(hostname"):
        SshTransport(h)
    srv = _socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        c, _ = srv.accept()
        c.sendall(b"HTTP/1.0 200 OK\r\n\r\nnot ssh\n")
        c.close()

    _threading.Thread(target=serve, daemon=True).start()
    h = parse_host("web", {**base, "hostname": "127.0.0.1", "port": srv.getsockname()[1]}, source=None)
    with pytest.raises(HostUnreachable, match="does not speak SSH"):
        SshTransport(h)
    srv.close()
    import time as _time
    _time.sleep(0.3)  # paramiko's thread logs after the handshake fails
    assert "Exception" not in capfd.readouterr().err
