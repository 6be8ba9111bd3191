"""Host inventory: the shipped hosts, --host resolution, and one ConfigError per malformed field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from engine.remote.errors import ConfigError, UsageError
from engine.remote.inventory import LOCAL_DEFAULT, TIMEOUT_DEFAULTS, Host, load_host, parse_host, resolve_hosts

REPO = Path(__file__).resolve().parents[1]
HOSTS = REPO / "hosts"
VALID_SSH = {"transport": "ssh", "hostname": "127.0.0.1", "remote_dir": "~/kdt", "cuda_arch": "sm_90"}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_shipped_hosts():
    local, h200, ct200 = resolve_hosts("local,h200,ct200", HOSTS)
    assert (local.name, local.transport, local.cuda_arch, local.remote_dir) == \
        ("local", "local", "cpu", "~/.cache/kdtree-engine/local")
    assert (h200.transport, h200.cuda_arch, h200.gpus.count, h200.gpus.model) == ("local", "sm_90a,sm_90", 1, "NVIDIA H200")
    assert h200.remote_dir == "~/.cache/kdtree-engine/h200"
    assert (ct200.transport, ct200.ssh_config_alias, ct200.hostname, ct200.cuda_arch) == ("ssh", "ct200", None, "sm_120")
    assert (ct200.gpus.count, ct200.gpus.model, ct200.remote_dir) == (8, "NVIDIA RTX PRO 6000 Blackwell", "~/kdtree-engine")
    assert ct200.host_key_policy == "strict" and ct200.timeouts.connect == 15
    assert local.source == HOSTS / "local.yaml"


def test_default_is_local_even_without_hosts_dir(tmp_path):
    [host] = resolve_hosts(None, tmp_path / "missing")
    assert host.name == "local" and host.source is None
    assert (host.transport, host.remote_dir, host.cuda_arch) == tuple(LOCAL_DEFAULT[k] for k in ("transport", "remote_dir", "cuda_arch"))


def test_path_spec_and_name_is_stem(tmp_path):
    path = write(tmp_path, "box-7", yaml.safe_dump(VALID_SSH))
    [host] = resolve_hosts(f"local,{path}", HOSTS)[1:]
    assert host.name == "box-7" and host.source == path and host.port == 22 and host.python == "python3"
    assert host.timeouts.connect == TIMEOUT_DEFAULTS["connect"] and host.address == "127.0.0.1:22"


def test_full_ssh_host_fields(tmp_path):
    data = dict(VALID_SSH, port=2222, user="me", identity_file="~/.ssh/id", known_hosts="kh", host_key_policy="accept-new",
                python="/opt/py/bin/python3", gpus={"count": 2, "model": "NVIDIA H100"},
                env={"CUDA_VISIBLE_DEVICES": "0,1", "N": 3, "PATH": "/x:$PATH"}, timeouts={"connect": 5, "bench": 99.5})
    h = load_host(str(write(tmp_path, "full", yaml.safe_dump(data))), HOSTS)
    assert (h.port, h.user, h.identity_file, h.known_hosts, h.host_key_policy) == (2222, "me", "~/.ssh/id", "kh", "accept-new")
    assert h.env == {"CUDA_VISIBLE_DEVICES": "0,1", "N": "3", "PATH": "/x:$PATH"}
    assert (h.timeouts.connect, h.timeouts.bench, h.timeouts.build) == (5.0, 99.5, TIMEOUT_DEFAULTS["build"])
    assert h.gpus.count == 2 and h.python == "/opt/py/bin/python3"
    assert isinstance(hash(h), int)


# (file text, the field the error must name). Each must raise ConfigError naming file and field.
MALFORMED = [
    ("transport: ssh\nhostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ncolour: blue\n", "colour"),
    ("transport: ssh\nhostname: a\ncuda_arch: cpu\n", "remote_dir"),
    ("transport: ssh\nhostname: a\nremote_dir: ~/k\n", "cuda_arch"),
    ("transport: telnet\nhostname: a\nremote_dir: ~/k\ncuda_arch: cpu\n", "transport"),
    ("hostname: a\nport: '22'\nremote_dir: ~/k\ncuda_arch: cpu\n", "port"),
    ("hostname: a\nport: 0\nremote_dir: ~/k\ncuda_arch: cpu\n", "port"),
    ("hostname: a\nport: 70000\nremote_dir: ~/k\ncuda_arch: cpu\n", "port"),
    ("hostname: a\nport: true\nremote_dir: ~/k\ncuda_arch: cpu\n", "port"),
    ("hostname: a\nhost_key_policy: yolo\nremote_dir: ~/k\ncuda_arch: cpu\n", "host_key_policy"),
    ("hostname: a\nremote_dir: kdt\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: /\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: '~'\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: ~/\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: /root\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: /home/bob/\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: /usr\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: ~/x/../..\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: ~/x;rm -rf\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\nremote_dir: 5\ncuda_arch: cpu\n", "remote_dir"),
    ("hostname: a\npassword: hunter2\nremote_dir: ~/k\ncuda_arch: cpu\n", "password"),
    ("hostname: a\nssh_passphrase: x\nremote_dir: ~/k\ncuda_arch: cpu\n", "ssh_passphrase"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\nenv:\n  API_TOKEN: abc\n", "env.API_TOKEN"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\nenv:\n  X: [1, 2]\n", "env.X"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\nenv:\n  1BAD: x\n", "env.1BAD"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\nenv: PATH=/x\n", "env"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ngpus:\n  count: -1\n", "gpus.count"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ngpus:\n  count: 1\n  model: 3\n", "gpus.model"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ngpus:\n  count: 1\n  memory: 80\n", "gpus.memory"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ngpus: 8\n", "gpus"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ntimeouts:\n  deploy: 3\n", "timeouts.deploy"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ntimeouts:\n  build: -3\n", "timeouts.build"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\ntimeouts:\n  sync: soon\n", "timeouts.sync"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: sm90\n", "cuda_arch"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\nuser: 7\n", "user"),
    ("hostname: a\nremote_dir: ~/k\ncuda_arch: cpu\npython: ''\n", "python"),
    ("transport: ssh\nremote_dir: ~/k\ncuda_arch: cpu\n", "hostname"),
    ("transport: local\nhostname: a\nremote_dir: ~/k\ncuda_arch: cpu\n", "hostname"),
    ("", "(file)"),
    ("- a\n- b\n", "(file)"),
]


@pytest.mark.parametrize("text,fieldname", MALFORMED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(MALFORMED)])
def test_malformed_field_is_named(tmp_path, text, fieldname):
    path = write(tmp_path, "bad", text)
    with pytest.raises(ConfigError) as err:
        load_host(str(path), HOSTS)
    msg = str(err.value)
    assert f"{path}: {fieldname}:" in msg, msg
    assert msg.startswith("error: bad: config: ") and err.value.exit_code == 5
    assert "hunter2" not in msg  # a secret's value is never echoed


@pytest.mark.parametrize("text,needle", [
    ("hostname: a\nhostname: b\nremote_dir: ~/k\ncuda_arch: cpu\n", "duplicate key 'hostname'"),
    ("hostname: [a\n", "not valid YAML"),
])
def test_unparsable_yaml_names_file(tmp_path, text, needle):
    path = write(tmp_path, "broken", text)
    with pytest.raises(ConfigError) as err:
        load_host(str(path), HOSTS)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_host_spec_usage_errors(tmp_path):
    with pytest.raises(UsageError) as err:
        resolve_hosts("nosuchhost", HOSTS)
    assert "nosuchhost" in str(err.value) and "ct200" in str(err.value) and err.value.exit_code == 5
    with pytest.raises(UsageError, match="empty item"):
        resolve_hosts("local,,h200", HOSTS)
    with pytest.raises(UsageError, match="twice"):
        resolve_hosts(f"local,{HOSTS / 'local.yaml'}", HOSTS)
    with pytest.raises(UsageError, match="no host file"):
        resolve_hosts(str(tmp_path / "absent.yaml"), HOSTS)


_KNOWN = {"transport", "hostname", "port", "user", "identity_file", "ssh_config_alias", "known_hosts",
          "host_key_policy", "remote_dir", "python", "cuda_arch", "gpus", "env", "timeouts"}


@settings(max_examples=100, deadline=None)
@given(st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True).filter(lambda k: k not in _KNOWN))
def test_any_unknown_field_is_refused(key):
    with pytest.raises(ConfigError) as err:
        parse_host("h", dict(VALID_SSH, **{key: "x"}), source=Path("/cfg/h.yaml"))
    assert f"/cfg/h.yaml: {key}:" in str(err.value)


@settings(max_examples=100, deadline=None)
@given(port=st.integers(1, 65535), arch=st.sampled_from(["cpu", "native", "sm_90", "sm_120", "sm_90,sm_120", "sm_90a"]),
       sub=st.lists(st.from_regex(r"[A-Za-z0-9_-]{1,8}", fullmatch=True), min_size=1, max_size=3))
def test_valid_hosts_load(port, arch, sub):
    # At most 3 x 8 random characters: 32 random ones in a row (slashes ignored, as base64
    # tokens hold them) are what looks_like_secret calls a token, rightly refused elsewhere.
    remote_dir = "~/" + "/".join(sub)
    h = parse_host("h", dict(VALID_SSH, port=port, cuda_arch=arch, remote_dir=remote_dir), source=None)
    assert isinstance(h, Host) and (h.port, h.cuda_arch, h.remote_dir) == (port, arch, remote_dir)
