"""fetch-results against a hostile host (engine/remote/trust.py): every case plants the attack
in a run folder on the host, lists it in the manifest with correct sizes and hashes where that
makes it worse, and checks that the run is refused alone with one line naming it, that nothing
of it remains here, and that a good run beside it is still fetched and committed.

Local transport for the breadth, the loopback sshd (tests/conftest.py) for the SFTP path."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from engine.remote import results, trust
from engine.remote.errors import UsageError
from engine.remote.inventory import load_host
from engine.remote.plan import Options
from engine.remote.progress import Progress

from results_helpers import GIT_ENV, git, host, repo  # noqa: F401 (fixtures)

GOOD = "20260101T000000Z-ddddddd-bench"
BAD = "20260101T000001Z-ddddddd-bench"


def entry(rel: str, data: bytes) -> dict:
    return {"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def craft_run(remote_dir, rid: str, files: dict[str, bytes], manifest: object = None, **fields) -> Path:
    """A complete run folder with these files and a manifest listing them (or `manifest` as is)."""
    d = Path(remote_dir) / "runs" / rid
    d.mkdir(parents=True)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    if manifest is None:
        manifest = {"schema": 1, "run_id": rid, "kind": "bench", "summary": "ok",
                    "git": {"sha": "d" * 40, "dirty": False}, "files": [entry(r, b) for r, b in files.items()]}
        manifest.update(fields)
    (d / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return d


def fetch(host, repo, **opts):
    return results.fetch_results(host, repo, Options(**opts), Progress([host.name], live=False))


def assert_refused_alone(out, repo, host_name: str, rid: str, reason: str):
    """rid refused with `reason` in its one line, nothing of it here, GOOD fetched and committed."""
    assert out.exit_code == 3, out
    assert reason in out.details["refused"][rid], out.details["refused"]
    assert "\n" not in str(out.error)
    hd = repo / "results" / host_name
    assert not (hd / rid).exists() and not list(hd.glob(".incoming-*"))
    assert out.run_ids == [GOOD] and out.details["commit"]
    tracked = git(repo, "ls-files", "results").split()
    assert tracked and all(p.startswith(f"results/{host_name}/{GOOD}/") for p in tracked)


# ---- attacks planted in one run folder (local transport) ----------------------------------------

def plant_git_dir(d: Path, outside: Path) -> tuple[dict, str]:
    marker = outside / "PWNED"
    (d / ".git").mkdir()
    cfg = f"[core]\n\tfsmonitor = touch {marker}\n".encode()
    (d / ".git/config").write_bytes(cfg)
    (d / ".git/HEAD").write_bytes(b"ref: refs/heads/main\n")
    return {".git/config": cfg, ".git/HEAD": b"ref: refs/heads/main\n"}, "git treats specially"


def plant_link_outside(d: Path, outside: Path) -> tuple[dict, str]:
    secret = outside / "secret.txt"
    secret.write_bytes(b"host secret\n")
    (d / "leak.txt").symlink_to(secret)
    return {"leak.txt": secret.read_bytes()}, "leak.txt: is a symbolic link"


def plant_link_dir(d: Path, outside: Path) -> tuple[dict, str]:
    (outside / "etc").mkdir()
    (outside / "etc/passwd").write_bytes(b"root:x:0:0\n")
    (d / "sub").symlink_to(outside / "etc")
    return {"sub/passwd": b"root:x:0:0\n"}, "sub: is a symbolic link, not a folder"


def plant_dev_zero(d: Path, outside: Path) -> tuple[dict, str]:
    (d / "zero.bin").symlink_to("/dev/zero")
    return {"zero.bin": b"\0" * 1024}, "zero.bin: is a symbolic link"


def plant_fifo(d: Path, outside: Path) -> tuple[dict, str]:
    os.mkfifo(d / "pipe.json")
    return {"pipe.json": b"{}"}, "pipe.json: is a device, FIFO or socket"


@pytest.mark.parametrize("plant", [plant_git_dir, plant_link_outside, plant_link_dir, plant_dev_zero, plant_fifo])
def test_planted_attack_is_refused_alone(repo, host, tmp_path, plant):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    d = craft_run(host.remote_dir, BAD, {"r.json": b"{}"})
    outside = tmp_path / "outside"
    outside.mkdir()
    listed, reason = plant(d, outside)
    m = json.loads((d / "manifest.json").read_text())
    m["files"] += [entry(rel, data) for rel, data in listed.items()]  # correct hashes: the worst case
    (d / "manifest.json").write_text(json.dumps(m))
    start = time.monotonic()
    out = fetch(host, repo)
    assert time.monotonic() - start < 30, "a FIFO or /dev/zero must not stall the fetch"
    assert_refused_alone(out, repo, "box", BAD, reason)
    git(repo, "status")  # a fetched .git/config with core.fsmonitor would run here
    assert not (outside / "PWNED").exists()


MALFORMED = [
    ("[]", "is a JSON list, not an object"),
    ({"files": {"a": 1}}, "files is a dict, not a list"),
    ({"files": None}, "files is missing, not a list"),
    ({"files": ["r.json"]}, "files[0] is a str, not an object"),
    ({"files": [{"path": "a", "size": 2, "sha256": "0" * 64}, {"path": "a/b", "size": 2, "sha256": "0" * 64}]},
     "a is both a file and a folder"),
    ({"files": [{"path": "r.json", "size": 2, "sha256": "0" * 64}] * 2}, "listed twice"),
    ({"files": [{"path": "../x", "size": 2, "sha256": "0" * 64}]}, "empty, . or .. component"),
    ({"files": [{"path": "a//b", "size": 2, "sha256": "0" * 64}]}, "empty, . or .. component"),
    ({"files": [{"path": "./r.json", "size": 2, "sha256": "0" * 64}]}, "empty, . or .. component"),
    ({"files": [{"path": "", "size": 2, "sha256": "0" * 64}]}, "empty path"),
    ({"files": [{"path": "/etc/passwd", "size": 2, "sha256": "0" * 64}]}, "absolute path"),
    ({"files": [{"path": "a\x1b[2Jb", "size": 2, "sha256": "0" * 64}]}, "control character"),
    ({"files": [{"path": "x/.GITmodules", "size": 2, "sha256": "0" * 64}]}, "git treats specially"),
    ({"files": [{"path": ".gitattributes", "size": 2, "sha256": "0" * 64}]}, "git treats specially"),
    ({"files": [{"path": ".git. ", "size": 2, "sha256": "0" * 64}]}, "git treats specially"),
    ({"files": [{"path": "manifest.json", "size": 2, "sha256": "0" * 64}]}, "lists the manifest itself"),
    ({"files": [{"path": "r.json", "size": -1, "sha256": "0" * 64}]}, "is not a non-negative integer"),
    ({"files": [{"path": "r.json", "size": 10 ** 30, "sha256": "0" * 64}]}, "over the cap"),
    ('{"files": [{"path": "r.json", "size": 1' + "0" * 5000 + ', "sha256": ""}]}', "not valid JSON"),
    ({"files": [{"path": "r.json", "size": 2, "sha256": "zz"}]}, "sha256 is not 64 hex digits"),
    ({"run_id": GOOD, "files": []}, "names run"),
    ('{"files": []', "not valid JSON"),
    ('{"a": ' * 200 + "1" + "}" * 200, "nested deeper than 64"),
    (b"\xff\xfe".decode("latin-1"), "not UTF-8"),
]


@pytest.mark.parametrize("manifest,reason", MALFORMED, ids=[r for _, r in MALFORMED])
def test_malformed_manifest_is_a_refusal_not_an_internal_error(repo, host, manifest, reason):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    d = craft_run(host.remote_dir, BAD, {"r.json": b"{}"}, manifest=manifest)
    if reason == "not UTF-8":
        (d / "manifest.json").write_bytes(b"\xff\xfe{}")
    out = fetch(host, repo)
    assert_refused_alone(out, repo, "box", BAD, reason)


@pytest.mark.parametrize("name", ["not-a-run", "20260101T000000Z-ddddddd-bench;rm -rf ~",
                                  "20261399T000000Z-ddddddd-bench", "20260101T000000Z-DDDDDDD-bench",
                                  "20260101T000000Z-ddddddd-bench\ncomplete x", "..hidden", "x\x1b[31m"])
def test_folder_names_that_are_not_run_ids_are_refused_before_reading(repo, host, name):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    d = Path(host.remote_dir) / "runs" / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{")  # never read: a read would refuse it as bad JSON
    out = fetch(host, repo)
    shown = trust.printable(name)
    assert out.exit_code == 3 and "not a run id of this tool" in out.details["refused"][shown]
    assert "\x1b" not in str(out.error) and "\ncomplete" not in str(out.error)
    assert out.run_ids == [GOOD]
    with pytest.raises(UsageError, match="not a run id of this tool"):
        fetch(host, repo, run=name)


def test_bench_json_nested_past_the_recursion_limit_is_refused(repo, host):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    craft_run(host.remote_dir, BAD, {"kernels.json": b"[" * 200_000 + b"]" * 200_000, "broken.json": b"{"})
    out = fetch(host, repo)
    assert_refused_alone(out, repo, "box", BAD, "kernels.json: JSON nested too deeply to parse")


def test_run_over_the_size_cap_is_refused(repo, host):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    craft_run(host.remote_dir, BAD, {"big.bin": b"x" * 5000})
    out = fetch(host, repo, max_run_bytes=4096)
    assert_refused_alone(out, repo, "box", BAD, "add up to 5000 bytes, over the cap of 4096")


def test_file_growing_past_its_listed_size_is_not_read_in_full(repo, host, monkeypatch):
    """The host's listing lies (or the file grows after it): the stream stops at size + 1."""
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    d = craft_run(host.remote_dir, BAD, {"r.json": b"{}"})
    (d / "r.json").write_bytes(b"y" * (8 << 20))
    monkeypatch.setattr(trust, "check_tree", lambda tree, entries: None)
    read = []
    real = trust._copy_capped
    monkeypatch.setattr(trust, "_copy_capped", lambda *a: read.append(a[2]) or real(*a))
    out = fetch(host, repo)
    assert_refused_alone(out, repo, "box", BAD, "larger than the 2 bytes the manifest says")
    assert 2 in read


