"""What the fetch-results tests share (test_results.py, test_fetch_hostile.py): a git helper, a
throwaway repository with a committer identity, and a local host with its own remote_dir."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engine.remote.inventory import parse_host

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}


def git(repo: Path, *args: str, check: bool = True) -> str:
    """git in `repo` with the process environment (the `repo` fixture sets the identity; a test
    may remove it to see a commit fail)."""
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert not check or r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    (r / "code.py").write_text("x = 1\n")
    git(r, "add", "code.py")
    git(r, "commit", "-q", "-m", "init")
    return r


@pytest.fixture
def host(tmp_path):
    return parse_host("box", {"transport": "local", "remote_dir": str(tmp_path / "remote"),
                              "cuda_arch": "cpu"}, source=None)
