"""`invoke doctor`: does a host have what the pipeline needs, and does it match its inventory?

check_host(transport, host) -> [{"check", "status": "ok"|"warn"|"FAIL", "detail"}]

Connecting at all (and the host key) is checked by opening the transport; the rest is probed
with one shell script, so a slow link costs one round trip. FAIL means a pipeline step will
fail there (no python, a module of MODULES missing (numpy, torch, safetensors, yaml, aiohttp,
pytest; their versions are shown), no g++, nvcc or nvidia-smi missing for a GPU arch, fewer GPUs
than the inventory says, an arch the GPUs cannot run, under 1 GiB free): doctor ok means deploy,
test-remote and bench can run. warn means slower or degraded (no rsync: tar is used; no cmake:
build.sh calls the compilers itself).
"""

from __future__ import annotations

import shlex

from .inventory import Host
from .transport import Transport

MIN_FREE_KIB = 1 << 20     # 1 GiB: below it, a build or a run will fail
WARN_FREE_KIB = 10 << 20   # 10 GiB

# Python modules the pipeline imports on the host, and who needs them (a missing one is FAIL).
MODULES = {
    "numpy": "everything (the reference, bundles, benches)",
    "torch": "bench (tree_build, e2e) and the native engine tests",
    "safetensors": "deploy's bundles step (python -m engine.kdtr generate) and the weights",
    "yaml": "the engine's configs and the tests",
    "aiohttp": "the server and the service suite (and test-remote's serving tests)",
    "pytest": "test-remote's pytest step",
}

_MODULES_PY = (
    "import importlib, sys\n"
    "for m in sys.argv[1:]:\n"
    "    try:\n"
    "        mod = importlib.import_module(m)\n"
    "        v = getattr(mod, '__version__', '?')\n"
    "        if m == 'torch':\n"
    "            v += ' (cuda %s, %s)' % (mod.version.cuda, 'GPU visible' if mod.cuda.is_available() else 'no GPU visible')\n"
    "        print('module', m, 'ok', v)\n"
    "    except Exception as e:\n"
    "        print('module', m, 'missing', ' '.join(('%s: %s' % (type(e).__name__, e)).split()))\n"
)

_PROBE = r"""
for p in g++ nvcc cmake rsync tar nvidia-smi; do
  if command -v $p >/dev/null 2>&1; then echo "tool $p yes"; else echo "tool $p no"; fi
done
echo "python $({PY} -c 'import sys; print(sys.version.split()[0])' 2>&1 | tail -n 1)"
{PY} -c {MODULES_PY} {MODULES} 2>&1 | grep '^module ' || echo "module all missing $({PY} -V 2>&1 | tail -n 1)"
echo "version g++ $(g++ --version 2>/dev/null | head -n 1)"
echo "version nvcc $(nvcc --version 2>/dev/null | tail -n 1)"
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
        elif key == "module":
            name, _, more = rest.partition(" ")
            state, _, detail = more.partition(" ")
            facts.setdefault("modules", {})[name] = {"ok": state == "ok", "detail": detail.strip()}
        elif key == "version":
            name, _, text = rest.partition(" ")
            facts.setdefault("versions", {})[name] = text.strip()
        elif key in ("python", "writable", "df"):
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


def want_gpus_checked(host: Host) -> bool:
    """The gpus check (below) already covers nvidia-smi when the inventory expects GPUs."""
    return host.gpus.count > 0


def evaluate(facts: dict, host: Host) -> list[dict]:
    checks = []

    def add(name: str, status: str, detail: str) -> None:
        checks.append({"check": name, "status": status, "detail": detail})

    add("connect", "ok", host.address + (f" (host key verified, policy {host.host_key_policy})"
                                         if host.transport == "ssh" else ""))
    py = facts.get("python", "")
    py_ok = py[:1].isdigit()
    add("python", "ok" if py_ok else "FAIL", f"{host.python} {py}" if py_ok else f"{host.python}: {py or 'not found'}")
    mods = facts.get("modules", {})
    for name, who in MODULES.items():
        m = mods.get(name) or mods.get("all") or {"ok": False, "detail": "not probed"}
        add(name, "ok" if m["ok"] else "FAIL", m["detail"] if m["ok"] else
            f"cannot import {name} with {host.python} ({m['detail'] or 'no output'}): needed by {who}")
    tools = facts.get("tools", {})
    versions = facts.get("versions", {})
    add("g++", "ok" if tools.get("g++") else "FAIL",
        (versions.get("g++") or "present") if tools.get("g++") else "missing: the build needs it")
    gpu_arch = host.cuda_arch != "cpu"
    add("nvcc", "ok" if tools.get("nvcc") else ("FAIL" if gpu_arch else "ok"),
        (versions.get("nvcc") or "present") if tools.get("nvcc") else
        (f"missing: cuda_arch {host.cuda_arch} needs it" if gpu_arch else "absent (cuda_arch cpu does not need it)"))
    if gpu_arch and not want_gpus_checked(host):
        add("nvidia-smi", "ok" if tools.get("nvidia-smi") else "FAIL",
            "present" if tools.get("nvidia-smi") else f"missing: cuda_arch {host.cuda_arch} needs a GPU and its driver")
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
    script = (_PROBE.replace("{PY}", shlex.quote(host.python)).replace("{RD}", shlex.quote(t.remote_dir))
              .replace("{MODULES_PY}", shlex.quote(_MODULES_PY)).replace("{MODULES}", " ".join(MODULES)))
    r = t.run(script, timeout=max(host.timeouts.connect, 60))
    return evaluate(parse_probe(r.stdout), host)