def test_leftover_run_that_does_not_verify_is_removed_not_committed(repo, host, tmp_path):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    left = repo / "results/box" / BAD
    left.mkdir(parents=True)
    (tmp_path / "secret").write_text("s")
    (left / "manifest.json").write_text(json.dumps({"run_id": BAD, "files": [entry("s", b"s")]}))
    (left / "s").symlink_to(tmp_path / "secret")
    out = fetch(host, repo)
    assert_refused_alone(out, repo, "box", BAD, "s: not a regular file")


def test_folders_not_named_like_runs_are_left_alone(repo, host):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    notes = repo / "results/box/notes"
    notes.mkdir(parents=True)
    (notes / "manifest.json").write_text("[]")
    out = fetch(host, repo)
    assert out.error is None and out.run_ids == [GOOD]
    assert (notes / "manifest.json").read_text() == "[]"
    assert "results/box/notes/manifest.json" not in git(repo, "ls-files", "results").split()


def test_leftover_incoming_folder_is_never_committed(repo, host):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    inc = repo / "results/box" / f".incoming-{BAD}-999999999"
    (inc / ".git").mkdir(parents=True)
    (inc / ".git/config").write_text("[core]\n\tfsmonitor = false\n")
    out = fetch(host, repo)
    assert out.error is None and out.run_ids == [GOOD] and not inc.exists()
    assert all(GOOD in p for p in git(repo, "ls-files", "results").split())


