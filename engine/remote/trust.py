"""The trust boundary of fetch-results: what a host sends is data, checked before it is kept.

A host (its files, its shell, its sftp-server) may be hostile. Nothing it sends may write
outside its run folder here, run anything here (git included), or stall a fetch forever:

    check_run_id(rid)            -> None or why not: `<UTC yyyymmddThhmmssZ>-<sha>[-dirty]-<kind>`
    check_relpath(rel)           -> None or why not: no empty / . / .. / absolute components, no
                                    control characters or backslashes, no name git treats
                                    specially (.git, .gitattributes, .gitmodules, .gitignore,
                                    any case, with trailing dots or spaces, git~1)
    parse_json(data, what)       -> the object; Refused when not UTF-8 JSON or nested too deep
    check_manifest(obj, rid, cap)-> the file entries; Refused when malformed (not an object,
                                    files not a list, an entry not {path, size, sha256}, a
                                    duplicate, a path that is both a file and a folder, a total
                                    over the cap, a run_id that is not this run's)
    remote_tree(t, run_dir)      -> {relpath: (type, size)} by lstat on the host (links not
                                    followed), run with quoted argv and a timeout
    check_tree(tree, entries)    -> Refused unless every listed file is a regular file of the
                                    listed size under real folders
    stream_file(t, path, dest, max_bytes, idle_s) -> (size, sha256): reads at most max_bytes + 1
                                    bytes, refusing anything but a regular file (O_NOFOLLOW at
                                    every component locally; fstat of the open handle over SFTP)
                                    and a transfer silent for idle_s
    verify_run_folder(folder, rid, cap) -> manifest: the local re-check before any commit:
                                    every entry a real folder or regular file, exactly the
                                    listed files plus manifest.json, sizes and sha256 match,
                                    every .json parseable without blowing the stack

Every refusal is a `Refused(reason)`: one line, with host-chosen text escaped by `printable`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
from pathlib import Path

from engine.jsondepth import json_depth

from .errors import TransferError
from .transport import LocalTransport, Transport

MANIFEST = "manifest.json"
DEFAULT_MAX_RUN_BYTES = 512 * 1024 * 1024   # a bench run is a few MiB; a runaway or hostile one is capped
MANIFEST_MAX_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64                          # manifests and suites are a few levels deep
MAX_TREE_ENTRIES = 100_000
IDLE_TIMEOUT_S = 60.0                        # a transfer that sends nothing this long is given up
RUN_ID_RE = re.compile(r"(\d{8})T(\d{6})Z-([0-9a-f]{7,40}|nogit)(-dirty)?-(test|bench)")  # fullmatch
_GIT_SPECIAL = {".git", ".gitattributes", ".gitmodules", ".gitignore", "git~1"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Refused(Exception):
    """A run that is not kept; `reason` is one line."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def printable(text, limit: int = 160) -> str:
    """Host-chosen text made safe for one terminal line (control characters escaped)."""
    s = str(text)
    s = _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode(), s)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def check_run_id(rid) -> str | None:
    if not isinstance(rid, str):
        return f"run id is a {type(rid).__name__}, not a string"
    m = RUN_ID_RE.fullmatch(rid)
    if not m:
        return "not a run id of this tool (<UTC yyyymmddThhmmssZ>-<git short sha>[-dirty]-<test|bench>)"
    d, t = m.group(1), m.group(2)
    if not (1 <= int(d[4:6]) <= 12 and 1 <= int(d[6:8]) <= 31 and int(t[:2]) < 24
            and int(t[2:4]) < 60 and int(t[4:6]) < 61):
        return "not a run id of this tool (its timestamp is not a date)"
    return None


def is_dirty_run(rid: str, manifest: dict | None) -> bool:
    """A run made from a dirty engine tree: its id says so, or its manifest does."""
    git = (manifest or {}).get("git") if isinstance(manifest, dict) else None
    return rid.endswith("-dirty-test") or rid.endswith("-dirty-bench") or bool(
        isinstance(git, dict) and git.get("dirty"))


def check_relpath(rel) -> str | None:
    """Why a manifest path may not be written under a run folder (None: it may)."""
    if not isinstance(rel, str):
        return f"path is a {type(rel).__name__}, not a string"
    if not rel:
        return "empty path"
    if _CONTROL.search(rel) or "\\" in rel:
        return f"{printable(rel)!s}: control character or backslash in the path"
    if rel.startswith("/"):
        return f"{printable(rel)}: absolute path"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"{printable(rel)}: empty, . or .. component"
        if part.casefold().rstrip(" .") in _GIT_SPECIAL:
            return f"{printable(rel)}: {printable(part)!r} is a name git treats specially"
    return None


