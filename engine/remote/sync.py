"""Source sync: the files of ``git ls-files -co --exclude-standard`` into ``<remote_dir>/src``.

    files = git_file_list(repo_root)              # tracked + untracked-not-ignored; never .git/, results/
    plan  = plan_sync(repo_root, transport)       # reads the host's state; changes nothing
    rep   = sync(repo_root, transport, dry_run=False, log=print)
    rep.method ("rsync" | "tar"), rep.sent / rep.unchanged / rep.deleted (lists of paths),
    rep.bytes_sent, rep.seconds, rep.dry_run

How the host's state is known: one probe command reads ``<remote_dir>/.sync-manifest.json``
(path -> sha256, size, mode of every file as last synced) and lists ``src/`` with sizes.
A file is to send when its hash or mode differs from the manifest, or the host's copy is missing
or has another size; a file on the host that is not in the list is to delete (only inside src/).
When nothing is to send or delete, nothing is sent at all (the no-change deploy is one probe).

Two methods:
- ``rsync`` when both ends have it (and ssh is here for an SSH host): ``rsync -a --checksum
  --delete --delete-excluded`` with the file list as include rules, into ``<remote_dir>/src/``
  only, over ssh with the same host-key file and strict checking as the SSH transport.
- ``tar`` otherwise: one gzip tar stream of the changed files (plus the new manifest and the
  delete list) on the stdin of one command that extracts it and applies the deletions.

Interruptions: the manifest is removed before anything in src/ changes and written (renamed into
place) only after everything succeeded, so an interrupted sync leaves no manifest; the next sync
then compares everything again (rsync) or resends everything (tar) and finishes the job.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import StepTimeout, TransferError, UsageError
from .transport import LocalTransport, Transport

MANIFEST = ".sync-manifest.json"
MANIFEST_SCHEMA = 1
EXCLUDED_TOP = (".git/", "results/")
# The generated per-host reports (docs/BENCHMARKS_<host>.md and its plots) are written by
# fetch-results from results/; hosts never read them, so a results commit sends nothing.
EXCLUDED_PREFIX = ("docs/BENCHMARKS_",)


# --- the local side ---------------------------------------------------------------------------

def git_file_list(repo_root: Path | str) -> list[str]:
    """Sorted repo-relative paths of tracked and untracked-not-ignored files that exist, minus
    .git/, results/, the generated docs/BENCHMARKS_<host>* reports (and submodule folders, which
    are not files)."""
    repo_root = Path(repo_root)
    try:
        r = subprocess.run(["git", "-C", str(repo_root), "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, check=False)
    except FileNotFoundError:
        raise UsageError("git is not installed here", step="sync", hint="sync takes its file list from git") from None
    if r.returncode != 0:
        raise UsageError(f"{repo_root} is not a git checkout: {r.stderr.decode(errors='replace').strip()}",
                         step="sync", hint="run the tasks from a clone of kdtree-engine")
    out = set()
    for raw in r.stdout.split(b"\0"):
        if not raw:
            continue
        path = raw.decode("utf-8", "surrogateescape")
        if path.startswith(EXCLUDED_TOP + EXCLUDED_PREFIX) or path in (".git", "results"):
            continue
        full = repo_root / path
        if full.is_symlink() or full.is_file():  # deleted-but-tracked files and gitlinks drop out
            out.add(path)
    return sorted(out)


def _file_entry(full: Path) -> dict:
    """{"sha256", "size", "mode"}; a symlink is hashed by its target text (mode "link")."""
    st = full.lstat()
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(full).encode()
        return {"sha256": hashlib.sha256(b"link:" + target).hexdigest(), "size": len(target), "mode": "link"}
    h = hashlib.sha256()
    with open(full, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    mode = "755" if st.st_mode & stat.S_IXUSR else "644"
    return {"sha256": h.hexdigest(), "size": st.st_size, "mode": mode}


def local_manifest(repo_root: Path, files: list[str]) -> dict:
    return {"schema": MANIFEST_SCHEMA, "files": {p: _file_entry(repo_root / p) for p in files}}


# --- plan ---------------------------------------------------------------------------------------

@dataclass
class SyncPlan:
    method: str                      # "rsync" | "tar"
    files: list[str]                 # everything that will be in src/ afterwards
    to_send: list[str]
    unchanged: list[str]
    to_delete: list[str]             # paths inside src/ on the host
    bytes_to_send: int               # sum of the sizes of to_send
    manifest: dict                   # the local manifest, written to the host after the sync
    remote_rsync: str | None = None  # the host's rsync path, when the method is rsync
    why_method: str = ""

    @property
    def no_change(self) -> bool:
        return not self.to_send and not self.to_delete


@dataclass
class SyncReport:
    method: str
    sent: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    seconds: float = 0.0
    dry_run: bool = False

    def summary(self) -> str:
        verb = "would send" if self.dry_run else "sent"
        return (f"sync ({self.method}): {len(self.sent)} {verb}, {len(self.unchanged)} unchanged, "
                f"{len(self.deleted)} {'would delete' if self.dry_run else 'deleted'}, "
                f"{self.bytes_sent} bytes in {self.seconds:.2f} s")


_PROBE = """\
echo "KDT-RSYNC $(command -v rsync 2>/dev/null)"
echo "KDT-TAR $(command -v tar 2>/dev/null)"
cd {rd} 2>/dev/null || {{ echo KDT-NODIR; exit 0; }}
echo KDT-MANIFEST
cat {manifest} 2>/dev/null
echo
echo KDT-FILES
if [ -d src ]; then
  cd src && {{ find . \\( -type f -o -type l \\) -printf '%s %P\\n' 2>/dev/null ||
               find . \\( -type f -o -type l \\) | sed 's|^\\./|-1 |'; }}
