"""Source sync into <remote_dir>/src: rsync and tar paths, over the loopback sshd and locally."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from engine.remote import sync as sync_mod
from engine.remote.errors import StepTimeout, TransferError
from engine.remote.inventory import load_host, parse_host
from engine.remote.loopback import path_without
from engine.remote.sync import MANIFEST, git_file_list, plan_sync, sync
from engine.remote.connect import open_transport

HOSTS = Path(__file__).resolve().parents[1] / "hosts"
MODES = [("local", "rsync"), ("local", "tar"), ("ssh", "rsync"), ("ssh", "tar")]


@pytest.fixture(scope="module")
def no_rsync_path(tmp_path_factory):
    """A PATH for the host side with every program of this machine except rsync."""
    return path_without(["rsync"], tmp_path_factory.mktemp("bin-without-rsync"))


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A throwaway git checkout with awkward names, an executable, a symlink, untracked, ignored and
    results/ files. Contents are fresh random bytes every run (the seed is printed)."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    files = {
        ".gitignore": b"/build/\n*.log\n",
        "README.md": b"# r\n",
        "cuda/build.sh": b"#!/bin/sh\necho build\n",
        "engine/a.py": rng.randbytes(5000),
        "deep/er/still/f.bin": rng.randbytes(70_000),
        "name with spaces [x]*?.txt": b"odd\n",
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "cuda/build.sh").chmod(0o755)
    (root / "link.py").symlink_to("engine/a.py")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    (root / "untracked.txt").write_bytes(rng.randbytes(100))      # synced: untracked, not ignored
    (root / "build").mkdir()
    (root / "build" / "libx.so").write_bytes(b"ignored")          # not synced: ignored
    (root / "debug.log").write_text("ignored")
    (root / "results" / "h" / "r1").mkdir(parents=True)
    (root / "results" / "h" / "r1" / "m.json").write_text("{}")   # never synced
    print(f"repo contents from random seed {seed}")  # shown by pytest when a test fails
    return root


@pytest.fixture(params=MODES, ids=[f"{a}-{b}" for a, b in MODES])
def transport(request, tmp_path, no_rsync_path):
    kind, method = request.param
    env = {"PATH": no_rsync_path} if method == "tar" else None
    if kind == "local":
        fields = {"transport": "local", "remote_dir": str(tmp_path / "remote"), "cuda_arch": "cpu"}
        if env:
            fields["env"] = env
        t = open_transport(parse_host("loc", fields, source=None))
    else:
        sshd = request.getfixturevalue("loopback_sshd")
        y = sshd.write_host_yaml(tmp_path / "hosts" / "loop.yaml", remote_dir=str(tmp_path / "remote"), env=env)
        t = open_transport(load_host(str(y), HOSTS))
    t.expected_method = method  # type: ignore[attr-defined]
    yield t
    t.close()


def tree(root: Path) -> dict[str, tuple]:
    """{relpath: (kind, content or link target, executable)} of a folder."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p), False)
            else:
                out[rel] = ("file", p.read_bytes(), bool(p.stat().st_mode & 0o100))
    return out


def expected_tree(repo: Path) -> dict[str, tuple]:
    return {k: v for k, v in tree(repo).items() if k in set(git_file_list(repo))}


def quiet(_line: str) -> None:
    pass


def test_git_file_list(repo):
    files = git_file_list(repo)
    assert "untracked.txt" in files and "link.py" in files and "name with spaces [x]*?.txt" in files
    assert not [f for f in files if f.startswith(("build/", "results/", ".git/")) or f.endswith(".log")]
    (repo / "README.md").unlink()  # deleted but still tracked: not listed
    assert "README.md" not in git_file_list(repo)


