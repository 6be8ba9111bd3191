"""Helpers for the end-to-end tests (tests/test_e2e*.py): a throwaway clone and `invoke` runs.

`make_clone(dst)` clones this repository's HEAD and lays over it the working tree as
`invoke deploy` would send it (tracked and untracked-not-ignored files; deletions applied), then
commits that there, so the clone is clean and runs exactly the code under test. `Invoke(clone)` runs `python3 -m invoke ...` in it as a subprocess, the way a
user does, and returns the CompletedProcess (stdout, stderr, returncode).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIT_ENV = {"GIT_AUTHOR_NAME": "e2e", "GIT_AUTHOR_EMAIL": "e2e@example.invalid",
           "GIT_COMMITTER_NAME": "e2e", "GIT_COMMITTER_EMAIL": "e2e@example.invalid"}


def git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                       env={**os.environ, **GIT_ENV})
    assert r.returncode == 0, f"git {' '.join(args)} in {repo}: {r.stderr}"
    return r.stdout


def make_clone(dst: Path) -> Path:
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(dst)], check=True)
    changed = [p for p in git(REPO, "diff", "--name-only", "HEAD").splitlines() if p]
    untracked = [p for p in git(REPO, "ls-files", "--others", "--exclude-standard").splitlines()
                 if p and not p.startswith("results/")]
    for rel in changed + untracked:
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
        elif (dst / rel).exists():
            (dst / rel).unlink()
    git(dst, "add", "-A")
    if git(dst, "status", "--porcelain").strip():
        git(dst, "commit", "-q", "-m", "e2e: the working tree under test")
    assert not git(dst, "status", "--porcelain").strip()
    return dst


class Invoke:
    def __init__(self, clone: Path, env: dict | None = None):
        self.clone = clone
        self.env = {**os.environ, **GIT_ENV, **(env or {})}
        self.env.pop("KDTREE_LIB", None)

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.clone, env=self.env,
                              capture_output=True, text=True, timeout=timeout)


def explain(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"


def run_ids(r: subprocess.CompletedProcess) -> list[str]:
    """Run ids of a --json summary."""
    doc = json.loads(r.stdout)
    return [rid for h in doc["hosts"] for rid in h["run_ids"]]