fi
"""


def _probe(transport: Transport) -> tuple[str | None, bool, dict, dict[str, int]]:
    """(rsync path or None, has tar, manifest files, {path: size (-1 unknown)} of src/)."""
    rd = transport.remote_dir
    r = transport.run(_PROBE.format(rd=shlex.quote(rd), manifest=MANIFEST), timeout=transport.host.timeouts.sync)
    if not r.ok:
        raise TransferError(f"probing {rd} failed: {r.tail()}", host=transport.host.name, step="sync")
    head, _, rest = r.stdout.partition("KDT-MANIFEST\n")
    tools = dict(line.split(" ", 1) for line in head.splitlines() if " " in line)
    rsync = tools.get("KDT-RSYNC", "").strip() or None
    has_tar = bool(tools.get("KDT-TAR", "").strip())
    if "KDT-NODIR" in head.splitlines():  # nothing deployed yet
        return rsync, has_tar, {}, {}
    manifest_text, _, listing = rest.partition("\nKDT-FILES\n")
    manifest = {}
    if manifest_text.strip():
        try:
            data = json.loads(manifest_text)
            if data.get("schema") == MANIFEST_SCHEMA:
                manifest = data.get("files", {})
        except (json.JSONDecodeError, AttributeError):
            manifest = {}  # unreadable: treated as absent, everything is compared again
    remote = {}
    for line in listing.splitlines():
        size, _, path = line.partition(" ")
        if path:
            remote[path] = int(size) if size.lstrip("-").isdigit() else -1
    return rsync, has_tar, manifest, remote


def _choose_method(transport: Transport, remote_rsync: str | None) -> tuple[str, str]:
    if shutil.which("rsync") is None:
        return "tar", "rsync is not installed here"
    if remote_rsync is None:
        return "tar", "rsync is not on the host's PATH"
    if not isinstance(transport, LocalTransport) and shutil.which("ssh") is None:
        return "tar", "no ssh client here for rsync"
    return "rsync", "rsync on both ends"


def plan_sync(repo_root: Path | str, transport: Transport) -> SyncPlan:
    repo_root = Path(repo_root)
    files = git_file_list(repo_root)
    mine = local_manifest(repo_root, files)
    remote_rsync, has_tar, theirs, remote_sizes = _probe(transport)
    method, why = _choose_method(transport, remote_rsync)
    if method == "tar" and not has_tar:
        raise TransferError("the host has neither rsync nor tar", host=transport.host.name, step="sync",
                            hint="install rsync or tar on the host")
    to_send, unchanged = [], []
    for path in files:
        entry, known = mine["files"][path], theirs.get(path)
        size_there = remote_sizes.get(path)
        same = (known is not None and known.get("sha256") == entry["sha256"]
                and known.get("mode") == entry["mode"] and size_there is not None
                and (size_there == -1 or entry["mode"] == "link" or size_there == entry["size"]))
        (unchanged if same else to_send).append(path)
    listed = set(files)
    to_delete = sorted(p for p in remote_sizes if p not in listed and _safe_relpath(p))
    return SyncPlan(method=method, files=files, to_send=to_send, unchanged=unchanged, to_delete=to_delete,
                    bytes_to_send=sum(mine["files"][p]["size"] for p in to_send), manifest=mine,
                    remote_rsync=remote_rsync, why_method=why)


def _safe_relpath(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "" not in parts


# --- execute ----------------------------------------------------------------------------------------

def sync(repo_root: Path | str, transport: Transport, *, dry_run: bool = False,
         log: Callable[[str], None] = print) -> SyncReport:
    """Make <remote_dir>/src equal to the git file list; see the module docstring."""
    start = time.monotonic()
    repo_root = Path(repo_root)
    plan = plan_sync(repo_root, transport)
    if dry_run:
        rep = SyncReport(plan.method, list(plan.to_send), list(plan.unchanged), list(plan.to_delete),
                         plan.bytes_to_send, time.monotonic() - start, dry_run=True)
        log(f"sync plan ({plan.method}: {plan.why_method}) into {transport.remote_dir}/src")
        for path in plan.to_send[:50]:
            log(f"  send    {path}")
        for path in plan.to_delete[:50]:
            log(f"  delete  {path}")
        if len(plan.to_send) > 50 or len(plan.to_delete) > 50:
            log(f"  ... ({len(plan.to_send)} to send, {len(plan.to_delete)} to delete in all)")
        log(rep.summary())
        return rep
    if plan.no_change:
        rep = SyncReport(plan.method, [], list(plan.unchanged), [], 0, time.monotonic() - start)
    elif plan.method == "rsync":
        rep = _sync_rsync(repo_root, transport, plan)
    else:
        rep = _sync_tar(repo_root, transport, plan)
    rep.seconds = time.monotonic() - start
    log(rep.summary())
    return rep


def _manifest_bytes(plan: SyncPlan) -> bytes:
    return json.dumps(plan.manifest, sort_keys=True, separators=(",", ":")).encode()


def _sync_tar(repo_root: Path, transport: Transport, plan: SyncPlan) -> SyncReport:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=3) as tar:
        for path in plan.to_send:
            info = tar.gettarinfo(str(repo_root / path), arcname=f"src/{path}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isfile():
                with open(repo_root / path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
        for name, data in ((f"{MANIFEST}.new", _manifest_bytes(plan)),
                           (".sync-delete.list", "".join(p + "\n" for p in plan.to_delete).encode())):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    payload = buf.getvalue()
    rd = shlex.quote(transport.remote_dir)
    # Manifest first out, last in: an interruption anywhere leaves no manifest (see docstring).
    script = f"""set -e
