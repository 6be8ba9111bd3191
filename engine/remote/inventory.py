"""Host inventory: one YAML file per host in ``hosts/``, loaded into a frozen ``Host``.

A host's name is its file's stem (``hosts/ct200.yaml`` -> ``ct200``). Fields are those of
ARCHITECTURE.md "Host inventory"; unknown fields are errors, never ignored. Every problem raises
``ConfigError`` naming the file and the field (``hosts/x.yaml: port: expected an integer ...``).

    load_host("ct200", hosts_dir)          -> Host   (a name in hosts_dir, or a path to a YAML file)
    resolve_hosts("local,/tmp/h.yaml", d)  -> [Host, Host]
    resolve_hosts(None, d)                 -> [the default host `local`]

``local`` is the embedded default: when ``hosts/local.yaml`` is missing the built-in
``LOCAL_DEFAULT`` is used, so every task works with no ``--host`` on any machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import yaml

from .errors import ConfigError, UsageError

TRANSPORTS = ("local", "ssh")
HOST_KEY_POLICIES = ("strict", "accept-new")
TIMEOUT_DEFAULTS = {"connect": 15.0, "sync": 600.0, "build": 1800.0, "test": 1800.0, "bench": 3600.0}
_ARCH_RE = re.compile(r"^(cpu|native|sm_\d{2,3}[a-z]?(,sm_\d{2,3}[a-z]?)*)$")
# Any key that looks like a credential is refused wherever it appears (top level, env, gpus).
_SECRET_RE = re.compile(r"pass(word|wd|phrase)?|secret|token|api[_-]?key|credential", re.I)
# Absolute folders the tool must never own (it deletes inside remote_dir/src).
_SYSTEM_DIRS = {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/opt", "/proc",
                "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/Users", "/mnt",
                "/media", "/snap", "/usr/local", "/var/tmp"}

LOCAL_DEFAULT: dict[str, Any] = {
    "transport": "local",
    "remote_dir": "~/.cache/kdtree-engine/local",
    "cuda_arch": "cpu",
}


@dataclass(frozen=True)
class Gpus:
    count: int = 0            # expected number of GPUs (0: none expected / not checked)
    model: str | None = None  # expected nvidia-smi name, e.g. "NVIDIA H200"


@dataclass(frozen=True)
class Timeouts:
    """Seconds per step; connect is never unbounded."""
    connect: float = TIMEOUT_DEFAULTS["connect"]
    sync: float = TIMEOUT_DEFAULTS["sync"]
    build: float = TIMEOUT_DEFAULTS["build"]
    test: float = TIMEOUT_DEFAULTS["test"]
    bench: float = TIMEOUT_DEFAULTS["bench"]


@dataclass(frozen=True)
class Host:
    name: str                       # the YAML file's stem
    source: Path | None             # the YAML file it came from (None: the embedded default)
    transport: str                  # "local" | "ssh"
    remote_dir: str                 # absolute or "~/..." on the host, as written
    cuda_arch: str                  # "sm_120", "sm_90", "sm_90,sm_120", "native" or "cpu"
    hostname: str | None = None
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    ssh_config_alias: str | None = None
    known_hosts: str | None = None  # a local path; None: ~/.ssh/known_hosts
    host_key_policy: str = "strict"
    python: str = "python3"
    gpus: Gpus = field(default_factory=Gpus)
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for remote commands
    timeouts: Timeouts = field(default_factory=Timeouts)

    def __hash__(self) -> int:  # env is a dict; a host is identified by its name and file
        return hash((self.name, self.source))

    @property
    def address(self) -> str:
        """What this host resolves to, for messages and manifests."""
        if self.transport == "local":
            return "localhost (local transport)"
        target = self.hostname or self.ssh_config_alias or "?"
        user = f"{self.user}@" if self.user else ""
        return f"{user}{target}:{self.port}"


# --- loading ---------------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_host(spec: str, hosts_dir: Path | str) -> Host:
    """A host from a name in ``hosts_dir`` or a path to a YAML file."""
    hosts_dir = Path(hosts_dir)
    spec = spec.strip()
    if not spec:
        raise UsageError("empty host name", step="config", hint="--host takes a name, a path or a comma list")
    looks_like_path = "/" in spec or spec.endswith((".yaml", ".yml"))
    path = Path(spec).expanduser() if looks_like_path else hosts_dir / f"{spec}.yaml"
    if not path.is_file():
        if not looks_like_path and spec == "local":
            return parse_host("local", dict(LOCAL_DEFAULT), source=None)
        known = sorted(p.stem for p in hosts_dir.glob("*.yaml")) if hosts_dir.is_dir() else []
        raise UsageError(f"no host file {path}", host=spec, step="config",
                         hint=f"known hosts in {hosts_dir}: {', '.join(known) or 'none'}")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}",
                          host=path.stem, step="config") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}", host=path.stem, step="config") from None
    return parse_host(path.stem, data, source=path)


def resolve_hosts(spec: str | None, hosts_dir: Path | str) -> list[Host]:
    """``None`` -> [local]; else a comma list of names or paths, each loaded and validated."""
    if spec is None:
        return [load_host("local", hosts_dir)]
    items = [s.strip() for s in spec.split(",")]
    if any(not s for s in items):
        raise UsageError(f"--host {spec!r} has an empty item", step="config",
                         hint="use names or paths separated by single commas")
    hosts = [load_host(s, hosts_dir) for s in items]
    names = [h.name for h in hosts]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UsageError(f"--host {spec!r} names host {dupes[0]!r} twice", step="config",
                         hint="a host's name is its file's stem; rename one file")
    return hosts


# --- validation ------------------------------------------------------------------------------

_FIELDS = {"transport", "hostname", "port", "user", "identity_file", "ssh_config_alias",
           "known_hosts", "host_key_policy", "remote_dir", "python", "cuda_arch", "gpus", "env",
           "timeouts"}
_SSH_ONLY = ("hostname", "user", "identity_file", "ssh_config_alias", "known_hosts")
_REQUIRED = ("remote_dir", "cuda_arch")


def parse_host(name: str, data: Any, *, source: Path | None) -> Host:
    """Validate one host's YAML data (already parsed) into a ``Host``."""
    where = str(source) if source else f"<embedded {name}>"

    def bad(fieldname: str, what: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{where}: {fieldname}: {what}", host=name, step="config", hint=hint)

    if data is None:
        raise bad("(file)", "empty host file", f"required fields: {', '.join(_REQUIRED)}")
    if not isinstance(data, dict):
        raise bad("(file)", f"expected a mapping of fields, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise bad(str(key), "field names must be strings")
        if _SECRET_RE.search(key):
            raise bad(key, "password or secret fields are not allowed in the inventory",
                      "use identity_file or the ssh agent; never store secrets in hosts/")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise bad(unknown[0], "unknown field", f"known fields: {', '.join(sorted(_FIELDS))}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise bad(missing[0], "missing required field")

    def opt_str(key: str) -> str | None:
        value = data.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise bad(key, f"expected a non-empty string, got {value!r}")
        return value

    transport = data.get("transport", "ssh")
    if transport not in TRANSPORTS:
        raise bad("transport", f"expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    port = data.get("port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise bad("port", f"expected an integer in 1..65535, got {port!r}")
    policy = data.get("host_key_policy", "strict")
    if policy not in HOST_KEY_POLICIES:
        raise bad("host_key_policy", f"expected one of {', '.join(HOST_KEY_POLICIES)}, got {policy!r}")
    cuda_arch = data.get("cuda_arch")
    if not isinstance(cuda_arch, str) or not _ARCH_RE.match(cuda_arch):
        raise bad("cuda_arch", f"expected sm_XX[,sm_YY], native or cpu, got {cuda_arch!r}")
    strings = {k: opt_str(k) for k in ("hostname", "user", "identity_file", "ssh_config_alias",
                                       "known_hosts", "python")}
    if transport == "ssh" and not (strings["hostname"] or strings["ssh_config_alias"]):
        raise bad("hostname", "an ssh host needs hostname or ssh_config_alias")
    if transport == "local":
        for key in _SSH_ONLY:
            if key in data:
                raise bad(key, "only meaningful for transport: ssh")
    return Host(
        name=name, source=source, transport=transport,
        remote_dir=_check_remote_dir(data["remote_dir"], bad),
        cuda_arch=cuda_arch, port=port, host_key_policy=policy,
        hostname=strings["hostname"], user=strings["user"],
        identity_file=strings["identity_file"], ssh_config_alias=strings["ssh_config_alias"],
        known_hosts=strings["known_hosts"], python=strings["python"] or "python3",
        gpus=_parse_gpus(data.get("gpus"), bad), env=_parse_env(data.get("env"), bad),
        timeouts=_parse_timeouts(data.get("timeouts"), bad),
    )


def _check_remote_dir(value: Any, bad) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad("remote_dir", f"expected a non-empty string, got {value!r}")
    if not (value.startswith("/") or value.startswith("~/")):
        raise bad("remote_dir", f"must be absolute or start with ~/, got {value!r}")
    parts = PurePosixPath(value).parts
    if ".." in parts or "." in value.split("/"):
        raise bad("remote_dir", f"must not contain . or .. components, got {value!r}")
    if any(c in value for c in "\n\0$`\"'\\*?[]{};&|<>"):
        raise bad("remote_dir", f"contains a shell-special character: {value!r}")
    norm = str(PurePosixPath(value))
    if norm in ("~",) or norm in _SYSTEM_DIRS:
        raise bad("remote_dir", f"{value!r} is a system or home folder itself",
                  "use a folder the tool owns, e.g. ~/kdtree-engine")
    # /home/<user>, /Users/<user> and /root are home folders themselves.
    if len(parts) == 3 and parts[1] in ("home", "Users"):
        raise bad("remote_dir", f"{value!r} is a home folder itself", "use a folder inside it")
    return norm


def _parse_gpus(value: Any, bad) -> Gpus:
    if value is None:
        return Gpus()
    if not isinstance(value, dict):
        raise bad("gpus", f"expected a mapping with count and model, got {value!r}")
    unknown = sorted(set(value) - {"count", "model"})
    if unknown:
        raise bad(f"gpus.{unknown[0]}", "unknown field", "known fields: count, model")
    count = value.get("count", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise bad("gpus.count", f"expected a non-negative integer, got {count!r}")
    model = value.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise bad("gpus.model", f"expected a non-empty string, got {model!r}")
    return Gpus(count=count, model=model)


def _parse_env(value: Any, bad) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("env", f"expected a mapping of NAME: value, got {value!r}")
    env = {}
    for key, val in value.items():
        if not isinstance(key, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise bad(f"env.{key}", "not a valid environment variable name")
        if _SECRET_RE.search(key):
            raise bad(f"env.{key}", "secrets are not allowed in env",
                      "env is recorded in manifests and logs; never put secrets there")
        if isinstance(val, bool) or not isinstance(val, (str, int, float)):
            raise bad(f"env.{key}", f"expected a string or number, got {val!r}")
        env[key] = str(val)
    return env


def _parse_timeouts(value: Any, bad) -> Timeouts:
    if value is None:
        return Timeouts()
    if not isinstance(value, dict):
        raise bad("timeouts", f"expected a mapping of step: seconds, got {value!r}")
    out = {}
    for key, val in value.items():
        if key not in TIMEOUT_DEFAULTS:
            raise bad(f"timeouts.{key}", "unknown step", f"known: {', '.join(TIMEOUT_DEFAULTS)}")
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0:
            raise bad(f"timeouts.{key}", f"expected a positive number of seconds, got {val!r}")
        out[key] = float(val)
    return Timeouts(**out)
