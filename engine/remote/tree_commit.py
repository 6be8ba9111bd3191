"""Which commit a dirty run's tree was. A run made from a checkout with uncommitted changes
records its HEAD and the sha256 of `git diff HEAD --binary` (provenance.git_info); once those
changes are committed, the diff from that HEAD to the commit hashes the same, so the run can be
named by the commit whose code it ran rather than by "HEAD, dirty".

    python3 -m engine.remote.tree_commit RUN_DIR [RUN_DIR ...] [--repo .] [--rev HEAD] [--limit 500]

prints one line a run: the first commit whose tree it ran (later ones that change only results/
or the generated reports have the same tree), or why none is known (a clean run is its
HEAD; a run with untracked files hashed them too, so no commit can be told from it; its HEAD is
not in this repository; or none of the HEAD's descendants on the way to --rev, newest first, at
most --limit, matches). The manifest is the host's, so untrusted: its sha and hash are used only
when they are hex of the right length. Exit 0 when every run is named, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from engine.remote.provenance import NOT_ENGINE, PROBE_TIMEOUT_S, read_only_git_env

__all__ = ["tree_commit", "main"]

_SHA = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                          timeout=PROBE_TIMEOUT_S, env=read_only_git_env())


def tree_commit(repo: str | Path, git: dict, rev: str = "HEAD",
                limit: int = 500) -> tuple[str | None, str]:
    """(commit, how) for a run's manifest git block: the commit whose tree the run ran, or None
    and why not."""
    sha, dirty = git.get("sha"), git.get("dirty")
    if not isinstance(sha, str) or not _SHA.fullmatch(sha):
        return None, f"its git sha {sha!r} is not 40 hex digits"
    if dirty is False:
        return sha, "clean: its HEAD"
    if dirty is not True:
        return None, "its manifest does not say whether the tree was dirty"
    if git.get("untracked") != 0:
        return None, (f"it had {git.get('untracked')!r} untracked file(s), hashed with the diff: "
                      "no commit can be told from it")
    want = git.get("diff_sha256")
    if not isinstance(want, str) or not _SHA256.fullmatch(want):
        return None, f"its diff sha256 {want!r} is not 64 hex digits"
    repo = Path(repo)
    if _git(repo, "cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        return None, f"its HEAD {sha[:10]} is not in {repo}"
    listed = _git(repo, "rev-list", "--ancestry-path", f"--max-count={limit}", f"{sha}..{rev}",
                  "--")
    if listed.returncode != 0:
        err = listed.stderr.decode(errors="replace").strip()
        return None, f"git rev-list {sha[:10]}..{rev} failed: {err}"
    for commit in reversed(listed.stdout.decode().split()):  # the oldest first
        diff = _git(repo, "diff", sha, commit, "--binary", "--", ".", *NOT_ENGINE)
        if diff.returncode == 0 and hashlib.sha256(diff.stdout).hexdigest() == want:
            return commit, f"its HEAD {sha[:10]} plus its diff: the first commit with this tree"
    return None, (f"no descendant of {sha[:10]} up to {rev} (at most {limit}) has its diff "
                  f"(sha256 {want[:12]})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m engine.remote.tree_commit",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each with manifest.json)")
    ap.add_argument("--repo", type=Path, default=Path("."), help="the git checkout (default .)")
    ap.add_argument("--rev", default="HEAD", help="search the run's HEAD..REV (default HEAD)")
    ap.add_argument("--limit", type=int, default=500, help="commits searched at most (default 500)")
    a = ap.parse_args(argv)
    if a.limit < 1:
        ap.error(f"--limit must be >= 1, got {a.limit}")
    if a.rev.startswith("-"):
        ap.error(f"--rev {a.rev!r} is not a revision")
    named = True
    for run in a.runs:
        try:
            m = json.loads((run / "manifest.json").read_text())
            block = m.get("git") if isinstance(m, dict) else None
            if not isinstance(block, dict):
                raise ValueError("no git record")
        except (OSError, ValueError, RecursionError) as e:
            print(f"{run.name}: unreadable manifest ({e})")
            named = False
            continue
        commit, how = tree_commit(a.repo, block, a.rev, a.limit)
        print(f"{run.name}: {commit} ({how})" if commit else f"{run.name}: unknown ({how})")
        named = named and commit is not None
    return 0 if named else 1


if __name__ == "__main__":
    sys.exit(main())
