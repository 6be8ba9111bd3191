"""End-to-end: the real `python3 -m invoke ...` commands against a real sshd on 127.0.0.1.

Each test works in a throwaway clone of the repository (tests/e2e_helpers.py) with hosts
written as YAML files outside it (so the clone stays clean) pointing at the loopback sshd of
tests/conftest.py, each with its own remote_dir under a temp folder. Runs use the built-in
`selftest` suites (engine/remote/selftest.py) to stay fast on two cores, and `--no-build`
except in the first test, which builds the real native library on the "remote" (cpu arch).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from e2e_helpers import Invoke, explain, git, make_clone, run_ids
from engine.remote.loopback import LoopbackSshd, path_without, sshd_missing_reason

pytestmark = pytest.mark.e2e

RUN_ID = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{7}(-dirty)?-(test|bench)$")


@pytest.fixture
def clone(tmp_path):
    return make_clone(tmp_path / "repo")


@pytest.fixture
def hosts_dir(tmp_path):
    d = tmp_path / "hosts"
    d.mkdir()
    return d


def host_yaml(sshd, hosts_dir: Path, tmp_path: Path, name: str, **extra) -> Path:
    return sshd.write_host_yaml(hosts_dir / f"{name}.yaml", remote_dir=str(tmp_path / f"remote-{name}"), **extra)


def committed_paths(clone: Path) -> list[str]:
    return sorted(git(clone, "show", "--name-only", "--format=", "HEAD").split())


def test_four_tasks_in_sequence_build_and_commit(loopback_sshd, clone, hosts_dir, tmp_path):
    """deploy (real cpu build) -> test-remote -> bench -> fetch-results -> one commit of exactly
    the run folders; a second deploy sends nothing and does not rebuild."""
    h = str(host_yaml(loopback_sshd, hosts_dir, tmp_path, "loop"))
    inv = Invoke(clone)
    r = inv("deploy", "--host", h, timeout=600)
    assert r.returncode == 0, explain(r)
    remote = tmp_path / "remote-loop"
    assert (remote / "build/cpu/libkdtree.so").is_file(), explain(r)
    info = json.loads((remote / "build/cpu/build_info.json").read_text())
    assert info["arch"] == "cpu" and info["commands"], info
    assert "[loop]" in r.stderr and "loop: deploy: ok" in r.stdout, explain(r)

    r = inv("deploy", "--host", h)
    assert r.returncode == 0, explain(r)
    assert re.search(r"0 sent, \d+ unchanged, 0 deleted", r.stdout) and "build up to date" in r.stdout, explain(r)

    r = inv("test-remote", "--host", h, "--no-deploy", "--suite", "selftest", "--json")
    assert r.returncode == 0, explain(r)
    (test_id,) = run_ids(r)
    r = inv("bench", "--host", h, "--no-deploy", "--suite", "selftest", "--quick", "--json")
    assert r.returncode == 0, explain(r)
    (bench_id,) = run_ids(r)
    assert RUN_ID.match(test_id) and RUN_ID.match(bench_id), (test_id, bench_id)

    head_before = git(clone, "rev-parse", "HEAD").strip()
    r = inv("fetch-results", "--host", h)
    assert r.returncode == 0, explain(r)
    assert git(clone, "rev-parse", "HEAD^").strip() == head_before, "exactly one new commit"
    paths = committed_paths(clone)
    assert paths and all(p.startswith((f"results/loop/{test_id}/", f"results/loop/{bench_id}/", "docs/BENCHMARKS_loop"))
                         for p in paths), paths
    assert f"results/loop/{bench_id}/selftest.json" in paths, paths
    msg = git(clone, "log", "-1", "--format=%B")
    sha = git(clone, "rev-parse", "HEAD^").strip()
    assert "loop" in msg and test_id in msg and bench_id in msg and sha[:10] in msg, msg
    manifest = json.loads((clone / "results/loop" / test_id / "manifest.json").read_text())
    assert manifest["ok"] and manifest["git"]["sha"] == sha and manifest["git"]["dirty"] is False, manifest["git"]
    assert manifest["build"]["arch"] == "cpu" and manifest["build"]["commands"], manifest["build"]
    assert not git(clone, "status", "--porcelain").strip()

    # the results commit changes nothing a host reads: the next deploy sends nothing, builds nothing
    t0 = time.monotonic()
    r = inv("deploy", "--host", h)
    seconds = time.monotonic() - t0
    assert r.returncode == 0, explain(r)
    assert re.search(r"0 sent, \d+ unchanged, 0 deleted", r.stdout) and "build up to date" in r.stdout, explain(r)
    print(f"deploy right after a fetch-results commit: {seconds:.2f} s (invoke start-up included)")
    # a docs-only change is sent but rebuilds nothing
    (clone / "docs/PIPELINE.md").write_text((clone / "docs/PIPELINE.md").read_text() + "\n")
    git(clone, "commit", "-qam", "docs: a blank line")
    r = inv("deploy", "--host", h)
    assert r.returncode == 0 and "1 sent" in r.stdout and "build up to date" in r.stdout, explain(r)
    git(clone, "reset", "-q", "--hard", "HEAD^")

    r = inv("fetch-results", "--host", h)  # nothing new: no commit
    assert r.returncode == 0 and "0 fetched" in r.stdout, explain(r)
    assert git(clone, "rev-parse", "HEAD^").strip() == head_before

    # the local helpers wired to the benchmarks area: report, compare
    r = inv("report", "--host", "loop")
    assert r.returncode == 0 and (clone / "docs/BENCHMARKS_loop.md").is_file(), explain(r)
    r = inv("compare", bench_id, "--run-b", bench_id)  # a run against itself: identical samples
    assert r.returncode == 0 and "no significant change" in r.stdout, explain(r)
    r = inv("compare", bench_id, "--against", "latest")  # no other bench run of this host
    assert r.returncode == 5 and "no other bench run under" in r.stderr, explain(r)
    r = inv("compare", test_id, "--run-b", bench_id)  # a test run has no benchmark JSON: usage
    assert r.returncode == 5 and "error: compare:" in r.stderr, explain(r)
    r = inv("hosts")
    assert r.returncode == 0 and {"ct200", "h200", "local"} <= {l.split()[0] for l in r.stdout.splitlines()}, explain(r)


def test_two_hosts_in_parallel_one_failing(loopback_sshd, clone, hosts_dir, tmp_path):
    """--host a,b: lines prefixed per host, one summary line each, exit code the worst (1);
    the passing host's run is complete and fetchable."""
    a = host_yaml(loopback_sshd, hosts_dir, tmp_path, "alpha")
    b = host_yaml(loopback_sshd, hosts_dir, tmp_path, "beta", env={"KDTREE_SELFTEST_FAIL": "1"})
    inv = Invoke(clone)
    r = inv("test-remote", "--host", f"{a},{b}", "--no-build", "--suite", "selftest")
    assert r.returncode == 1, explain(r)
    assert "[alpha]" in r.stderr and "[beta]" in r.stderr, explain(r)
    assert re.search(r"^alpha: test-remote: ok: .*selftest 3 passed, 0 failed", r.stdout, re.M), explain(r)
    assert re.search(r"^error: beta: test: .*selftest failed", r.stderr, re.M), explain(r)
    for name in ("alpha", "beta"):
        runs = list((tmp_path / f"remote-{name}" / "runs").glob("*/manifest.json"))
        assert len(runs) == 1, (name, runs)
    r = inv("fetch-results", "--host", f"{a},{b}", "--json")
    assert r.returncode == 0, explain(r)
    doc = json.loads(r.stdout)
    assert [h["host"] for h in doc["hosts"]] == ["alpha", "beta"] and all(len(h["run_ids"]) == 1 for h in doc["hosts"])


