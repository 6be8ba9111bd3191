"""engine.remote.inventory against hostile or careless host files: remote_dir normalised before
the system-folder check, values ssh could read as options, key-like values in any field, every
problem reported at once, cuda_arch checked against the architectures nvcc knows."""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path

import pytest

from engine.remote.errors import ConfigError
from engine.remote.inventory import KNOWN_ARCHES, looks_like_secret, parse_host

SRC = Path("/cfg/h.yaml")
VALID = {"transport": "ssh", "hostname": "gpu1.example", "remote_dir": "~/kdt", "cuda_arch": "sm_90"}


def load(**fields):
    return parse_host("h", {k: v for k, v in dict(VALID, **fields).items() if v is not None}, source=SRC)


@pytest.mark.parametrize("rd,resolved", [("//etc", "/etc"), ("/./etc", "/etc"), ("/usr/../etc", "/etc"),
                                         ("/etc/", "/etc"), ("///usr//local", "/usr/local"), ("//", "/"),
                                         ("/var/./tmp", "/var/tmp"), ("//home/bob", "/home/bob"),
                                         ("/home/bob/x/..", "/home/bob")])
def test_remote_dir_is_normalised_before_the_system_folder_check(rd, resolved):
    with pytest.raises(ConfigError) as err:
        load(remote_dir=rd)
    assert f"/cfg/h.yaml: remote_dir: {rd!r} is the" in str(err.value) and f"folder {resolved} itself" in str(err.value)


@pytest.mark.parametrize("field,value", [("hostname", "-oProxyCommand=touch /tmp/x"), ("user", "-lroot"),
                                         ("ssh_config_alias", "-F/tmp/evil"), ("hostname", "a b"),
                                         ("user", "bob\n"), ("ssh_config_alias", "ct\t200"), ("hostname", "h\x00")])
def test_values_ssh_could_read_as_options_are_refused(field, value):
    with pytest.raises(ConfigError) as err:
        load(**{field: value})
    assert f"/cfg/h.yaml: {field}: must not start with - or hold whitespace" in str(err.value)


def _pem():
    body = base64.b64encode(os.urandom(96)).decode()
    return f"-----BEGIN OPENSSH PRIVATE KEY-----\n{body}\n-----END OPENSSH PRIVATE KEY-----\n"


KEYLIKE = [
    ("env", lambda: {"DEPLOY_KEY_PEM": _pem()}, "env.DEPLOY_KEY_PEM"),
    ("env", lambda: {"AUTH": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI" + secrets.token_hex(8)}, "env.AUTH"),
    ("env", lambda: {"GH": "ghp_" + secrets.token_hex(18)}, "env.GH"),
    ("env", lambda: {"AWS": "AKIA" + "".join(secrets.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567") for _ in range(16))}, "env.AWS"),
    ("env", lambda: {"X": "prefix:" + secrets.token_urlsafe(40)}, "env.X"),
    ("env", lambda: {"B64": base64.b64encode(os.urandom(48)).decode()}, "env.B64"),
    ("gpus", lambda: {"count": 1, "model": "glpat-" + secrets.token_urlsafe(20)}, "gpus.model"),
    ("python", lambda: "sk-" + secrets.token_urlsafe(30), "python"),
    ("remote_dir", lambda: "~/runs_a/" + secrets.token_urlsafe(40), "remote_dir"),  # a token as a path part
]


@pytest.mark.parametrize("field,make,named", KEYLIKE, ids=[n for _, _, n in KEYLIKE])
def test_key_like_values_are_refused_in_any_field(field, make, named):
    value = make()
    with pytest.raises(ConfigError) as err:
        load(**{field: value})
    msg = str(err.value)
    assert f"/cfg/h.yaml: {named}: holds what looks like a key or token" in msg
    secret = value if isinstance(value, str) else next(v for v in value.values() if isinstance(v, str) and len(v) > 8)
    assert secret[-12:] not in msg  # never echoed


@pytest.mark.parametrize("value", ["/opt/cuda/bin:$PATH", "/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH",
                                   "NVIDIA RTX PRO 6000 Blackwell Server Edition", "/home/me/.venvs/kdtree-engine-py312/bin/python3",
                                   "expandable_segments:True,garbage_collection_threshold:0.8", "0123456789abcdef" * 2,
                                   "/tmp/pytest-of-root/pytest-173/test_run_missing_cwd_fails_cle1/hosts/loop.yaml"])
def test_ordinary_values_are_not_taken_for_keys(value):
    assert not looks_like_secret(value)
    assert load(env={"V": value}).env["V"] == value


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_host("h", {"transport": "ssh", "hostname": "-x", "port": 0, "cuda_arch": "sm_99", "colour": 1,
                         "remote_dir": "//etc", "env": {"1BAD": "x", "OK": [1]}, "timeouts": {"build": -1, "nap": 3}},
                   source=SRC)
    msg = str(err.value)
    for fieldname in ("hostname", "port", "cuda_arch", "colour", "remote_dir", "env.1BAD", "env.OK",
                      "timeouts.build", "timeouts.nap"):
        assert f"/cfg/h.yaml: {fieldname}:" in msg, (fieldname, msg)
    assert "(9 problems in /cfg/h.yaml)" in msg and "\n" not in msg and err.value.exit_code == 5


@pytest.mark.parametrize("arch", ["sm_99", "sm_91", "sm_12", "sm_1200", "sm_90,sm_99", "sm_90,sm_90", "SM_90", "sm_90 ", ""])
def test_unknown_cuda_arch_is_refused_naming_the_accepted_values(arch):
    with pytest.raises(ConfigError) as err:
        load(cuda_arch=arch)
    msg = str(err.value)
    assert "/cfg/h.yaml: cuda_arch:" in msg
    assert "twice" in msg if arch == "sm_90,sm_90" else "(accepted: cpu, native, or a comma list of sm_50, " in msg


@pytest.mark.parametrize("arch", ["cpu", "native", "sm_50", "sm_90a", "sm_120", "sm_121", "sm_100f", "sm_90,sm_120"])
def test_known_cuda_arch_loads(arch):
    assert load(cuda_arch=arch).cuda_arch == arch
    assert {"sm_50", "sm_75", "sm_90", "sm_120", "sm_121"} <= set(KNOWN_ARCHES)
