"""What a run records about its code, host, GPUs, toolchain and build.

`collect(repo_root, build_dir=None) -> dict` returns the manifest's four provenance fields:

    {"git":        {"sha", "short", "branch", "dirty", "diff_sha256", "untracked", "tracked_changed"}
                   (or "source": why absent),
     "host_facts": {"hostname", "os", "kernel", "cpu_model", "cpu_cores", "memory_bytes",
                    "boot_id", "gpus": [{"index", "name", "uuid", "pci_bus_id", "memory_mib",
                    "compute_cap", "driver"}], "gpu_clocks": [...], "gpu_note"},
     "toolchain":  {"python", "numpy", "torch", "nvcc", "cmake", "cxx", "rsync"},
     "build":      {"arch", "commands", ...}  (DIR/build_info.json as written by cuda/build.sh)}

The host-side runner (engine/remote/runner.py) and the benchmarks (bench/) both call it, on
hosts whose synced source has no `.git`: there the git block comes from the environment
variable KDTREE_GIT_JSON, which the runner sets from the deploying checkout. Only the standard
library is used, so it imports on a bare host; every probe has a short timeout and a missing tool
is recorded as None, never an exception.

`sha256_file(path) -> str` is the digest a record gives each file: the runner's manifest, the
results store's checks and the benchmarks' weights cache (bench/weights.py) all use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

GIT_ENV = "KDTREE_GIT_JSON"
PROBE_TIMEOUT_S = 20

# Paths whose changes never make the engine "dirty": fetched results and generated reports.
NOT_ENGINE = (":(exclude)results", ":(exclude)docs/BENCHMARKS_*")

# nvidia-smi --query-gpu fields: identity (once) and clocks (before and after a run).
GPU_FIELDS = ("index", "name", "uuid", "pci.bus_id", "memory.total", "compute_cap", "driver_version")
GPU_KEYS = ("index", "name", "uuid", "pci_bus_id", "memory_mib", "compute_cap", "driver")
CLOCK_FIELDS = ("index", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
                "power.draw", "power.limit", "temperature.gpu", "persistence_mode",
                "clocks_throttle_reasons.active")
CLOCK_KEYS = ("index", "sm_mhz", "mem_mhz", "max_sm_mhz", "max_mem_mhz", "power_w",
              "power_limit_w", "temperature_c", "persistence_mode", "throttle_reasons")


def _probe(argv: list[str], cwd: str | Path | None = None,
           env: dict[str, str] | None = None) -> str | None:
    """stdout of argv, or None when the program is missing, fails or hangs."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                           env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of the file's bytes, read 1 MiB at a time (weights files are large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- git ------------------------------------------------------------------------------------

def read_only_git_env() -> dict[str, str]:
    """This process's environment with git's optional locks off (GIT_OPTIONAL_LOCKS=0): a
    status or diff then never writes the index."""
    return {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}


def git_info(repo_root: str | Path) -> dict:
    """sha, branch and dirty state of the checkout at repo_root.

    Dirty means tracked changes or untracked-not-ignored files outside results/ and the
    generated reports (NOT_ENGINE); `diff_sha256` then hashes `git diff HEAD --binary` plus every
    untracked file's path and bytes, so two runs with the same dirty state share the value.
    Without a checkout at repo_root the block comes from KDTREE_GIT_JSON, else says why not.
    """
    root = Path(repo_root).resolve()
    top = _probe(["git", "-C", str(root), "rev-parse", "--show-toplevel"])
    if top is None or Path(top.strip()).resolve() != root:
        if os.environ.get(GIT_ENV):
            block = json.loads(os.environ[GIT_ENV])
            block.setdefault("source", f"${GIT_ENV} (the deploying checkout)")
            return block
        return {"sha": None, "short": None, "branch": None, "dirty": None,
                "source": f"no git checkout at {root} and ${GIT_ENV} is unset"}
    git = ["git", "-C", str(root)]
    # Read only: `git status` otherwise refreshes the index and takes .git/index.lock, and a
    # commit in another thread (hosts fetch in parallel) then fails on the lock.
    env = read_only_git_env()
    sha = (_probe(git + ["rev-parse", "HEAD"], env=env) or "").strip() or None
    branch = (_probe(git + ["rev-parse", "--abbrev-ref", "HEAD"], env=env) or "").strip() or None
    status = _probe(git + ["status", "--porcelain", "--untracked-files=all", "--", "."] + list(NOT_ENGINE),
                    env=env) or ""
    dirty = bool(status.strip())
    untracked = sorted(line[3:] for line in status.splitlines() if line.startswith("??"))
    diff_sha = None
    if dirty:
        h = hashlib.sha256()
        h.update(subprocess.run(git + ["diff", "HEAD", "--binary", "--", "."] + list(NOT_ENGINE),
                                capture_output=True, timeout=PROBE_TIMEOUT_S, env=env).stdout)
        for rel in untracked:
            h.update(rel.encode() + b"\0")
            p = root / rel
            if p.is_file():
                h.update(p.read_bytes())
        diff_sha = h.hexdigest()
    tracked = sum(1 for line in status.splitlines() if line.strip() and not line.startswith("??"))
    return {"sha": sha, "short": sha[:10] if sha else None, "branch": branch, "dirty": dirty,
            "diff_sha256": diff_sha, "untracked": len(untracked), "tracked_changed": tracked}