def test_host_without_rsync_uses_tar(loopback_sshd, clone, hosts_dir, tmp_path):
    bin_dir = path_without(["rsync"], tmp_path / "bin-no-rsync")
    h = host_yaml(loopback_sshd, hosts_dir, tmp_path, "norsync", env={"PATH": bin_dir})
    inv = Invoke(clone)
    r = inv("deploy", "--host", str(h), "--no-build")
    assert r.returncode == 0, explain(r)
    assert "sync (tar)" in r.stdout, explain(r)
    assert (tmp_path / "remote-norsync/src/tasks.py").read_bytes() == (clone / "tasks.py").read_bytes()
    r = inv("test-remote", "--host", str(h), "--no-deploy", "--suite", "selftest")
    assert r.returncode == 0, explain(r)
    r = inv("doctor", "--host", str(h))
    assert "rsync: absent: sync sends a tar" in r.stderr, explain(r)


def test_strict_host_key_refusal_then_accept_new(loopback_sshd, clone, hosts_dir, tmp_path):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    h = host_yaml(loopback_sshd, hosts_dir, tmp_path, "stranger", known_hosts=str(empty))
    inv = Invoke(clone)
    r = inv("deploy", "--host", str(h), "--no-build")
    assert r.returncode == 3, explain(r)
    assert "SHA256:" in r.stderr and "--accept-new-host-key" in r.stderr, explain(r)
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: stranger: connect:"), explain(r)
    assert "Traceback" not in r.stderr, explain(r)
    assert not (tmp_path / "remote-stranger").exists(), "nothing may be touched on refusal"
    r = inv("deploy", "--host", str(h), "--no-build", "--accept-new-host-key")
    assert r.returncode == 0, explain(r)
    assert f"[127.0.0.1]:{loopback_sshd.port}" in empty.read_text()