mkdir -p {rd}/src
cd {rd}
rm -f {MANIFEST} {MANIFEST}.new .sync-delete.list
tar -xzf - --no-same-owner
while IFS= read -r f; do rm -f -- "src/$f"; done < .sync-delete.list
rm -f .sync-delete.list
find src -mindepth 1 -type d -empty -delete 2>/dev/null || true
mv -f {MANIFEST}.new {MANIFEST}
"""
    r = transport.run(script, stdin=payload, timeout=transport.host.timeouts.sync)
    if not r.ok:
        raise TransferError(f"tar sync into {transport.remote_dir}/src failed (exit {r.exit_code}): {r.tail(5)}",
                            host=transport.host.name, step="sync", hint="rerun: an interrupted sync is redone")
    return SyncReport("tar", list(plan.to_send), list(plan.unchanged), list(plan.to_delete), len(payload))


def _rsync_pattern(path: str) -> str:
    """An anchored include rule matching exactly this path (wildcard characters escaped)."""
    escaped = "".join("\\" + c if c in "\\*?[" else c for c in path)
    return "/" + escaped


def _sync_rsync(repo_root: Path, transport: Transport, plan: SyncPlan) -> SyncReport:
    rd = transport.remote_dir
    timeout = transport.host.timeouts.sync
    r = transport.run(f"mkdir -p {shlex.quote(rd)}/src && rm -f {shlex.quote(rd)}/{MANIFEST}", timeout=timeout)
    if not r.ok:
        raise TransferError(f"cannot prepare {rd}/src: {r.tail()}", host=transport.host.name, step="sync")
    with tempfile.NamedTemporaryFile("w", prefix="kdt-rsync-", suffix=".rules", delete=False) as f:
        for path in plan.files:
            f.write(_rsync_pattern(path) + "\n")
        rules = f.name
    argv = ["rsync", "-a", "--checksum", "--delete", "--delete-excluded", "--prune-empty-dirs",
            "--itemize-changes", "--stats", "--exclude=/.git/", "--exclude=/results/",
            f"--include-from={rules}", "--include=*/", "--exclude=*"]
    if isinstance(transport, LocalTransport):
        dest = f"{rd}/src/"
    else:
        ssh_argv, target = transport.ssh_command()
        argv += ["-e", shlex.join(ssh_argv), f"--rsync-path={plan.remote_rsync or 'rsync'}"]
        dest = f"{target}:{rd}/src/"
    argv += [f"{repo_root}/", dest]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise StepTimeout(f"rsync into {rd}/src ran past {timeout:g} s", host=transport.host.name, step="sync",
                          hint="raise timeouts.sync in the host file") from None
    finally:
        os.unlink(rules)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise TransferError(f"rsync into {rd}/src failed (exit {proc.returncode}): {tail}",
                            host=transport.host.name, step="sync", hint="rerun: an interrupted sync is redone")
    sent, deleted, bytes_sent = [], [], 0
    for line in proc.stdout.splitlines():
        if line.startswith("*deleting "):
            path = line.split(None, 1)[1]
            if not path.endswith("/"):
                deleted.append(path)
        elif len(line) > 12 and line[0] in "<>c." and line[1] in "fL" and line[11] == " ":
            # itemized "YXcstpoguax path": sent content (<, >), a new symlink (c), or attributes (.)
            path = line[12:]
            sent.append(path.split(" -> ", 1)[0] if line[1] == "L" else path)
        elif line.startswith("Total bytes sent:"):
            bytes_sent = int(line.split(":", 1)[1].strip().replace(",", "").split()[0])
    w = transport.run(f"cat > {shlex.quote(rd)}/{MANIFEST}.new && mv -f {shlex.quote(rd)}/{MANIFEST}.new "
                      f"{shlex.quote(rd)}/{MANIFEST}", stdin=_manifest_bytes(plan), timeout=timeout)
    if not w.ok:
        raise TransferError(f"cannot write {rd}/{MANIFEST}: {w.tail()}", host=transport.host.name, step="sync")
    sent_set = set(sent)
    return SyncReport("rsync", sent, [p for p in plan.files if p not in sent_set], deleted, bytes_sent)
