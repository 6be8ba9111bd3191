"""`invoke doctor`: does a host have what the pipeline needs, and does it match its inventory?

check_host(transport, host) -> [{"check", "status": "ok"|"warn"|"FAIL", "detail"}]

Connecting at all (and the host key) is checked by opening the transport; the rest is probed
with one shell script, so a slow link costs one round trip. FAIL means a pipeline step will
fail there (no python/numpy, no g++, nvcc missing for a GPU arch, fewer GPUs than the inventory
says, an arch the GPUs cannot run, under 1 GiB free); warn means slower or degraded (no rsync:
tar is used; no cmake: build.sh calls the compilers itself; no pytest: only test-remote's pytest
step fails).
"""

from __future__ import annotations

import shlex

from .inventory import Host
from .transport import Transport

MIN_FREE_KIB = 1 << 20     # 1 GiB: below it, a build or a run will fail
WARN_FREE_KIB = 10 << 20   # 10 GiB

_PROBE = r"""
for p in g++ nvcc cmake rsync tar nvidia-smi; do
  if command -v $p >/dev/null 2>&1; then echo "tool $p yes"; else echo "tool $p no"; fi
done
echo "python $({PY} -c 'import sys; print(sys.version.split()[0])' 2>&1 | tail -n 1)"
echo "numpy $({PY} -c 'import numpy; print(numpy.__version__)' 2>&1 | tail -n 1)"
echo "pytest $({PY} -c 'import pytest; print(pytest.__version__)' 2>&1 | tail -n 1)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits 2>&1 | sed 's/^/gpu /'
fi
mkdir -p {RD} 2>/dev/null && test -w {RD} && echo "writable yes" || echo "writable no"
echo "df $(df -Pk {RD} 2>/dev/null | tail -n 1 | awk '{print $4}')"
"""


def parse_probe(text: str) -> dict:
    facts: dict = {"tools": {}, "gpus": []}
    for line in text.splitlines():
        key, _, rest = line.partition(" ")
        if key == "tool":
            name, _, yes = rest.partition(" ")
            facts["tools"][name] = yes == "yes"
        elif key == "gpu":
            cells = [c.strip() for c in rest.split(",")]
            if len(cells) == 3:
                facts["gpus"].append({"name": cells[0], "compute_cap": cells[1], "memory_mib": cells[2]})
            else:
                facts.setdefault("gpu_error", rest)
        elif key in ("python", "numpy", "pytest", "writable", "df"):
            facts[key] = rest.strip()
    return facts


def _arch_caps(arch: str) -> list[str]:
    """sm_90,sm_120 -> ["9.0", "12.0"] (nvidia-smi's compute_cap spelling)."""
    caps = []
    for a in arch.split(","):
        if a.startswith("sm_"):
            n = a[3:].rstrip("abcdefghijklmnopqrstuvwxyz")
            caps.append(f"{n[:-1]}.{n[-1]}")
    return caps


def evaluate(facts: dict, host: Host) -> list[dict]:
    checks = []

    def add(name: str, status: str, detail: str) -> None:
        checks.append({"check": name, "status": status, "detail": detail})

    add("connect", "ok", host.address + (f" (host key verified, policy {host.host_key_policy})"
                                         if host.transport == "ssh" else ""))
    py, np = facts.get("python", ""), facts.get("numpy", "")
    py_ok = py[:1].isdigit()
    add("python", "ok" if py_ok else "FAIL", f"{host.python} {py}" if py_ok else f"{host.python}: {py or 'not found'}")
    np_ok = np[:1].isdigit()
    add("numpy", "ok" if np_ok else "FAIL", np if np_ok else f"cannot import numpy: {np or 'no output'}")
    pt = facts.get("pytest", "")
    add("pytest", "ok" if pt[:1].isdigit() else "warn", pt if pt[:1].isdigit() else
        f"cannot import pytest ({pt or 'no output'}): test-remote's pytest step will fail; bench is unaffected")
    tools = facts.get("tools", {})
    add("g++", "ok" if tools.get("g++") else "FAIL", "present" if tools.get("g++") else "missing: the build needs it")
    gpu_arch = host.cuda_arch != "cpu"
    add("nvcc", "ok" if tools.get("nvcc") else ("FAIL" if gpu_arch else "ok"),
        "present" if tools.get("nvcc") else
        (f"missing: cuda_arch {host.cuda_arch} needs it" if gpu_arch else "absent (cuda_arch cpu does not need it)"))
    add("cmake", "ok" if tools.get("cmake") else "warn",
        "present" if tools.get("cmake") else "absent: build.sh calls nvcc/g++ itself")
    if tools.get("rsync"):
        add("rsync", "ok", "present (the sync also needs it locally)")
    else:
        add("rsync", "warn" if tools.get("tar") else "FAIL",
            "absent: sync sends a tar of changed files" if tools.get("tar") else "neither rsync nor tar")
    gpus = facts.get("gpus", [])
    want = host.gpus
    if want.count:
        if not tools.get("nvidia-smi"):
            add("gpus", "FAIL", f"inventory expects {want.count} x {want.model or 'GPU'}, nvidia-smi is missing")
        else:
            models = sorted({g["name"] for g in gpus})
            ok = len(gpus) >= want.count and (not want.model or all(want.model in g["name"] for g in gpus))
            add("gpus", "ok" if ok else "FAIL", f"found {len(gpus)} x {', '.join(models) or 'none'}; "
                f"inventory expects {want.count} x {want.model or 'any'}" + (
                    f" ({facts['gpu_error']})" if facts.get("gpu_error") else ""))
    else:
        add("gpus", "ok", f"found {len(gpus)}; the inventory expects none")
    if host.cuda_arch == "native":
        add("cuda_arch", "ok" if gpus else "FAIL", "native: nvcc picks the GPUs present" if gpus else "native needs a GPU")
    elif gpu_arch:
        caps = sorted({g["compute_cap"] for g in gpus})
        ok = bool(gpus) and set(caps) <= set(_arch_caps(host.cuda_arch))
        add("cuda_arch", "ok" if ok else "FAIL",
            f"{host.cuda_arch} covers compute capability {', '.join(caps)}" if ok else
            f"{host.cuda_arch} builds for {', '.join(_arch_caps(host.cuda_arch))}, the GPUs are {', '.join(caps) or 'absent'}")
    else:
        add("cuda_arch", "ok", "cpu: the CPU backends only")
    add("remote_dir", "ok" if facts.get("writable") == "yes" else "FAIL",
        f"{host.remote_dir} is writable" if facts.get("writable") == "yes" else f"cannot create or write {host.remote_dir}")
    free = facts.get("df", "")
    if free.isdigit():
        kib = int(free)
        status = "FAIL" if kib < MIN_FREE_KIB else "warn" if kib < WARN_FREE_KIB else "ok"
        add("disk", status, f"{kib / (1 << 20):.1f} GiB free in {host.remote_dir}")
    else:
        add("disk", "warn", f"df gave no free space for {host.remote_dir}")
    return checks


def check_host(t: Transport, host: Host) -> list[dict]:
    script = _PROBE.replace("{PY}", shlex.quote(host.python)).replace("{RD}", shlex.quote(t.remote_dir))
    r = t.run(script, timeout=max(host.timeouts.connect, 60))
    return evaluate(parse_probe(r.stdout), host)