def parse_json(data: bytes, what: str, max_depth: int = MAX_JSON_DEPTH):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused(f"{what}: not UTF-8") from None
    if json_depth(text) > max_depth:
        raise Refused(f"{what}: JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise Refused(f"{what}: not valid JSON ({printable(e, 80)})") from None


def check_manifest(obj, rid: str, max_run_bytes: int) -> list[dict]:
    """The manifest's file entries, each {path, size, sha256}, checked; Refused otherwise."""
    if not isinstance(obj, dict):
        raise Refused(f"{MANIFEST} is a JSON {type(obj).__name__}, not an object")
    if "run_id" in obj and obj["run_id"] != rid:
        raise Refused(f"{MANIFEST} names run {printable(obj['run_id'])!r}, not this run")
    files = obj.get("files")
    if not isinstance(files, list):
        raise Refused(f"{MANIFEST}: files is {'missing' if files is None else 'a ' + type(files).__name__}, not a list")
    entries, paths, total = [], set(), 0
    for i, e in enumerate(files):
        if not isinstance(e, dict):
            raise Refused(f"{MANIFEST}: files[{i}] is a {type(e).__name__}, not an object")
        rel, size, sha = e.get("path"), e.get("size"), e.get("sha256")
        why = check_relpath(rel)
        if why:
            raise Refused(f"{MANIFEST}: files[{i}]: {why}")
        if rel == MANIFEST:
            raise Refused(f"{MANIFEST}: files[{i}] lists the manifest itself")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise Refused(f"{MANIFEST}: files[{i}] ({printable(rel)}): size {printable(size, 40)} is not a non-negative integer")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise Refused(f"{MANIFEST}: files[{i}] ({printable(rel)}): sha256 is not 64 hex digits")
        if rel in paths:
            raise Refused(f"{MANIFEST}: {printable(rel)} is listed twice")
        paths.add(rel)
        total += size
        entries.append({"path": rel, "size": size, "sha256": sha})
    for rel in paths:
        parts = rel.split("/")
        for k in range(1, len(parts)):
            if "/".join(parts[:k]) in paths:
                raise Refused(f"{MANIFEST}: {printable('/'.join(parts[:k]))} is both a file and a folder")
    if total > max_run_bytes:
        raise Refused(f"the files add up to {total} bytes, over the cap of {max_run_bytes} (--max-run-bytes)")
    return entries


# ---- on the host ------------------------------------------------------------------------------

# Lists a folder by lstat, never following links; argv[1] is the folder, argv[2] the entry cap.
_TREE_PY = r"""
import json, os, stat, sys
root, cap = sys.argv[1], int(sys.argv[2])
def kind(m):
    return "d" if stat.S_ISDIR(m) else "f" if stat.S_ISREG(m) else "l" if stat.S_ISLNK(m) else "o"
try:
    st = os.lstat(root)
except OSError as e:
    print(json.dumps({"error": "cannot lstat the run folder: %s" % e.strerror})); sys.exit(0)
if not stat.S_ISDIR(st.st_mode):
    print(json.dumps({"error": "the run folder is not a real folder (%s)" % kind(st.st_mode)})); sys.exit(0)
out = {}
for dp, dns, fns in os.walk(root, followlinks=False):
    for name in dns + fns:
        p = os.path.join(dp, name)
        try:
            s = os.lstat(p)
        except OSError:
            continue
        out[os.path.relpath(p, root)] = [kind(s.st_mode), s.st_size]
        if len(out) > cap:
            print(json.dumps({"error": "more than %d entries" % cap})); sys.exit(0)
print(json.dumps({"entries": out}))
"""

# Lists <runs>: [name, complete] per folder; complete = manifest.json is a regular file (lstat).
_RUNS_PY = r"""
import json, os, stat, sys
root, cap = sys.argv[1], int(sys.argv[2])
if not os.path.isdir(root):
    print("[]"); sys.exit(0)
out = []
for name in sorted(os.listdir(root)):
    p = os.path.join(root, name)
    try:
        if not stat.S_ISDIR(os.lstat(p).st_mode):
            continue
        m = os.lstat(os.path.join(p, "manifest.json"))
        out.append([name, stat.S_ISREG(m.st_mode)])
    except OSError:
        out.append([name, False])
    if len(out) > cap:
        break
print(json.dumps(out))
"""


def _run_py(t: Transport, code: str, args: list[str], what: str, timeout: float):
    r = t.run([t.host.python, "-c", code, *args], timeout=timeout)
    if not r.ok:
        raise TransferError(f"{what}: {printable(r.tail(3), 200)}", host=t.host.name, step="fetch")
    try:
        return parse_json(r.stdout.strip().encode(), what)
    except Refused as e:
        raise TransferError(e.reason, host=t.host.name, step="fetch") from None


def remote_runs(t: Transport, runs_dir: str, timeout: float) -> list[tuple[str, bool]]:
    """(name, complete) of every folder in <runs> on the host, names unchecked (see check_run_id)."""
    got = _run_py(t, _RUNS_PY, [runs_dir, str(MAX_TREE_ENTRIES)], f"listing {runs_dir}", timeout)
    if not isinstance(got, list) or not all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], bool) for x in got):
        raise TransferError(f"listing {runs_dir}: the host's answer is not a list of [name, complete]",
                            host=t.host.name, step="fetch")
    return [(name, done) for name, done in got]