def test_failing_remote_test_exits_1_and_results_still_fetched(loopback_sshd, clone, hosts_dir, tmp_path):
    h = str(host_yaml(loopback_sshd, hosts_dir, tmp_path, "failing", env={"KDTREE_SELFTEST_FAIL": "1"}))
    inv = Invoke(clone)
    r = inv("test-remote", "--host", h, "--no-build", "--suite", "selftest", "--json")
    assert r.returncode == 1, explain(r)
    (rid,) = run_ids(r)
    assert "2 passed, 1 failed" in r.stderr, explain(r)
    r = inv("fetch-results", "--host", h)
    assert r.returncode == 0, explain(r)
    m = json.loads((clone / "results/failing" / rid / "manifest.json").read_text())
    assert m["ok"] is False and m["status"]["selftest"]["tests"]["failures"] == 1
    assert "failures" in (clone / "results/failing" / rid / "selftest-junit.xml").read_text()
    assert f"results/failing/{rid}/manifest.json" in committed_paths(clone)


def test_connection_cut_during_detached_bench_then_fetch(clone, hosts_dir, tmp_path):
    """bench --detach returns at once; the sshd is killed while the run goes on; with the host
    down fetch-results fails (3); once it is back, fetch-results brings the finished run home."""
    reason = sshd_missing_reason()
    if reason:
        pytest.skip(f"loopback sshd unavailable: {reason}")
    sshd = LoopbackSshd(tmp_path / "own-sshd").start()  # its own: this test kills it
    try:
        h = host_yaml(sshd, hosts_dir, tmp_path, "flaky", env={"KDTREE_SELFTEST_SECONDS": "4"})
        inv = Invoke(clone)
        t0 = time.monotonic()
        r = inv("bench", "--host", str(h), "--no-build", "--suite", "selftest", "--quick", "--detach", "--json")
        assert r.returncode == 0, explain(r)
        (rid,) = run_ids(r)
        run_dir = tmp_path / "remote-flaky/runs" / rid
        assert not (run_dir / "manifest.json").exists(), "detach must return before the run ends"
        sshd.stop()
        r = inv("fetch-results", "--host", str(h))
        assert r.returncode == 3 and "error: flaky:" in r.stderr, explain(r)
        deadline = time.monotonic() + 120
        while not (run_dir / "manifest.json").exists():
            assert time.monotonic() < deadline, f"the detached run never finished: {list(run_dir.rglob('*'))}"
            time.sleep(0.5)
        assert time.monotonic() - t0 >= 4
        assert not (tmp_path / "remote-flaky/.lock").exists(), "the runner releases the lock it was handed"
        sshd.start()  # a new port: rewrite the host file for it
        h = host_yaml(sshd, hosts_dir, tmp_path, "flaky")
        r = inv("fetch-results", "--host", str(h), "--run", rid)
        assert r.returncode == 0, explain(r)
        assert (clone / "results/flaky" / rid / "selftest.json").is_file()
        assert f"results/flaky/{rid}/selftest.json" in committed_paths(clone)
    finally:
        sshd.stop()