def test_sync_cycle(repo, transport, tmp_path):
    msg = "synced tree differs (the seed is in the captured stdout)"
    src = tmp_path / "remote" / "src"
    n = len(git_file_list(repo))
    first = sync(repo, transport, log=quiet)
    assert first.method == transport.expected_method, msg
    assert sorted(first.sent) == git_file_list(repo) and first.bytes_sent > 0, msg
    assert tree(src) == expected_tree(repo), msg
    manifest = json.loads((tmp_path / "remote" / MANIFEST).read_text())
    assert sorted(manifest["files"]) == git_file_list(repo)

    again = sync(repo, transport, log=quiet)
    assert (again.sent, again.deleted, again.bytes_sent, len(again.unchanged)) == ([], [], 0, n), msg

    # One change, one new file, one deletion, one mode change, one stray file on the host.
    (repo / "engine/a.py").write_bytes(os.urandom(300))
    (repo / "new dir").mkdir()
    (repo / "new dir/n.txt").write_text("new")
    (repo / "deep/er/still/f.bin").unlink()
    (repo / "README.md").chmod(0o755)
    (src / "stray.o").write_text("left by hand")
    outside = tmp_path / "remote" / "build" / "keep.o"
    outside.parent.mkdir(parents=True)
    outside.write_text("outside src: never touched")
    rep = sync(repo, transport, log=quiet)
    assert sorted(rep.sent) == ["README.md", "engine/a.py", "new dir/n.txt"], msg
    assert sorted(rep.deleted) == ["deep/er/still/f.bin", "stray.o"], msg
    assert tree(src) == expected_tree(repo), msg
    assert not (src / "deep").exists()  # emptied folders go too
    assert outside.read_text() == "outside src: never touched"

    # A file edited on the host (other size) is sent again.
    (src / "untracked.txt").write_text("edited on the host")
    rep = sync(repo, transport, log=quiet)
    assert rep.sent == ["untracked.txt"] and tree(src) == expected_tree(repo), msg


def test_dry_run_changes_nothing(repo, transport, tmp_path):
    lines = []
    rep = sync(repo, transport, dry_run=True, log=lines.append)
    assert rep.dry_run and sorted(rep.sent) == git_file_list(repo)
    assert not (tmp_path / "remote").exists()
    assert any("send    engine/a.py" in line for line in lines)
    sync(repo, transport, log=quiet)
    (repo / "README.md").write_text("changed")
    before = tree(tmp_path / "remote")
    rep = sync(repo, transport, dry_run=True, log=quiet)
    assert rep.sent == ["README.md"] and tree(tmp_path / "remote") == before


def test_plan_reads_method_and_state(repo, transport):
    plan = plan_sync(repo, transport)
    assert plan.method == transport.expected_method and not plan.no_change
    assert plan.bytes_to_send == sum((repo / p).lstat().st_size for p in plan.to_send)


def test_interrupted_sync_recovers(repo, transport, tmp_path, monkeypatch):
    sync(repo, transport, log=quiet)
    (repo / "engine/a.py").write_bytes(os.urandom(50_000))
    (repo / "big.bin").write_bytes(os.urandom(400_000))
    if transport.expected_method == "tar":
        real_run = transport.run

        def cut_stream(script, **kw):  # the link drops half-way through the tar stream
            if kw.get("stdin") is not None and "tar -xzf" in script:
                kw["stdin"] = kw["stdin"][: len(kw["stdin"]) // 2]
            return real_run(script, **kw)

        monkeypatch.setattr(transport, "run", cut_stream)
        with pytest.raises(TransferError, match="tar sync"):
            sync(repo, transport, log=quiet)
    else:
        real_subprocess_run = subprocess.run

        def rsync_dies(argv, **kw):  # rsync copies the small files, then the step times out
            if argv[0] != "rsync":
                return real_subprocess_run(argv, **kw)
            real_subprocess_run([argv[0], "--max-size=1k"] + argv[1:], **kw)
            raise subprocess.TimeoutExpired(argv, 1)

        monkeypatch.setattr(sync_mod.subprocess, "run", rsync_dies)
        with pytest.raises(StepTimeout, match="rsync"):
            sync(repo, transport, log=quiet)
    monkeypatch.undo()
    # Nothing a later run could take as complete: the manifest is gone.
    assert not (tmp_path / "remote" / MANIFEST).exists()
    rep = sync(repo, transport, log=quiet)
    assert "big.bin" in rep.sent and "engine/a.py" in rep.sent
    assert tree(tmp_path / "remote" / "src") == expected_tree(repo)
    assert sync(repo, transport, log=quiet).sent == []
