"""Per-run settings without editing tracked files, and the checks made before any host is touched.

    hosts = apply_overrides(resolve_hosts(spec, hosts_dir), hosts_dir, parse_timeouts(["bench=7200"]))

Two layers over a host's tracked `hosts/<name>.yaml`, later ones winning:
  1. `hosts/<name>.local.yaml` (git-ignored): the same fields, merged in (mappings such as
     `timeouts`, `env` and `gpus` field by field); for this machine's own settings.
  2. `--timeout STEP=SECONDS` (repeatable, or a comma list): this run only.

`validate_*` raise UsageError (exit 5) for what can be known locally: suite names, run ids,
flags that contradict each other. `cpu_profile(host)`: the quick defaults are for CPU hosts.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterable

import yaml

from .errors import ConfigError, UsageError
from .inventory import LOCAL_DEFAULT, TIMEOUT_DEFAULTS, Host, parse_host

OVERLAY_SUFFIX = ".local.yaml"
RUN_ID_RE = re.compile(r"^\d{8}T\d{6}Z-[0-9a-z]{4,7}(-dirty)?-(test|bench)$")
TEST_SUITES = ("native", "selftest")


def overlay_path(host: Host, hosts_dir: Path) -> Path | None:
    """hosts/<name>.local.yaml for a host of hosts_dir (or the embedded local), else None."""
    if host.source is not None and Path(host.source).resolve().parent != Path(hosts_dir).resolve():
        return None
    p = Path(hosts_dir) / f"{host.name}{OVERLAY_SUFFIX}"
    return p if p.is_file() else None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_overlay(host: Host, hosts_dir: Path) -> Host:
    path = overlay_path(host, hosts_dir)
    if path is None:
        return host
    try:
        over = yaml.safe_load(path.read_text())
        base = yaml.safe_load(Path(host.source).read_text()) if host.source else dict(LOCAL_DEFAULT)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {' '.join(str(e).split())}", host=host.name, step="config") from None
    if over is None:
        return host
    if not isinstance(over, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(over).__name__}",
                          host=host.name, step="config")
    try:
        return parse_host(host.name, _merge(base or {}, over), source=host.source)
    except ConfigError as e:
        raise ConfigError(f"{e.what} (with the overlay {path})", host=host.name, step="config",
                          hint=e.hint) from None


def parse_timeouts(specs: Iterable[str] | str | None) -> dict[str, float]:
    """["bench=7200", "build=600,test=900"] -> {"bench": 7200.0, ...}; UsageError when malformed."""
    if isinstance(specs, str):
        specs = [specs]
    out: dict[str, float] = {}
    for spec in specs or []:
        for item in (s.strip() for s in str(spec).split(",")):
            if not item:
                continue
            step, eq, value = item.partition("=")
            step = step.strip()
            if not eq or step not in TIMEOUT_DEFAULTS:
                raise UsageError(f"--timeout {item!r}: expected STEP=SECONDS with STEP one of "
                                 f"{', '.join(TIMEOUT_DEFAULTS)}", step="command line",
                                 hint="e.g. --timeout bench=7200 or --timeout build=600,bench=7200")
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if not seconds > 0:
                raise UsageError(f"--timeout {item!r}: {value!r} is not a positive number of seconds",
                                 step="command line", hint="e.g. --timeout bench=7200")
            out[step] = seconds
    return out


def apply_overrides(hosts: list[Host], hosts_dir: Path, timeouts: dict[str, float] | None = None) -> list[Host]:
    """Each host with its hosts/<name>.local.yaml merged in, then the --timeout values."""
    out = []
    for h in hosts:
        h = with_overlay(h, hosts_dir)
        if timeouts:
            h = dataclasses.replace(h, timeouts=dataclasses.replace(h.timeouts, **timeouts))
        out.append(h)
    return out


def cpu_profile(host: Host) -> bool:
    """A CPU host gets the quick defaults. cuda_arch is what says it: a GPU arch cannot be built
    or run without a GPU (doctor fails such a host), and `gpus` is optional, so a GPU host
    without that entry still gets the full profile."""
    return host.cuda_arch == "cpu"


def validate_bench_suites(suite: str | None, known: Iterable[str]) -> None:
    if suite is None:
        return
    known = tuple(known)
    names = [s.strip() for s in suite.split(",")]
    if names == ["selftest"]:
        return
    if names == ["all"]:
        return
    bad = [n for n in names if n not in known]
    if not names or bad or any(not n for n in names):
        raise UsageError(f"--suite {suite!r}: unknown suite {(bad or [''])[0]!r}", step="command line",
                         hint=f"known: {', '.join(known)}, all, or selftest (the pipeline's own check)")


def validate_test_suite(suite: str | None) -> None:
    if suite not in (None, *TEST_SUITES):
        raise UsageError(f"--suite {suite!r}: expected {' or '.join(TEST_SUITES)}", step="command line",
                         hint="native: cuda/run_tests.sh + pytest -m native; selftest: the pipeline's own check")


def validate_run(run: str | None) -> None:
    if run in (None, "latest", "all") or RUN_ID_RE.match(run):
        return
    raise UsageError(f"--run {run!r}: not a run id, latest or all", step="command line",
                     hint="a run id looks like 20261129T133011Z-4ae82b6-test")


def validate_profile(quick: bool, full: bool) -> None:
    if quick and full:
        raise UsageError("--quick and --full contradict each other", step="command line",
                         hint="give one: --quick for the short grid, --full for the whole one")