# ---- host and GPUs --------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpu_model() -> str | None:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _memory_bytes() -> int | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # the file says kB and means KiB
    return None


def _os_name() -> str:
    for line in (_read("/etc/os-release") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip().strip('"')
    return platform.platform()


def _csv_rows(text: str, keys: tuple[str, ...]) -> list[dict]:
    """nvidia-smi `--format=csv,noheader,nounits` rows as dicts; `[N/A]`-like cells -> None."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(keys):
            continue  # a line nvidia-smi added (a warning), not a row
        row = {}
        for k, c in zip(keys, cells):
            if c.startswith("[") or c in ("", "N/A"):
                row[k] = None
                continue
            try:
                row[k] = int(c) if k in ("index", "memory_mib") else (
                    float(c) if k.endswith(("_mhz", "_w", "_c")) else c)
            except ValueError:
                row[k] = c
        rows.append(row)
    return rows


def _smi(fields: tuple[str, ...], keys: tuple[str, ...]) -> list[dict] | None:
    out = _probe(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    return None if out is None else _csv_rows(out, keys)


def gpu_facts() -> tuple[list[dict], str | None]:
    """(GPUs from nvidia-smi, a note when there are none or it failed)."""
    if shutil.which("nvidia-smi") is None:
        return [], "nvidia-smi not found on PATH"
    rows = _smi(GPU_FIELDS, GPU_KEYS)
    if rows is None:
        return [], "nvidia-smi --query-gpu failed"
    return rows, None


def gpu_clocks() -> list[dict]:
    """Clocks, power and throttle reasons per GPU, taken before and after each run."""
    if shutil.which("nvidia-smi") is None:
        return []
    rows = _smi(CLOCK_FIELDS, CLOCK_KEYS)
    if rows is None:  # an older driver that lacks a field: fall back to the clocks alone
        rows = _smi(CLOCK_FIELDS[:5], CLOCK_KEYS[:5]) or []
    return rows


def host_facts() -> dict:
    gpus, note = gpu_facts()
    return {
        "hostname": socket.gethostname(),
        "os": _os_name(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "boot_id": (_read("/proc/sys/kernel/random/boot_id") or "").strip() or None,
        "gpus": gpus,
        "gpu_note": note,
        "gpu_clocks": gpu_clocks(),
    }


# ---- toolchain and build --------------------------------------------------------------------

def _first_line(text: str | None, last: bool = False) -> str | None:
    lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
    return (lines[-1] if last else lines[0]) if lines else None


def _release_line(text: str | None) -> str | None:
    """nvcc's "Cuda compilation tools, release 13.0, V13.0.88" line."""
    lines = [l.strip() for l in (text or "").splitlines() if "release" in l]
    return lines[0] if lines else _first_line(text, last=True)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def toolchain() -> dict:
    return {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "numpy": _dist_version("numpy"),
        "torch": _dist_version("torch"),
        "nvcc": _release_line(_probe(["nvcc", "--version"])),
        "cmake": _first_line(_probe(["cmake", "--version"])),
        "cxx": _first_line(_probe(["g++", "--version"])),
        "rsync": _first_line(_probe(["rsync", "--version"])),
    }


def build_info(build_dir: str | Path | None) -> dict:
    """DIR/build_info.json (the exact compile and link lines), or why it is absent."""
    if build_dir is None:
        return {"source": "no build directory given"}
    path = Path(build_dir) / "build_info.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return {"source": f"{path} does not exist (not built?)"}
    except (OSError, ValueError) as e:
        return {"source": f"{path} is unreadable: {e}"}
    info["source"] = str(path)
    return info


def collect(repo_root: str | Path, build_dir: str | Path | None = None) -> dict:
    """The manifest's `git`, `host_facts`, `toolchain` and `build` fields, measured now."""
    return {"git": git_info(repo_root), "host_facts": host_facts(),
            "toolchain": toolchain(), "build": build_info(build_dir)}


if __name__ == "__main__":  # `python -m engine.remote.provenance [REPO] [BUILD_DIR]`: print it
    args = sys.argv[1:]
    print(json.dumps(collect(args[0] if args else ".", args[1] if len(args) > 1 else None), indent=2))