def remote_tree(t: Transport, run_dir: str, timeout: float) -> dict:
    """{relpath: (type, size)} of everything under run_dir, by lstat on the host. type: d (folder),
    f (regular file), l (link), o (other: device, FIFO, socket). Refused when run_dir itself is
    not a real folder."""
    got = _run_py(t, _TREE_PY, [run_dir, str(MAX_TREE_ENTRIES)], f"listing {run_dir}", timeout)
    if isinstance(got, dict) and isinstance(got.get("error"), str):
        raise Refused(printable(got["error"]))
    entries = got.get("entries") if isinstance(got, dict) else None
    if not isinstance(entries, dict):
        raise Refused("the host's listing of the run folder is malformed")
    tree = {}
    for rel, v in entries.items():
        if isinstance(v, list) and len(v) == 2 and v[0] in ("d", "f", "l", "o") and isinstance(v[1], int):
            tree[rel] = (v[0], v[1])
    return tree


_KIND = {"d": "a folder", "f": "a regular file", "l": "a symbolic link", "o": "a device, FIFO or socket"}


def check_tree(tree: dict, entries: list[dict]) -> None:
    """Every listed file (and manifest.json) is a regular file of its size, under real folders."""
    for e in [{"path": MANIFEST, "size": None}] + entries:
        rel = e["path"]
        parts = rel.split("/")
        for k in range(1, len(parts)):
            parent = "/".join(parts[:k])
            kind = tree.get(parent, (None,))[0]
            if kind != "d":
                raise Refused(f"{printable(parent)}: " + (f"is {_KIND[kind]}, not a folder" if kind else "missing on the host"))
        kind, size = tree.get(rel, (None, None))
        if kind != "f":
            raise Refused(f"{printable(rel)}: " + (f"is {_KIND[kind]}, not a regular file" if kind else "missing on the host"))
        if e["size"] is not None and size != e["size"]:
            raise Refused(f"{printable(rel)}: size {size} on the host, manifest says {e['size']}")


# ---- streaming one file -----------------------------------------------------------------------

def _open_local_nofollow(path: str) -> int:
    """An fd for path opened without following a link at any component (non-blocking, so a FIFO
    cannot stall the open)."""
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)


def _copy_capped(read, out, max_bytes: int, what: str) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    while True:
        block = read(min(1 << 20, max_bytes + 1 - n))
        if not block:
            return n, h.hexdigest()
        n += len(block)
        if n > max_bytes:
            raise Refused(f"{what}: larger than the {max_bytes} bytes the manifest says (stopped reading)")
        h.update(block)
        out.write(block)


def stream_file(t: Transport, remote_path: str, dest: Path, max_bytes: int,
                idle_s: float = IDLE_TIMEOUT_S, what: str | None = None) -> tuple[int, str]:
    """Copy one regular file of at most max_bytes from the host to dest (created, never a link);
    returns (size, sha256). Refused: not a regular file, a link, too large, silent for idle_s."""
    what = what or printable(remote_path)
    with open(dest, "xb") as out:
        if isinstance(t, LocalTransport):
            try:
                fd = _open_local_nofollow(t.abspath(remote_path))
            except OSError as e:
                raise Refused(f"{what}: cannot open without following links ({e.strerror})") from None
            with os.fdopen(fd, "rb", buffering=0) as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise Refused(f"{what}: not a regular file")
                os.set_blocking(fd, True)
                return _copy_capped(f.read, out, max_bytes, what)
        return _stream_sftp(t, t.abspath(remote_path), out, max_bytes, idle_s, what)


