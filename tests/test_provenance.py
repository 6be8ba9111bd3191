"""Provenance (engine/remote/provenance.py): git state, GPU facts from nvidia-smi, build lines."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from engine.remote import provenance

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **GIT_ENV}).stdout


def test_git_info_clean_dirty_and_ignored_paths(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.GIT_ENV, raising=False)
    git(tmp_path, "init", "-q", "-b", "work")
    (tmp_path / "a.py").write_text("1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-q", "-m", "x")
    sha = git(tmp_path, "rev-parse", "HEAD").strip()
    clean = provenance.git_info(tmp_path)
    assert clean == {"sha": sha, "short": sha[:10], "branch": "work", "dirty": False, "diff_sha256": None,
                     "untracked": 0, "tracked_changed": 0}
    (tmp_path / "results/h/r").mkdir(parents=True)        # fetched results do not make it dirty
    (tmp_path / "results/h/r/x.json").write_text("{}")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/BENCHMARKS_h.md").write_text("#")
    assert provenance.git_info(tmp_path)["dirty"] is False
    (tmp_path / "a.py").write_text("2\n")
    d1 = provenance.git_info(tmp_path)
    assert d1["dirty"] is True and len(d1["diff_sha256"]) == 64 and d1["tracked_changed"] == 1
    assert provenance.git_info(tmp_path)["diff_sha256"] == d1["diff_sha256"]  # stable
    (tmp_path / "new.py").write_text("n\n")                # an untracked file changes the hash
    d2 = provenance.git_info(tmp_path)
    assert d2["untracked"] == 1 and d2["diff_sha256"] != d1["diff_sha256"] and d2["tracked_changed"] == 1
    from engine.remote.report import _dirty

    assert _dirty(d2) == " (dirty: 1 tracked file(s) changed, 1 untracked file(s))"
    assert _dirty({"dirty": True, "untracked": 4}) == " (dirty: 4 untracked file(s))"
    assert _dirty(clean) == ""


def test_git_info_never_writes_the_index(tmp_path, monkeypatch):
    # A plain `git status` refreshes stale stat data and rewrites .git/index under its lock; a
    # commit in another thread (hosts fetch in parallel) then fails on index.lock. git_info
    # runs git with optional locks off, so the index stays as it was.
    monkeypatch.delenv(provenance.GIT_ENV, raising=False)
    monkeypatch.delenv("GIT_OPTIONAL_LOCKS", raising=False)
    git(tmp_path, "init", "-q", "-b", "work")
    (tmp_path / "a.py").write_text("1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-q", "-m", "x")
    st = (tmp_path / "a.py").stat()
    os.utime(tmp_path / "a.py", (st.st_atime + 10, st.st_mtime + 10))  # stale stat, same bytes
    index = (tmp_path / ".git/index").read_bytes()
    assert provenance.git_info(tmp_path)["dirty"] is False
    assert (tmp_path / ".git/index").read_bytes() == index
    git(tmp_path, "status", "--porcelain")  # the check can fail: a plain status rewrites it
    assert (tmp_path / ".git/index").read_bytes() != index


def test_git_info_without_checkout_uses_env(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.GIT_ENV, raising=False)
    assert "no git checkout" in provenance.git_info(tmp_path)["source"]
    monkeypatch.setenv(provenance.GIT_ENV, json.dumps({"sha": "f" * 40, "dirty": False}))
    info = provenance.git_info(tmp_path)
    assert info["sha"] == "f" * 40 and provenance.GIT_ENV in info["source"]


FAKE_SMI = """#!/bin/sh
case "$*" in
  *index,name,uuid*) echo "0, NVIDIA H200, GPU-aaaa, 00000000:18:00.0, 143771, 9.0, 570.86"
                     echo "1, NVIDIA H200, GPU-bbbb, 00000000:2A:00.0, 143771, 9.0, 570.86" ;;
  *clocks_throttle*) exit 6 ;;
  *clocks.sm*)       echo "0, 1980, 3201, 1980, 3201"; echo "1, [N/A], 3201, 1980, 3201" ;;
esac
"""


def test_gpu_facts_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    gpus, note = provenance.gpu_facts()
    assert note is None and len(gpus) == 2
    assert gpus[0] == {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-aaaa", "pci_bus_id": "00000000:18:00.0",
                       "memory_mib": 143771, "compute_cap": "9.0", "driver": "570.86"}
    clocks = provenance.gpu_clocks()  # the full query fails (old driver): the clocks alone
    assert clocks == [{"index": 0, "sm_mhz": 1980.0, "mem_mhz": 3201.0, "max_sm_mhz": 1980.0, "max_mem_mhz": 3201.0},
                      {"index": 1, "sm_mhz": None, "mem_mhz": 3201.0, "max_sm_mhz": 1980.0, "max_mem_mhz": 3201.0}]


def test_no_nvidia_smi_is_a_note_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert provenance.gpu_facts() == ([], "nvidia-smi not found on PATH")
    assert provenance.gpu_clocks() == []


def test_build_info_and_collect(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.GIT_ENV, raising=False)
    assert "does not exist" in provenance.build_info(tmp_path)["source"]
    (tmp_path / "build_info.json").write_text("{not json")
    assert "unreadable" in provenance.build_info(tmp_path)["source"]
    (tmp_path / "build_info.json").write_text(json.dumps({"arch": "cpu", "commands": ["g++ -O3 x.cpp"]}))
    b = provenance.build_info(tmp_path)
    assert b["arch"] == "cpu" and b["commands"] == ["g++ -O3 x.cpp"]
    p = provenance.collect(tmp_path, tmp_path)
    assert set(p) == {"git", "host_facts", "toolchain", "build"} and p["build"]["arch"] == "cpu"
    hf = p["host_facts"]
    assert hf["hostname"] and hf["cpu_cores"] >= 1 and hf["memory_bytes"] > 0 and isinstance(hf["gpus"], list)
    assert p["toolchain"]["python"].count(".") == 2 and p["toolchain"]["numpy"]


@pytest.mark.skipif(not Path("/usr/bin/nvcc").exists() and not any(
    (Path(d) / "nvcc").exists() for d in os.environ.get("PATH", "").split(":")), reason="nvcc not on PATH")
def test_toolchain_reads_nvcc_release_line():
    assert "release" in provenance.toolchain()["nvcc"]
