"""The results store (engine/remote/results.py): verification, run selection, the commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.remote import provenance, results
from engine.remote.errors import UsageError
from engine.remote.plan import Options
from engine.remote.progress import Progress

from results_helpers import git, host, repo  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parent.parent


def make_run(host, run_id: str, *, dirty: bool = False, complete: bool = True) -> Path:
    """A run folder on the (local) host, finalized by the real runner."""
    d = Path(host.remote_dir) / "runs" / run_id
    d.mkdir(parents=True)
    req = {"run_id": run_id, "kind": "bench", "host": {"name": host.name, "address": "x"},
           "git": {"sha": "d" * 40, "dirty": dirty, "diff_sha256": "e" * 64 if dirty else None},
           "steps": [{"name": "b", "argv": [sys.executable, "-c", f"open('{d}/r.json', 'w').write('{{}}')"]}]}
    (d / "request.json").write_text(json.dumps(req))
    if complete:
        subprocess.run([sys.executable, "-m", "engine.remote.runner", str(d)], cwd=REPO, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
    return d


def fetch(host, repo, **opts):
    return results.fetch_results(host, repo, Options(**opts), Progress([host.name], live=False))


def test_verify_folder_names_every_defect(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "b").write_bytes(b"abcd")
    (tmp_path / "c").write_bytes(b"abc")
    sha = provenance.sha256_file(tmp_path / "a")
    m = {"files": [{"path": "a", "size": 3, "sha256": sha}, {"path": "b", "size": 3, "sha256": sha},
                   {"path": "c", "size": 3, "sha256": "0" * 64}, {"path": "gone", "size": 1, "sha256": sha},
                   {"path": "../escape", "size": 1, "sha256": sha}, {"path": "/abs", "size": 1, "sha256": sha}]}
    problems = results.verify_folder(tmp_path, m)
    assert len(problems) == 5
    assert problems[0].startswith("b: size 4") and problems[1].startswith("c: sha256")
    assert problems[2] == "gone: missing" and "leaves the run folder" in problems[3] and "leaves" in problems[4]
    assert results.verify_folder(tmp_path, {"files": m["files"][:1]}) == []


def test_select_runs():
    remote = [("r1", True), ("r2", True), ("r3", False)]
    assert results.select_runs(remote, {"r1"}, None) == (["r2"], ["r3"])
    assert results.select_runs(remote, {"r1"}, "all") == (["r1", "r2"], ["r3"])
    assert results.select_runs(remote, set(), "latest") == (["r2"], [])
    assert results.select_runs(remote, set(), "r1") == (["r1"], [])
    assert results.select_runs(remote, set(), "r3") == ([], ["r3"])
    with pytest.raises(UsageError, match="no run 'r9'.*r1, r2, r3"):
        results.select_runs(remote, set(), "r9")


def test_commit_paths_commits_only_those_paths(repo):
    (repo / "code.py").write_text("x = 2\n")           # unstaged change
    (repo / "staged.py").write_text("y = 1\n")
    git(repo, "add", "staged.py")                      # staged change
    (repo / "results/h/r1").mkdir(parents=True)
    (repo / "results/h/r1/manifest.json").write_text("{}")
    results.commit_paths(repo, ["results/h/r1"], "results: h: r1\n")
    assert git(repo, "show", "--name-only", "--format=", "HEAD").split() == ["results/h/r1/manifest.json"]
    status = git(repo, "status", "--porcelain").splitlines()
    assert " M code.py" in status and "A  staged.py" in status


def test_commits_and_git_probes_from_parallel_threads(repo):
    # fetch-results runs one thread per host against one checkout: one host's commit must not
    # meet another's status probe or uncommitted-run listing on .git/index.lock.
    import threading

    from engine.remote import provenance

    errors = []

    def commits():
        try:
            for i in range(12):
                (repo / f"results/h/r{i}").mkdir(parents=True)
                (repo / f"results/h/r{i}/manifest.json").write_text("{}")
                os.utime(repo / "code.py")  # stale stat data: a plain status rewrites the index
                results.commit_paths(repo, [f"results/h/r{i}"], f"results: h: r{i}\n")
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def probes(stop):
        try:
            while not stop.is_set():
                provenance.git_info(repo)
                results.uncommitted_runs(repo, repo / "results/h")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    stop = threading.Event()
    t = threading.Thread(target=probes, args=(stop,))
    t.start()
    commits()
    stop.set()
    t.join()
    assert errors == []
    assert len(git(repo, "log", "--format=%s", "--", "results/h").splitlines()) == 12


def test_fetch_verifies_renames_and_commits(repo, host):
    make_run(host, "20260101T000000Z-ddddddd-bench")
    make_run(host, "20260101T000001Z-ddddddd-bench")
    make_run(host, "20260101T000002Z-ddddddd-bench", complete=False)
    head = git(repo, "rev-parse", "HEAD").strip()
    out = fetch(host, repo)
    assert out.error is None, out.error
    assert out.run_ids == ["20260101T000000Z-ddddddd-bench", "20260101T000001Z-ddddddd-bench"]
    assert out.details["running"] == ["20260101T000002Z-ddddddd-bench"]
    assert git(repo, "rev-parse", "HEAD~1").strip() == head
    files = git(repo, "show", "--name-only", "--format=", "HEAD").split()
    assert all(f.startswith("results/box/20260101T00000") for f in files) and len(files) == 2 * 5
    msg = git(repo, "log", "-1", "--format=%B")
    assert msg.startswith("results: box: 20260101T000000Z-ddddddd-bench, 20260101T000001Z-ddddddd-bench (engine dddddddddd)")
    assert "Engine-Commit: " + "d" * 40 in msg and "Run-Id: 20260101T000001Z-ddddddd-bench" in msg
    assert not list((repo / "results/box").glob(".incoming-*"))
    again = fetch(host, repo, run="all")  # re-check what is here: unchanged, no commit
    assert again.error is None and "2 unchanged" in again.summary and again.details["commit"] is None


def test_dirty_trees_are_refused_unless_allowed(repo, host):
    rid = "20260101T000000Z-ddddddd-dirty-bench"
    make_run(host, rid, dirty=True)
    with pytest.raises(UsageError, match="were made from a dirty engine tree"):
        fetch(host, repo)
    assert not (repo / "results").exists(), "a refusal happens before any download"
    out = fetch(host, repo, allow_dirty=True)
    assert out.error is None and out.run_ids == [rid]
    assert f"Allow-Dirty: {rid} ran a dirty tree (diff sha256 {'e' * 64})" in git(repo, "log", "-1", "--format=%B")
    (repo / "code.py").write_text("x = 3\n")  # now the local tree is dirty too
    make_run(host, "20260101T000009Z-ddddddd-bench")
    with pytest.raises(UsageError, match="uncommitted changes"):
        fetch(host, repo)
    assert fetch(host, repo, no_commit=True).error is None  # nothing committed: no refusal


def test_corrupted_file_refused_nothing_kept(repo, host):
    rid = "20260101T000000Z-ddddddd-bench"
    d = make_run(host, rid)
    (d / "r.json").write_text("{} ")  # one byte longer than the manifest says
    head = git(repo, "rev-parse", "HEAD").strip()
    out = fetch(host, repo)
    assert out.exit_code == 3 and "r.json: size 3 on the host, manifest says 2" in str(out.error)
    assert git(repo, "rev-parse", "HEAD").strip() == head
    assert not (repo / "results/box" / rid).exists() and not list((repo / "results/box").glob(".incoming-*"))
    (d / "r.json").write_text("[]")  # the listed size, other bytes: the sha256 check refuses it
    out = fetch(host, repo)
    assert out.exit_code == 3 and "r.json: sha256 " in str(out.error) and "manifest says" in str(out.error)
    assert not (repo / "results/box" / rid).exists() and not list((repo / "results/box").glob(".incoming-*"))


def test_interrupted_fetch_is_finished_by_the_next(repo, host):
    """A run renamed into results/ whose commit never happened is committed by the next fetch."""
    rid = "20260101T000000Z-ddddddd-bench"
    make_run(host, rid)
    shutil.copytree(Path(host.remote_dir) / "runs" / rid, repo / "results/box" / rid)
    (repo / "results/box/.incoming-x-999999999").mkdir()  # a temp folder of a dead fetch
    out = fetch(host, repo)
    assert out.error is None and out.run_ids == [rid] and out.details["commit"]
    assert f"results/box/{rid}/manifest.json" in git(repo, "show", "--name-only", "--format=", "HEAD").split()
    assert not (repo / "results/box/.incoming-x-999999999").exists()


def test_latest_bench_run_ignores_test_runs(tmp_path):
    """One implementation (engine.remote.compare.latest_run) serves `invoke compare --against
    latest`; results.latest_bench_run was its duplicate."""
    from engine.remote.compare import latest_run

    assert not hasattr(results, "latest_bench_run")
    for rid, kind in (("20260101T000001Z-a-bench", "bench"), ("20260101T000002Z-a-bench", "bench"),
                      ("20260101T000003Z-a-test", "test")):
        (tmp_path / rid).mkdir()
        (tmp_path / rid / "manifest.json").write_text(json.dumps({"kind": kind}))
    (tmp_path / "20260101T000009Z-a-bench").mkdir()  # no manifest: not a fetched run
    assert latest_run(tmp_path).name == "20260101T000002Z-a-bench"
    assert latest_run(tmp_path, tmp_path / "20260101T000002Z-a-bench").name == "20260101T000001Z-a-bench"
    assert latest_run(tmp_path / "none") is None


def test_fetch_dry_run_touches_nothing(repo, host):
    make_run(host, "20260101T000000Z-ddddddd-bench")
    make_run(host, "20260101T000001Z-ddddddd-dirty-bench", dirty=True)
    out = fetch(host, repo, dry_run=True)
    assert out.error is None and out.summary == "dry run: 2 runs to fetch" and len(out.run_ids) == 2
    assert not (repo / "results").exists() and git(repo, "log", "--format=%s") == "init\n"
