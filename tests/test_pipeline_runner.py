"""The host-side runner (engine/remote/runner.py): step outcomes, timeouts, JUnit, the manifest."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.remote import runner

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def run(tmp_path: Path, steps: list[dict], **extra) -> tuple[int, dict]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    req = {"schema": 1, "run_id": "RID", "kind": "test", "host": {"name": "h", "address": "x"},
           "git": {"sha": "c" * 40, "dirty": False}, "steps": steps, **extra}
    (run_dir / "request.json").write_text(json.dumps(req))
    r = subprocess.run([PY, "-m", "engine.remote.runner", str(run_dir)], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    manifest = json.loads((run_dir / "manifest.json").read_text()) if (run_dir / "manifest.json").exists() else {}
    return r.returncode, manifest


JUNIT_OK = '<testsuite tests="2"><testcase name="a"/><testcase name="b"><skipped/></testcase></testsuite>'
JUNIT_BAD = '<testsuites><testsuite><testcase name="a"><failure message="x"/></testcase></testsuite></testsuites>'


def write_junit(xml: str) -> list[str]:
    return [PY, "-c", f"import sys; open(sys.argv[1], 'w').write({xml!r})", "{run}/j.xml"]


def test_all_ok_manifest_is_complete_and_hashes_match(tmp_path):
    argv = [a.replace("{run}", str(tmp_path / "run")) for a in write_junit(JUNIT_OK)]
    code, m = run(tmp_path, [{"name": "unit", "argv": argv, "timeout": 60, "junit": "j.xml"},
                             {"name": "echo", "argv": ["sh", "-c", "echo hello from $KDT_X"],
                              "env": {"KDT_X": "the env"}}])
    assert code == 0 and m["ok"] is True
    assert m["status"]["unit"]["status"] == "ok" and m["status"]["unit"]["tests"] == {"tests": 2, "failures": 0, "errors": 0, "skipped": 1}
    assert m["summary"] == "test: unit 1 passed, 0 failed, 1 skipped; echo ok"
    run_dir = tmp_path / "run"
    assert "hello from the env" in (run_dir / "logs/echo.log").read_text()
    listed = {f["path"]: f for f in m["files"]}
    assert set(listed) == {"j.xml", "logs/unit.log", "logs/echo.log", "request.json", "status.json"}
    for rel, f in listed.items():
        data = (run_dir / rel).read_bytes()
        assert f["size"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest(), rel
    assert m["git"]["sha"] == "c" * 40 and m["run_id"] == "RID" and m["schema"] == 1
    for key in ("host_facts", "toolchain", "build", "started", "finished"):
        assert key in m, key
    assert set(m["host_facts"]["gpu_clocks"]) == {"before", "after"}
    assert not list(run_dir.glob("*.tmp"))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"


def test_failures_timeouts_signals_and_missing_junit(tmp_path):
    t0 = time.monotonic()
    argv_bad = [a.replace("{run}", str(tmp_path / "run")) for a in write_junit(JUNIT_BAD)]
    code, m = run(tmp_path, [
        {"name": "exit3", "argv": ["sh", "-c", "exit 3"]},
        {"name": "sleepy", "argv": ["sh", "-c", "sleep 60 & sleep 60; wait"], "timeout": 1},
        {"name": "segv", "argv": ["sh", "-c", "kill -SEGV $$"]},
        {"name": "nojunit", "argv": ["true"], "junit": "never.xml"},
        {"name": "badjunit", "argv": argv_bad, "junit": "j.xml"},
        {"name": "nothing", "argv": ["sh", "-c", "exit 5"], "skip_codes": {"5": "no tests selected"}},
        {"name": "missing", "argv": ["/nonexistent/prog"]},
    ])
    assert time.monotonic() - t0 < 30, "the timed-out step's whole group must be killed"
    s = m["status"]
    assert code == 1 and m["ok"] is False
    assert s["exit3"]["status"] == "failed" and s["exit3"]["exit_code"] == 3
    assert s["sleepy"]["status"] == "failed" and "timed out after 1 s" in s["sleepy"]["reason"]
    assert s["segv"]["status"] == "failed" and s["segv"]["signal"] == "SIGSEGV"
    assert s["nojunit"]["status"] == "failed" and "never.xml was not written" in s["nojunit"]["reason"]
    assert s["badjunit"]["status"] == "failed" and s["badjunit"]["tests"]["failures"] == 1
    assert s["nothing"]["status"] == "skipped" and s["nothing"]["reason"] == "no tests selected"
    assert s["missing"]["status"] == "failed" and "could not start" in s["missing"]["reason"]


def test_planned_skips_are_recorded(tmp_path):
    code, m = run(tmp_path, [{"name": "a", "argv": ["true"]}], skipped={"native-tests": "no run_tests.sh"})
    assert code == 0 and m["status"]["native-tests"] == {"status": "skipped", "reason": "no run_tests.sh"}


def test_bad_request_and_final_run_refused(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "request.json").write_text('{"run_id": "x"}')
    assert runner.main([str(d)]) == 5
    code, m = run(tmp_path, [{"name": "a", "argv": ["true"]}])
    assert code == 0
    assert runner.main([str(tmp_path / "run")]) == 5  # a final manifest is never rewritten


def test_runner_releases_a_handed_lock_only_with_its_token(tmp_path):
    lock = tmp_path / ".lock"
    lock.mkdir()
    (lock / "owner.json").write_text(json.dumps({"token": "other"}))
    runner.release_lock({"path": str(lock), "token": "mine"})
    assert lock.is_dir()
    (lock / "owner.json").write_text(json.dumps({"token": "mine"}))
    runner.release_lock({"path": str(lock), "token": "mine"})
    assert not lock.exists() and not list(tmp_path.glob(".lock*"))


def test_junit_counts_suite_attributes_only(tmp_path):
    p = tmp_path / "j.xml"
    p.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2"/></testsuites>')
    assert runner.junit_counts(p) == {"tests": 4, "failures": 1, "errors": 0, "skipped": 2}


@pytest.mark.parametrize("fail", [False, True])
def test_selftest_suite(tmp_path, fail):
    env = {**os.environ, "PYTHONPATH": str(REPO), "KDTREE_SELFTEST_FAIL": "1" if fail else "0"}
    r = subprocess.run([PY, "-m", "engine.remote.selftest", "test", "--junit", str(tmp_path / "j.xml")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == (1 if fail else 0), r.stdout + r.stderr
    assert runner.junit_counts(tmp_path / "j.xml")["failures"] == (1 if fail else 0)
    r = subprocess.run([PY, "-m", "engine.remote.selftest", "bench", "--out", str(tmp_path / "b"), "--quick"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    doc = json.loads((tmp_path / "b/selftest.json").read_text())
    assert r.returncode == 0 and len(doc["results"][0]["samples"]) == 5


def test_step_output_and_progress_reach_the_runners_stdout_as_they_come(tmp_path, monkeypatch):
    """The runner passes each step's new log lines on to its own stdout while the step runs (the
    client follows that: live progress), with a heartbeat when the step is quiet."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = ("import time\n"
              "print('progress: s (1/1) case 1/2, 0 s elapsed', flush=True)\n"
              "time.sleep(1.2)\n"
              "print('progress: s (1/1) case 2/2, 1 s elapsed', flush=True)\n")
    req = {"schema": 1, "run_id": "RID", "kind": "bench", "host": {"name": "h", "address": "x"},
           "git": {"sha": "c" * 40}, "steps": [{"name": "b", "argv": [PY, "-c", script], "timeout": 60}]}
    (run_dir / "request.json").write_text(json.dumps(req))
    monkeypatch.setattr(runner, "HEARTBEAT_S", 0.5)
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    monkeypatch.setattr(runner, "_say", lambda line: lines.append((time.monotonic() - t0, line)))
    assert runner.main([str(run_dir)]) == 0
    text = [l for _, l in lines]
    first = next(t for t, l in lines if "case 1/2" in l)
    second = next(t for t, l in lines if "case 2/2" in l)
    assert second - first > 0.8, lines  # the first line came before the step ended
    assert text[0] == "runner: step b (1/1) started" and any(l.startswith("runner: step b (1/1) ok") for l in text)
    assert any(l.startswith("progress: step b (1/1), ") for l in text), text  # the heartbeat


def test_a_terminated_runner_marks_the_run_interrupted(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    req = {"schema": 1, "run_id": "RID", "kind": "bench", "host": {"name": "h", "address": "x"},
           "git": {"sha": "c" * 40}, "steps": [{"name": "b", "argv": ["sleep", "60"], "timeout": 120},
                                               {"name": "c", "argv": ["true"]}]}
    (run_dir / "request.json").write_text(json.dumps(req))
    p = subprocess.Popen([PY, "-m", "engine.remote.runner", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    for line in p.stdout:
        if "step b (1/2) started" in line:
            break
    time.sleep(0.3)
    p.terminate()
    assert p.wait(timeout=60) == 130
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["state"] == "interrupted" and m["ok"] is False and m["interrupted"] == {"signal": "SIGTERM"}
    assert m["status"]["b"]["status"] == "interrupted" and m["status"]["c"]["status"] == "skipped"
