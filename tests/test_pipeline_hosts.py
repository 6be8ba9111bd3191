"""Several hosts (pipeline.run_hosts), per-host output (progress.py) and doctor's verdicts."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from engine.remote import doctor, pipeline
from engine.remote.errors import BuildFailed, HostUnreachable
from engine.remote.inventory import parse_host
from engine.remote.outcome import INTERNAL_ERROR_EXIT, Outcome
from engine.remote.plan import Options
from engine.remote.progress import Progress


def host(name: str, **fields):
    data = {"transport": "local", "remote_dir": f"/srv/kd/{name}", "cuda_arch": "cpu", **fields}
    return parse_host(name, data, source=Path(f"/hosts/{name}.yaml"))


def test_run_hosts_parallel_isolated_worst_exit(tmp_path):
    barrier = threading.Barrier(3, timeout=10)  # all three must be running at once

    def task(h, repo_root, opts, progress):
        barrier.wait()
        progress.logger(h.name)("working")
        if h.name == "down":
            raise HostUnreachable("connection refused")
        if h.name == "bug":
            raise KeyError("oops")
        return Outcome(h.name, "task", "fine", run_ids=["R"])

    out = io.StringIO()
    hosts = [host("good"), host("down"), host("bug")]
    outcomes = pipeline.run_hosts(task, hosts, tmp_path, Options(), Progress([h.name for h in hosts], stream=out, live=False))
    assert [o.host for o in outcomes] == ["good", "down", "bug"]
    good, down, bug = outcomes
    assert good.exit_code == 0 and good.run_ids == ["R"]
    assert down.exit_code == 3 and str(down.error) == "error: down: task: connection refused"
    assert bug.exit_code == INTERNAL_ERROR_EXIT and "internal error: KeyError" in str(bug.error)
    assert "KeyError: 'oops'" in (tmp_path / ".kdtree/debug.log").read_text()
    assert pipeline.worst_exit(outcomes) == INTERNAL_ERROR_EXIT
    assert pipeline.worst_exit(outcomes[:2]) == 3
    lines = out.getvalue().splitlines()
    for name in ("good", "down", "bug"):
        assert f"[{name}] working" in lines


def test_outcome_exit_codes():
    assert Outcome("h", "t").exit_code == 0
    assert Outcome("h", "t", error=BuildFailed("x")).exit_code == 4
    assert Outcome("h", "t", error=BuildFailed("x")).to_dict()["error"] == "error: x"


def test_progress_plain_lines_are_prefixed(tmp_path):
    out = io.StringIO()
    p = Progress(["a"], stream=out, live=False)
    p.line("a", "one\ntwo")
    p.output("a")("stdout", "remote line")
    assert out.getvalue().splitlines() == ["[a] one", "[a] two", "[a]   remote line"]
    assert Progress(["a"], stream=out, live=False, quiet_output=True).output("a") is None


PROBE_OK = """tool g++ yes
tool nvcc yes
tool cmake no
tool rsync no
tool tar yes
tool nvidia-smi yes
python 3.11.7
module numpy ok 2.1.0
module torch ok 2.5.1 (cuda 12.4, GPU visible)
module safetensors ok 0.4.5
module yaml ok 6.0.2
module aiohttp ok 3.10.0
module pytest ok 8.3.0
version g++ g++ (Ubuntu 13.2.0) 13.2.0
version nvcc Build cuda_12.4.r12.4/compiler.0
gpu NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 97887
gpu NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 97887
writable yes
df 52428800
"""


def checks_by_name(checks):
    return {c["check"]: c for c in checks}


def test_doctor_a_matching_gpu_host():
    h = host("ct", cuda_arch="sm_120", gpus={"count": 2, "model": "RTX PRO 6000"})
    c = checks_by_name(doctor.evaluate(doctor.parse_probe(PROBE_OK), h))
    assert all(v["status"] != "FAIL" for v in c.values()), c
    assert c["cmake"]["status"] == "warn" and c["rsync"]["status"] == "warn" and "tar" in c["rsync"]["detail"]
    assert c["cuda_arch"]["status"] == "ok" and "12.0" in c["cuda_arch"]["detail"]
    assert c["disk"]["detail"].startswith("50.0 GiB") and c["pytest"]["status"] == "ok"


def test_doctor_mismatches_fail_with_reasons():
    h = host("h200", cuda_arch="sm_90", gpus={"count": 4, "model": "H200"})
    probe = PROBE_OK.replace("module numpy ok 2.1.0", "module numpy missing ModuleNotFoundError: No module named 'numpy'").replace(
        "df 52428800", "df 1000").replace("tool nvcc yes", "tool nvcc no").replace(
        "module torch ok 2.5.1 (cuda 12.4, GPU visible)", "module torch missing ModuleNotFoundError: No module named 'torch'")
    c = checks_by_name(doctor.evaluate(doctor.parse_probe(probe), h))
    failed = {k for k, v in c.items() if v["status"] == "FAIL"}
    assert failed == {"numpy", "torch", "nvcc", "gpus", "cuda_arch", "disk"}, c
    assert "No module named 'torch'" in c["torch"]["detail"] and "bench" in c["torch"]["detail"]
    assert "No module named" in c["numpy"]["detail"] and "sm_90 needs it" in c["nvcc"]["detail"]
    assert "found 2" in c["gpus"]["detail"] and "expects 4 x H200" in c["gpus"]["detail"]
    assert "builds for 9.0, the GPUs are 12.0" == c["cuda_arch"]["detail"].split(" ", 1)[1]
    assert c["pytest"]["detail"] == "8.3.0" and c["g++"]["detail"].endswith("13.2.0")


def test_doctor_gpu_arch_without_gpus_entry_needs_nvidia_smi():
    h = host("g", cuda_arch="sm_90")
    probe = PROBE_OK.replace("tool nvidia-smi yes", "tool nvidia-smi no")
    c = checks_by_name(doctor.evaluate(doctor.parse_probe(probe), h))
    assert c["nvidia-smi"]["status"] == "FAIL" and "sm_90" in c["nvidia-smi"]["detail"]


def test_doctor_fails_when_the_hosts_python_lacks_torch(tmp_path):
    """A host whose python cannot import torch (a blocker module first on its PYTHONPATH): doctor
    exits 5 naming torch, instead of reporting ok and letting the deploy fail."""
    import subprocess
    import sys
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "torch.py").write_text("raise ImportError('torch is not installed for this python')\n")
    hf = tmp_path / "nt.yaml"
    hf.write_text(f"transport: local\nremote_dir: {tmp_path / 'rd'}\ncuda_arch: cpu\npython: {sys.executable}\n"
                  f"env: {{PYTHONPATH: {blocker}}}\n")
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "invoke", "doctor", "--host", str(hf)], cwd=repo,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 5, (r.returncode, r.stdout, r.stderr)
    assert "FAIL  torch: cannot import torch" in r.stderr and "numpy" not in r.stderr.split("error:")[-1], r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: nt: doctor: torch: cannot import torch"), r.stderr


def test_doctor_on_this_machine_local_transport(tmp_path):
    from engine.remote.transport import LocalTransport
    h = parse_host("me", {"transport": "local", "remote_dir": str(tmp_path / "rd"), "cuda_arch": "cpu"}, source=None)
    c = checks_by_name(doctor.check_host(LocalTransport(h), h))
    assert c["python"]["status"] == "ok" and c["numpy"]["status"] == "ok" and c["remote_dir"]["status"] == "ok"
    assert (tmp_path / "rd").is_dir()