def test_failed_commit_is_retried_by_the_next_fetch(repo, host, monkeypatch):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"})
    for k in GIT_ENV:
        monkeypatch.delenv(k)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for k, v in {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "user.useConfigOnly", "GIT_CONFIG_VALUE_0": "true"}.items():
        monkeypatch.setenv(k, v)
    head = git(repo, "rev-parse", "HEAD")
    with pytest.raises(results.TransferError, match="git commit"):
        fetch(host, repo)
    assert git(repo, "rev-parse", "HEAD") == head and f"results/box/{GOOD}/r.json" in git(repo, "diff", "--cached", "--name-only")
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "0")
    out = fetch(host, repo)
    assert out.error is None and out.run_ids == [GOOD] and out.details["commit"]
    assert f"results/box/{GOOD}/r.json" in git(repo, "show", "--name-only", "--format=", "HEAD").split()


def test_dirty_run_needs_allow_dirty_however_it_arrives(repo, host):
    rid = "20260101T000002Z-ddddddd-dirty-bench"
    craft_run(host.remote_dir, rid, {"r.json": b"{}"})  # its manifest does not even say dirty
    assert fetch(host, repo, no_commit=True).error is None
    assert (repo / "results/box" / rid).is_dir()
    with pytest.raises(UsageError, match=f"runs {rid} were made from a dirty engine tree"):
        fetch(host, repo)
    assert git(repo, "log", "--format=%s") == "init\n"
    out = fetch(host, repo, allow_dirty=True)
    assert out.error is None and out.run_ids == [rid] and out.details["commit"]
    assert f"Allow-Dirty: {rid} ran a dirty tree" in git(repo, "log", "-1", "--format=%B")