def _stream_sftp(t: Transport, src: str, out, max_bytes: int, idle_s: float, what: str) -> tuple[int, str]:
    import paramiko  # only SSH hosts get here

    sftp = t._sftp_client()  # noqa: SLF001 - the SSH transport's one SFTP session
    chan = sftp.get_channel()
    chan.settimeout(idle_s)
    try:
        with sftp.open(src, "rb") as f:
            st = f.stat()
            if not stat.S_ISREG(st.st_mode or 0):
                raise Refused(f"{what}: not a regular file")
            return _copy_capped(f.read, out, max_bytes, what)
    except (socket.timeout, TimeoutError):
        _drop_sftp(t)
        raise Refused(f"{what}: no data for {idle_s:g} s (transfer given up)") from None
    except OSError as e:  # the sftp-server's answer for this file (missing, not readable, ...)
        raise Refused(f"{what}: cannot read it over SFTP ({printable(e, 120)})") from None
    except (paramiko.SSHException, EOFError) as e:  # the session itself failed
        _drop_sftp(t)
        raise TransferError(f"get {printable(src)}: {printable(e, 120)}", host=t.host.name, step="fetch") from None
    finally:
        if getattr(t, "_sftp", None) is sftp:
            chan.settimeout(None)


def _drop_sftp(t: Transport) -> None:
    """A stalled SFTP session cannot be reused: close it; the next call opens a fresh one."""
    sftp = getattr(t, "_sftp", None)
    if sftp is not None:
        try:
            sftp.close()
        except Exception:  # noqa: BLE001 - it is already broken; closing is best effort
            pass
        t._sftp = None  # noqa: SLF001


def read_small(t: Transport, path: str, max_bytes: int, idle_s: float, scratch: Path) -> bytes:
    """A small regular file's bytes (capped), through a scratch file."""
    try:
        stream_file(t, path, scratch, max_bytes, idle_s, what=printable(path.rsplit("/", 1)[-1]))
        return scratch.read_bytes()
    finally:
        scratch.unlink(missing_ok=True)


# ---- the local re-check -----------------------------------------------------------------------

def _sha256_fd(f) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


MAX_JSON_FILE_BYTES = 64 * 1024 * 1024


def _check_json_file(path: Path, rel: str) -> None:
    """Reports and compare parse every .json of a run: one nested past Python's recursion limit
    (or too large to parse) is refused here rather than crashing them. Invalid JSON is kept: a
    bench that died mid-write is still a result to look at."""
    if path.stat().st_size > MAX_JSON_FILE_BYTES:
        raise Refused(f"{printable(rel)}: a JSON file over {MAX_JSON_FILE_BYTES} bytes")
    try:
        json.loads(path.read_bytes())
    except RecursionError:
        raise Refused(f"{printable(rel)}: JSON nested too deeply to parse") from None
    except ValueError:
        pass


def verify_run_folder(folder: Path, rid: str, max_run_bytes: int = DEFAULT_MAX_RUN_BYTES) -> dict:
    """The run folder as it stands here, checked from scratch: run id, manifest, every entry a
    real folder or a regular file, exactly the listed files plus manifest.json, sizes and
    sha256. Returns the manifest; Refused with the first problem otherwise."""
    why = check_run_id(rid)
    if why:
        raise Refused(why)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{folder} is not a real folder")
    mpath = folder / MANIFEST
    if not mpath.is_file() or mpath.is_symlink():
        raise Refused(f"{MANIFEST} missing or not a regular file")
    if mpath.stat().st_size > MANIFEST_MAX_BYTES:
        raise Refused(f"{MANIFEST} is over {MANIFEST_MAX_BYTES} bytes")
    manifest = parse_json(mpath.read_bytes(), MANIFEST)
    entries = check_manifest(manifest, rid, max_run_bytes)
    listed = {e["path"]: e for e in entries}
    seen = set()
    for dp, dns, fns in os.walk(folder, followlinks=False):
        for name in dns + fns:
            p = os.path.join(dp, name)
            rel = os.path.relpath(p, folder).replace(os.sep, "/")
            m = os.lstat(p).st_mode
            if stat.S_ISDIR(m):
                why = check_relpath(rel)
                if why:
                    raise Refused(why)
                continue
            if not stat.S_ISREG(m):
                raise Refused(f"{printable(rel)}: not a regular file")
            if rel == MANIFEST:
                continue
            if rel not in listed:
                raise Refused(f"{printable(rel)}: not listed in {MANIFEST}")
            seen.add(rel)
            e = listed[rel]
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(fd).st_size
                if size != e["size"]:
                    raise Refused(f"{printable(rel)}: size {size}, manifest says {e['size']}")
                sha = _sha256_fd(f)
            if sha != e["sha256"]:
                raise Refused(f"{printable(rel)}: sha256 {sha[:16]}..., manifest says {e['sha256'][:16]}...")
            if rel.endswith(".json"):
                _check_json_file(Path(p), rel)
    missing = sorted(set(listed) - seen)
    if missing:
        raise Refused(f"{printable(missing[0])}: missing" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    return manifest