MALFORMED = {
    "unknown_field": ({"colour": "blue"}, "colour"),
    "missing_remote_dir": ({"remote_dir": None}, "remote_dir"),
    "wrong_type_port": ({"port": "twenty-two"}, "port"),
    "password_field": ({"password": "hunter2"}, "password"),
    "relative_remote_dir": ({"remote_dir": "kdtree"}, "remote_dir"),
    "home_remote_dir": ({"remote_dir": "~"}, "remote_dir"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_inventory_exits_5_naming_file_and_field(case, clone, tmp_path):
    fields, field = MALFORMED[case]
    data = {"transport": "ssh", "hostname": "127.0.0.1", "remote_dir": str(tmp_path / "r"), "cuda_arch": "cpu"}
    data.update(fields)
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump(data))
    r = Invoke(clone)("deploy", "--host", str(path))
    assert r.returncode == 5, explain(r)
    assert str(path) in r.stderr and field in r.stderr and "Traceback" not in r.stderr, explain(r)


def test_corrupted_remote_file_is_refused_and_nothing_committed(loopback_sshd, clone, hosts_dir, tmp_path):
    h = str(host_yaml(loopback_sshd, hosts_dir, tmp_path, "rotten"))
    inv = Invoke(clone)
    r = inv("test-remote", "--host", h, "--no-build", "--suite", "selftest", "--json")
    assert r.returncode == 0, explain(r)
    (rid,) = run_ids(r)
    junit = tmp_path / "remote-rotten/runs" / rid / "selftest-junit.xml"
    data = bytearray(junit.read_bytes())
    data[len(data) // 2] ^= 0x20  # same size, different bytes: only the sha256 can tell
    junit.write_bytes(bytes(data))
    head = git(clone, "rev-parse", "HEAD").strip()
    r = inv("fetch-results", "--host", h)
    assert r.returncode == 3, explain(r)
    assert "selftest-junit.xml" in r.stderr and "sha256" in r.stderr, explain(r)
    assert git(clone, "rev-parse", "HEAD").strip() == head
    assert not (clone / "results/rotten" / rid).exists()
    assert not list((clone / "results/rotten").glob(".incoming-*"))
    assert not git(clone, "status", "--porcelain").strip()


def test_dry_run_prints_the_plan_and_touches_nothing(loopback_sshd, clone, hosts_dir, tmp_path):
    h = str(host_yaml(loopback_sshd, hosts_dir, tmp_path, "dry"))
    r = Invoke(clone)("test-remote", "--host", h, "--dry-run", "--json")
    assert r.returncode == 0, explain(r)
    (plans,) = [x["details"]["plans"] for x in json.loads(r.stdout)["hosts"]]
    assert [p["task"] for p in plans] == ["deploy", "test"]
    deploy, test = plans
    assert deploy["sync"]["method"] == "rsync" and "tasks.py" in deploy["sync"]["send"]
    remote = str(tmp_path / "remote-dry")
    build = next(s for s in deploy["steps"] if s["name"] == "build")
    assert build["argv"] == ["bash", f"{remote}/src/cuda/build.sh", "--arch", "cpu", "--out", f"{remote}/build/cpu"]
    assert any(s["name"] == "pytest-native" for s in test["steps"]) and test["paths"]["run"].startswith(f"{remote}/runs/")
    assert "plan: deploy on dry" in r.stderr and "plan: test on dry" in r.stderr
    assert not Path(remote).exists(), "a dry run must not create the remote folder"


def test_held_lock_makes_deploy_wait_then_fail_naming_the_holder(loopback_sshd, clone, hosts_dir, tmp_path):
    """A live holder (a process on the host) keeps the lock: deploy waits, names it, exits 3;
    once the holder is gone the lock is stale and the next deploy breaks it and succeeds."""
    h = str(host_yaml(loopback_sshd, hosts_dir, tmp_path, "busy"))
    lock = tmp_path / "remote-busy/.lock"
    lock.mkdir(parents=True)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (lock / "owner.json").write_text(json.dumps({
            "token": "t", "holder": "someone@elsewhere pid 4242", "purpose": "deploy", "host_pid": holder.pid,
            "since": "2026-01-01T00:00:00Z", "expires": time.time() + 600}))
        inv = Invoke(clone)
        r = inv("deploy", "--host", h, "--no-build", "--lock-wait", "2")
        assert r.returncode == 3, explain(r)
        assert "waiting for" in r.stderr and "someone@elsewhere pid 4242" in r.stderr, explain(r)
        err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert err and err[0].startswith("error: busy: deploy:") and "is held by someone@elsewhere" in err[0], explain(r)
        assert not (tmp_path / "remote-busy/src").exists()
    finally:
        holder.kill()
        holder.wait()
    r = inv("deploy", "--host", h, "--no-build", "--lock-wait", "2")
    assert r.returncode == 0 and "breaking the stale lock" in r.stderr, explain(r)
    assert (tmp_path / "remote-busy/src/tasks.py").is_file() and not lock.exists()


def test_step_timeout_kills_the_remote_group_and_exits_3(loopback_sshd, clone, hosts_dir, tmp_path):
    h = str(host_yaml(loopback_sshd, hosts_dir, tmp_path, "slow", env={"KDTREE_SELFTEST_SECONDS": "120"},
                      timeouts={"connect": 10, "bench": 2}))
    t0 = time.monotonic()
    r = Invoke(clone)("bench", "--host", h, "--no-build", "--suite", "selftest", "--json")
    assert r.returncode == 3, explain(r)
    assert time.monotonic() - t0 < 90, "the 120 s sleep must have been killed"
    (rid,) = run_ids(r)
    run_dir = tmp_path / "remote-slow/runs" / rid
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["status"]["bench"]["status"] == "failed" and "timed out after 2" in m["status"]["bench"]["reason"]
    assert "error: slow: bench:" in r.stderr and "timeouts.bench" in r.stderr, explain(r)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(run_dir).encode() in _cmdline(p)]
    assert not left, f"processes of the timed-out step are still alive: {left}"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