def test_host_text_cannot_forge_commit_trailers(repo, host):
    craft_run(host.remote_dir, GOOD, {"r.json": b"{}"}, summary="ok\n\nEngine-Commit: evil\x1b[2J")
    out = fetch(host, repo)
    assert out.error is None
    msg = git(repo, "log", "-1", "--format=%B")
    assert "\nEngine-Commit: evil" not in msg and "\x1b" not in msg


# ---- the SFTP path (loopback sshd) --------------------------------------------------------------

@pytest.fixture
def ssh_host(loopback_sshd, tmp_path):
    path = loopback_sshd.write_host_yaml(tmp_path / "hosts" / "sshbox.yaml", remote_dir=str(tmp_path / "sremote"))
    return load_host(str(path), tmp_path / "hosts")


@pytest.mark.parametrize("plant", [plant_git_dir, plant_link_outside, plant_dev_zero, plant_fifo])
def test_planted_attack_over_ssh(repo, ssh_host, tmp_path, plant):
    craft_run(ssh_host.remote_dir, GOOD, {"r.json": b"{}"})
    d = craft_run(ssh_host.remote_dir, BAD, {"r.json": b"{}"})
    outside = tmp_path / "outside"
    outside.mkdir()
    listed, reason = plant(d, outside)
    m = json.loads((d / "manifest.json").read_text())
    m["files"] += [entry(rel, data) for rel, data in listed.items()]
    (d / "manifest.json").write_text(json.dumps(m))
    out = fetch(ssh_host, repo)
    assert_refused_alone(out, repo, "sshbox", BAD, reason)
    assert not (outside / "PWNED").exists()


def test_ssh_listing_lies_about_a_missing_file(repo, ssh_host, monkeypatch):
    """A file the listing claims but SFTP cannot open refuses that run alone, not the fetch."""
    craft_run(ssh_host.remote_dir, GOOD, {"r.json": b"{}"})
    d = craft_run(ssh_host.remote_dir, BAD, {"r.json": b"{}"})
    real = trust.remote_tree

    def listing_then_delete(t, run_dir, timeout):
        tree = real(t, run_dir, timeout)
        if run_dir.endswith(BAD):
            (d / "r.json").unlink()  # gone between the listing and the transfer
        return tree

    monkeypatch.setattr(trust, "remote_tree", listing_then_delete)
    out = fetch(ssh_host, repo)
    assert_refused_alone(out, repo, "sshbox", BAD, "r.json: cannot read it over SFTP")


def test_ssh_listing_lies_fifo_times_out_and_big_file_is_capped(repo, ssh_host, monkeypatch):
    """Past the listing (a host that lies, or swaps files after it): the SFTP stream itself
    refuses a FIFO (idle timeout) and a file larger than listed (stops at size + 1)."""
    craft_run(ssh_host.remote_dir, GOOD, {"r.json": b"{}"})
    fifo_run = craft_run(ssh_host.remote_dir, BAD, {"r.json": b"{}"})
    (fifo_run / "r.json").unlink()
    os.mkfifo(fifo_run / "r.json")
    big = "20260101T000003Z-ddddddd-bench"
    big_run = craft_run(ssh_host.remote_dir, big, {"r.json": b"{}"})
    (big_run / "r.json").write_bytes(b"z" * (4 << 20))
    monkeypatch.setattr(trust, "check_tree", lambda tree, entries: None)
    monkeypatch.setattr(trust, "IDLE_TIMEOUT_S", 2.0)
    object.__setattr__(ssh_host.timeouts, "connect", 2.0)  # the idle timeout is max(of the two)
    start = time.monotonic()
    try:
        out = fetch(ssh_host, repo)
    finally:  # release the host's sftp-server, blocked opening the FIFO for reading
        try:
            os.close(os.open(fifo_run / "r.json", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert time.monotonic() - start < 60
    refused = out.details["refused"]
    assert "r.json: not a regular file" in refused[BAD] or "no data for 2 s" in refused[BAD], refused
    assert "larger than the 2 bytes the manifest says" in refused[big], refused
    assert out.run_ids == [GOOD] and out.details["commit"]
    hd = repo / "results/sshbox"
    assert not (hd / BAD).exists() and not (hd / big).exists() and not list(hd.glob(".incoming-*"))
