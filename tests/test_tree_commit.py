"""engine/remote/tree_commit.py: the commit a dirty run's tree was, found from the diff hash its
manifest records (provenance.git_info), in a scratch git repository."""

from __future__ import annotations

import json
import subprocess

import pytest

from engine.remote import provenance
from engine.remote.tree_commit import main, tree_commit


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q", "-b", "main")
    _git(r, "config", "user.email", "t@example.invalid")
    _git(r, "config", "user.name", "t")
    (r / "kernel.cu").write_text("int a;\n")
    (r / "results").mkdir()
    (r / "results" / "old.json").write_text("{}\n")
    _git(r, "add", ".")
    _git(r, "commit", "-q", "-m", "base")
    return r


def _commit(repo, msg):
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", msg)
    return _git(repo, "rev-parse", "HEAD")


def test_names_the_commit_that_holds_the_runs_changes(repo):
    base = _git(repo, "rev-parse", "HEAD")
    (repo / "kernel.cu").write_text("int a, b;\n")
    run = provenance.git_info(repo)  # what a run from this dirty tree records
    assert run["dirty"] and run["sha"] == base and run["untracked"] == 0
    (repo / "notes.txt").write_text("unrelated\n")
    _commit(repo, "notes first")  # not the run's tree: it has notes.txt on top of base
    (repo / "notes.txt").unlink()
    the_one = _commit(repo, "the kernel change")
    (repo / "results" / "run.json").write_text("{}\n")
    _commit(repo, "results only: same tree")  # a later commit with the same engine tree
    (repo / "kernel.cu").write_text("int a, b, c;\n")
    _commit(repo, "later work")
    commit, how = tree_commit(repo, run)
    assert commit == the_one and "first commit" in how


def test_clean_untracked_unknown_and_hostile_records(repo):
    base = _git(repo, "rev-parse", "HEAD")
    assert tree_commit(repo, provenance.git_info(repo)) == (base, "clean: its HEAD")
    (repo / "new.txt").write_text("x\n")
    commit, how = tree_commit(repo, provenance.git_info(repo))
    assert commit is None and "1 untracked" in how
    (repo / "new.txt").unlink()
    (repo / "kernel.cu").write_text("never committed\n")
    run = provenance.git_info(repo)
    commit, how = tree_commit(repo, run)
    assert commit is None and "no descendant" in how
    for bad, says in (({**run, "sha": "--output=/tmp/x"}, "not 40 hex"),
                      ({**run, "sha": "f" * 40}, "not in"),
                      ({**run, "diff_sha256": "; rm -rf /"}, "not 64 hex"),
                      ({**run, "dirty": "yes"}, "does not say"),
                      ({"sha": None}, "not 40 hex")):
        commit, how = tree_commit(repo, bad)
        assert commit is None and says in how, (bad, how)


def test_cli_prints_a_line_a_run_and_exits_1_when_one_is_unknown(repo, tmp_path, capsys):
    (repo / "kernel.cu").write_text("int z;\n")
    dirty = provenance.git_info(repo)
    named = _commit(repo, "z")
    runs = tmp_path / "runs"
    for name, block in (("r1-dirty-bench", dirty), ("r2-bench", {**dirty, "untracked": 2})):
        (runs / name).mkdir(parents=True)
        (runs / name / "manifest.json").write_text(json.dumps({"git": block}))
    (runs / "r3-broken").mkdir()
    (runs / "r3-broken" / "manifest.json").write_text("{not json")
    rc = main([str(runs / "r1-dirty-bench"), "--repo", str(repo)])
    assert rc == 0 and capsys.readouterr().out.startswith(f"r1-dirty-bench: {named} (")
    rc = main([str(runs / n) for n in ("r1-dirty-bench", "r2-bench", "r3-broken")]
              + ["--repo", str(repo)])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1 and len(out) == 3
    assert out[1].startswith("r2-bench: unknown (it had 2 untracked")
    assert out[2].startswith("r3-broken: unreadable manifest")
    for args, says in ((["--limit", "0"], "--limit must be >= 1"),
                       (["--rev=--all"], "is not a revision")):
        with pytest.raises(SystemExit) as e:
            main([str(runs / "r1-dirty-bench"), *args])
        assert e.value.code == 2 and says in capsys.readouterr().err
