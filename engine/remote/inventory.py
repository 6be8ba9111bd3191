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

import functools
import posixpath
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import yaml

from .errors import ConfigError, UsageError

TRANSPORTS = ("local", "ssh")
HOST_KEY_POLICIES = ("strict", "accept-new")
TIMEOUT_DEFAULTS = {"connect": 15.0, "sync": 600.0, "build": 1800.0, "test": 1800.0, "bench": 3600.0}
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
    cuda_arch: str                  # "sm_120", "sm_90", "sm_90a,sm_90", "sm_90,sm_120", "native" or "cpu"
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
    """Validate one host's YAML data (already parsed) into a ``Host``. Every problem of the file
    is found before one ``ConfigError`` names them all (file and field each)."""
    where = str(source) if source else f"<embedded {name}>"
    problems: list[ConfigError] = []

    def bad(fieldname: str, what: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{where}: {fieldname}: {what}", host=name, step="config", hint=hint)

    def check(fn, *args, default=None):
        """fn(*args), or default after recording the ConfigError it raised."""
        try:
            return fn(*args)
        except ConfigError as e:
            problems.append(e)
            return default

    if data is None:
        raise bad("(file)", "empty host file", f"required fields: {', '.join(_REQUIRED)}")
    if not isinstance(data, dict):
        raise bad("(file)", f"expected a mapping of fields, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            problems.append(bad(str(key), "field names must be strings"))
        elif _SECRET_RE.search(key):
            problems.append(bad(key, "password or secret fields are not allowed in the inventory",
                                "use identity_file or the ssh agent; never store secrets in hosts/"))
    problems += [bad(k, "unknown field", f"known fields: {', '.join(sorted(_FIELDS))}")
                 for k in sorted(k for k in data if isinstance(k, str) and k not in _FIELDS and not _SECRET_RE.search(k))]
    problems += [bad(k, "missing required field") for k in _REQUIRED if k not in data]
    for path, value in _strings(data):
        if looks_like_secret(value):
            problems.append(bad(path, "holds what looks like a key or token (value not shown)",
                                "never store secrets in hosts/: use identity_file or the ssh agent"))

    def opt_str(key: str) -> str | None:
        value = data.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise bad(key, f"expected a non-empty string, got {value!r}")
        if key in _NO_OPTION_LIKE and (value.startswith("-") or re.search(r"[\s\x00-\x1f\x7f]", value)):
            raise bad(key, f"must not start with - or hold whitespace or control characters, got {value!r}",
                      "a value ssh could read as an option is refused")
        return value

    transport = data.get("transport", "ssh")
    if transport not in TRANSPORTS:
        problems.append(bad("transport", f"expected one of {', '.join(TRANSPORTS)}, got {transport!r}"))
    port = data.get("port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        problems.append(bad("port", f"expected an integer in 1..65535, got {port!r}"))
    policy = data.get("host_key_policy", "strict")
    if policy not in HOST_KEY_POLICIES:
        problems.append(bad("host_key_policy", f"expected one of {', '.join(HOST_KEY_POLICIES)}, got {policy!r}"))
    cuda_arch = data.get("cuda_arch")
    if "cuda_arch" in data:
        why = check_cuda_arch(cuda_arch)
        if why:
            problems.append(bad("cuda_arch", why))
    strings = {k: check(opt_str, k) for k in ("hostname", "user", "identity_file", "ssh_config_alias",
                                              "known_hosts", "python")}
    if transport == "ssh" and not (strings["hostname"] or strings["ssh_config_alias"]) \
            and not any(e.what.startswith(f"{where}: {k}:") for e in problems for k in ("hostname", "ssh_config_alias")):
        problems.append(bad("hostname", "an ssh host needs hostname or ssh_config_alias"))
    if transport == "local":
        problems += [bad(key, "only meaningful for transport: ssh") for key in _SSH_ONLY if key in data]
    remote_dir = check(_check_remote_dir, data["remote_dir"], bad) if "remote_dir" in data else None
    gpus = check(_parse_gpus, data.get("gpus"), bad, default=Gpus())
    env = _parse_env(data.get("env"), bad, problems)
    timeouts = _parse_timeouts(data.get("timeouts"), bad, problems)
    if problems:
        if len(problems) == 1:
            raise problems[0]
        raise ConfigError("; ".join(e.what for e in problems), host=name, step="config",
                          hint=f"{len(problems)} problems in {where}")
    return Host(
        name=name, source=source, transport=transport, remote_dir=remote_dir,
        cuda_arch=cuda_arch, port=port, host_key_policy=policy,
        hostname=strings["hostname"], user=strings["user"],
        identity_file=strings["identity_file"], ssh_config_alias=strings["ssh_config_alias"],
        known_hosts=strings["known_hosts"], python=strings["python"] or "python3",
        gpus=gpus, env=env, timeouts=timeouts,
    )


# --- values ----------------------------------------------------------------------------------

# Fields ssh reads as a destination or login: a leading "-" would be an option to it.
_NO_OPTION_LIKE = ("hostname", "user", "ssh_config_alias")
# Values that look like keys or tokens, wherever they appear (env included).
_KEYLIKE_RE = re.compile(
    r"-----BEGIN [A-Z0-9 ]*(PRIVATE KEY|KEY)-----"
    r"|\b(ssh-(rsa|dss|ed25519)|ecdsa-sha2-nistp\d+) AAAA"
    r"|\b(gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{20,}|hf_[A-Za-z0-9]{30,})")
_RUN_RE = re.compile(r"[A-Za-z0-9+/=_-]{32,}")


def _entropy(s: str) -> float:
    from collections import Counter
    from math import log2
    n = len(s)
    return -sum(c / n * log2(c / n) for c in Counter(s).values())


def _random_looking(core: str) -> bool:
    classes = sum((any(c.isdigit() for c in core), any(c.isupper() for c in core),
                   any(c.islower() for c in core)))
    return len(core) >= 32 and classes >= 2 and _entropy(core) > 4.2


def looks_like_secret(value: str) -> bool:
    """A PEM block, an ssh key, a known token prefix, or a long random-looking base64 run
    (32+ characters, two of digits / upper / lower case, over 4.2 bits of entropy per
    character: words stay below that). A run that holds "/" and also "-" or "_" is a path, not
    one token (standard base64 has "/" but neither "-" nor "_"; base64url has those but no "/"):
    its "/"-separated parts are judged one by one, so that a long path of ordinary names (a
    pytest temporary folder, say) is not taken for a token."""
    if _KEYLIKE_RE.search(value):
        return True
    for run in _RUN_RE.findall(value):
        if "/" in run and ("-" in run or "_" in run):
            if any(_random_looking(part) for part in run.split("/")):
                return True
        elif _random_looking(run.replace("/", "")):
            return True
    return False


def _strings(value: Any, path: str = ""):
    """(field path, string) for every string value in the host data, nested ones included."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


# Real GPU architectures nvcc has accepted (sm_50 .. sm_121, with the a/f variants of 12.x/13.x);
# an installed nvcc's own --list-gpu-arch adds newer ones.
KNOWN_ARCHES = ("sm_50", "sm_52", "sm_53", "sm_60", "sm_61", "sm_62", "sm_70", "sm_72", "sm_75",
                "sm_80", "sm_86", "sm_87", "sm_88", "sm_89", "sm_90", "sm_90a",
                "sm_100", "sm_100a", "sm_100f", "sm_101", "sm_101a", "sm_101f", "sm_103", "sm_103a",
                "sm_103f", "sm_110", "sm_110a", "sm_110f", "sm_120", "sm_120a", "sm_120f",
                "sm_121", "sm_121a", "sm_121f")


@functools.lru_cache(maxsize=1)
def known_arches() -> tuple[str, ...]:
    arches = set(KNOWN_ARCHES)
    if shutil.which("nvcc"):
        try:
            out = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        arches |= {"sm_" + a.split("_", 1)[1] for a in out.split() if a.startswith("compute_")}
    return tuple(sorted(arches, key=lambda a: (int(re.sub(r"\D", "", a)), a)))


def check_cuda_arch(value: Any) -> str | None:
    """Why `value` is not a cuda_arch (None: it is): cpu, native, or a comma list of known sm_XX."""
    accepted = f"cpu, native, or a comma list of {', '.join(known_arches())}"
    if not isinstance(value, str) or not value:
        return f"expected a string, got {value!r} (accepted: {accepted})"
    if value in ("cpu", "native"):
        return None
    parts = value.split(",")
    unknown = [p for p in parts if p not in known_arches()]
    if unknown:
        return f"{unknown[0]!r} is not an architecture nvcc knows (accepted: {accepted})"
    if len(set(parts)) != len(parts):
        return f"{value!r} names an architecture twice"
    return None


def _check_remote_dir(value: Any, bad) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad("remote_dir", f"expected a non-empty string, got {value!r}")
    if not (value.startswith("/") or value.startswith("~/")):
        raise bad("remote_dir", f"must be absolute or start with ~/, got {value!r}")
    # Normalised first: //etc, /./etc, /usr/../etc and /etc/ are all /etc.
    resolved = "/" + posixpath.normpath(value).lstrip("/") if value.startswith("/") else posixpath.normpath(value)
    if resolved in _SYSTEM_DIRS or resolved == "~":
        raise bad("remote_dir", f"{value!r} is the system or home folder {resolved} itself",
                  "use a folder the tool owns, e.g. ~/kdtree-engine")
    rparts = PurePosixPath(resolved).parts
    if len(rparts) == 3 and rparts[1] in ("home", "Users"):
        raise bad("remote_dir", f"{value!r} is the home folder {resolved} itself", "use a folder inside it")
    parts = PurePosixPath(value).parts
    if ".." in parts or "." in value.split("/"):
        raise bad("remote_dir", f"must not contain . or .. components, got {value!r}")
    if any(c in value for c in "\n\0$`\"'\\*?[]{};&|<>"):
        raise bad("remote_dir", f"contains a shell-special character: {value!r}")
    norm = "/" + str(PurePosixPath(value)).lstrip("/") if value.startswith("/") else str(PurePosixPath(value))
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


def _parse_env(value: Any, bad, problems: list) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(bad("env", f"expected a mapping of NAME: value, got {value!r}"))
        return {}
    env = {}
    for key, val in value.items():
        if not isinstance(key, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            problems.append(bad(f"env.{key}", "not a valid environment variable name"))
        elif _SECRET_RE.search(key):
            problems.append(bad(f"env.{key}", "secrets are not allowed in env",
                                "env is recorded in manifests and logs; never put secrets there"))
        elif isinstance(val, bool) or not isinstance(val, (str, int, float)):
            problems.append(bad(f"env.{key}", f"expected a string or number, got {val!r}"))
        else:
            env[key] = str(val)
    return env


def _parse_timeouts(value: Any, bad, problems: list) -> Timeouts:
    if value is None:
        return Timeouts()
    if not isinstance(value, dict):
        problems.append(bad("timeouts", f"expected a mapping of step: seconds, got {value!r}"))
        return Timeouts()
    out = {}
    for key, val in value.items():
        if key not in TIMEOUT_DEFAULTS:
            problems.append(bad(f"timeouts.{key}", "unknown step", f"known: {', '.join(TIMEOUT_DEFAULTS)}"))
        elif isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0 or val != val or val == float("inf"):
            problems.append(bad(f"timeouts.{key}", f"expected a positive number of seconds, got {val!r}"))
        else:
            out[key] = float(val)
    return Timeouts(**out)
