"""The results store: `results/<host>/<run-id>/`, verified downloads, and the results commit.

    fetch_results(host, repo_root, opts, progress) -> Outcome

1. List `<remote_dir>/runs/` on the host (lstat, links not followed); a run is complete when
   its manifest.json is a regular file (the runner writes it last, atomically). Every name must
   be a run id of this tool (trust.check_run_id) before anything of it is read; one that is
   not is refused alone. Which runs: opts.run None = complete runs not yet in results/;
   "latest" = the newest complete run; "all" = every complete run (ones already here are
   re-checked against the host's manifest); else one run id. Incomplete runs are reported as
   still running, never fetched.
2. Per run, before any file is read: the run folder is listed by lstat on the host, the
   manifest (capped at 16 MiB, JSON nesting capped) must be well formed (trust.check_manifest),
   and every listed file must be a regular file of its listed size under real folders, the
   total within opts.max_run_bytes. A run that is not is refused alone (the others are still
   fetched); its refusal is one line naming the run and the reason.
3. Refuse (exit 5) before downloading when a run was made from a dirty engine tree (its id
   says -dirty or its manifest does), or the local tree is dirty, unless opts.allow_dirty
   (then recorded in the commit message); this holds for runs left uncommitted here too.
4. Stream the listed files into `results/<host>/.incoming-<run-id>-<pid>/`, each capped at its
   listed size, a transfer silent for trust.IDLE_TIMEOUT_S given up; re-verify the folder from
   scratch (trust.verify_run_folder), then rename into `results/<host>/<run-id>/`. A run that
   does not verify is refused (exit 3) and leaves nothing behind.
5. Regenerate the report (engine.remote.report.write_report, imported lazily) and make one
   commit holding exactly the new run folders, earlier fetched-but-uncommitted ones (an
   interrupted fetch or a failed commit; each re-verified first, removed when it does not
   verify) and the report files: `git add -- P` then `git commit --only -- P`, so nothing else
   staged or changed is ever committed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path, PurePosixPath

from . import provenance, trust
from .errors import TransferError, UsageError
from .inventory import Host
from .hostfiles import layout_for
from .outcome import Outcome
from .plan import Options
from .progress import Progress
from .connect import open_transport
from .transport import Transport

MANIFEST = "manifest.json"
# Hosts fetch in parallel threads and git has one index: every git command run here holds this
# lock (re-entrant: a commit holds it across its add, commit and rev-parse); provenance.git_info
# only reads, with git's optional locks off.
_GIT_LOCK = threading.RLock()


def safe_relpath(rel) -> bool:
    """A manifest path that stays inside its run folder and that git gives no meaning to."""
    return trust.check_relpath(rel) is None


def verify_folder(folder: Path, manifest: dict) -> list[str]:
    """Problems found checking every listed file's size and sha256 (empty: verified). Links are
    never followed: a listed path that is a link is a problem."""
    problems = []
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list):
        return [f"{MANIFEST} has no file list"]
    for entry in files:
        rel = entry.get("path", "") if isinstance(entry, dict) else None
        if not safe_relpath(rel):
            problems.append(f"{trust.printable(rel)!r}: path leaves the run folder or is not allowed")
            continue
        p = folder / rel
        if p.is_symlink() or not p.is_file():
            problems.append(f"{rel}: missing" if not p.is_symlink() else f"{rel}: a link, not a file")
        elif p.stat().st_size != entry.get("size"):
            problems.append(f"{rel}: size {p.stat().st_size}, manifest says {entry.get('size')}")
        elif (have := provenance.sha256_file(p)) != entry.get("sha256"):
            problems.append(f"{rel}: sha256 {have[:16]}..., "
                            f"manifest says {str(entry.get('sha256'))[:16]}...")
    return problems


def list_remote_runs(t: Transport, runs_dir: str) -> list[tuple[str, bool]]:
    """(run id, complete) for every run folder on the host, oldest first; names are the host's
    and unchecked (fetch_results checks each with trust.check_run_id before reading anything)."""
    return sorted(trust.remote_runs(t, runs_dir, timeout=t.host.timeouts.connect))


def select_runs(remote: list[tuple[str, bool]], local: set[str], which: str | None) -> tuple[list[str], list[str]]:
    """(complete runs to fetch or re-check, runs still running that were asked for)."""
    complete = [rid for rid, done in remote if done]
    running = [rid for rid, done in remote if not done]
    if which is None:
        return [r for r in complete if r not in local], running
    if which == "all":
        return complete, running
    if which == "latest":
        return complete[-1:], []
    if which in running:
        return [], [which]
    if which not in complete:
        raise UsageError(f"no run {which!r} on the host", step="fetch",
                         hint=f"runs there: {', '.join(complete + running) or 'none'}")
    return [which], []


def _git(repo_root: Path, *args: str, check: bool = True) -> str:
    with _GIT_LOCK:
        r = subprocess.run(["git", "-C", str(repo_root), *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise TransferError(f"git {' '.join(args[:2])}: {r.stderr.strip() or r.stdout.strip()}",
                            step="commit", hint=f"in {repo_root}")
    return r.stdout


def uncommitted_runs(repo_root: Path, host_dir: Path) -> list[str]:
    """Folders under results/<host>/ that HEAD lacks: untracked (a fetch interrupted before its
    commit) or staged (a commit that failed, e.g. no git identity). Every one is re-verified
    before it is committed."""
    if not host_dir.is_dir():
        return []
    rel = str(host_dir.relative_to(repo_root))
    out = _git(repo_root, "ls-files", "--others", "--exclude-standard", "--", rel)
    out += _git(repo_root, "diff", "--cached", "--name-only", "--diff-filter=A", "--", rel, check=False)
    names = set()
    for p in out.splitlines():
        parts = PurePosixPath(p.strip('"')).parts
        if len(parts) > len(PurePosixPath(rel).parts):
            names.add(parts[len(PurePosixPath(rel).parts)])
    # Only folders named like runs are ours to commit (or, when they do not verify, to remove);
    # anything else a person put under results/<host>/ is left alone.
    return sorted(n for n in names if trust.check_run_id(n) is None and (host_dir / n).is_dir())


def _discard(repo_root: Path, folder: Path) -> None:
    """Remove a refused run folder here: from the index (a failed commit staged it) and the disk."""
    _git(repo_root, "rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", str(folder.relative_to(repo_root)),
         check=False)
    if folder.is_symlink():
        folder.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)


def commit_paths(repo_root: Path, paths: list[str], message: str) -> str:
    """Commit exactly `paths` (relative to repo_root); returns the new commit's sha."""
    with _GIT_LOCK:
        _git(repo_root, "add", "--", *paths)
        _git(repo_root, "commit", "-q", "--only", "-m", message, "--", *paths)
        return _git(repo_root, "rev-parse", "HEAD").strip()


def write_report(repo_root: Path, host: str, log) -> list[str]:
    """Regenerate docs/BENCHMARKS_<host>.md and its plots; returns the report paths to commit
    (written, or tracked and now deleted), [] when no report could be made. The report is derived
    from results/, so a failure here is said and the results are committed anyway."""
    try:
        from .report import write_report as report
    except ImportError as e:
        log(f"report: not regenerated: engine.remote.report is not available ({e})")
        return []
    docs = repo_root / "docs"
    try:
        report(repo_root / "results" / host, docs)
    except (ValueError, OSError) as e:  # e.g. only test runs so far: nothing to report
        log(f"report: not regenerated: {e}")
        return []
    patterns = [f"docs/BENCHMARKS_{host}.md", f"docs/BENCHMARKS_{host}_*.png"]
    now = {str(p.relative_to(repo_root)) for pat in patterns for p in repo_root.glob(pat)}
    tracked = set(_git(repo_root, "ls-files", "--", *patterns).split())
    paths = sorted(now | tracked)
    log(f"report: regenerated {', '.join(sorted(now)) or 'nothing'}")
    return paths


def _read_manifest(t: Transport, run_dir: str, rid: str, opts: Options, scratch: Path) -> tuple[dict, list, bytes]:
    """The host's manifest of one run, checked before any of its files is read: (manifest,
    file entries, its bytes). The run folder is listed by lstat on the host first: manifest.json
    and every listed file must be regular files under real folders, of the listed sizes."""
    idle = max(trust.IDLE_TIMEOUT_S, t.host.timeouts.connect)
    tree = trust.remote_tree(t, run_dir, timeout=idle)
    trust.check_tree(tree, [])  # manifest.json itself, before it is read
    if tree[MANIFEST][1] > trust.MANIFEST_MAX_BYTES:
        raise trust.Refused(f"{MANIFEST} is {tree[MANIFEST][1]} bytes, over {trust.MANIFEST_MAX_BYTES}")
    raw = trust.read_small(t, f"{run_dir}/{MANIFEST}", trust.MANIFEST_MAX_BYTES, idle, scratch)
    manifest = trust.parse_json(raw, MANIFEST)
    entries = trust.check_manifest(manifest, rid, opts.max_run_bytes)
    trust.check_tree(tree, entries)
    return manifest, entries, raw


def _download(t: Transport, remote_run: str, dest: Path, entries: list[dict], raw_manifest: bytes,
              rid: str, opts: Options) -> dict:
    """Stream every listed file into dest (capped at its listed size), then re-verify dest."""
    idle = max(trust.IDLE_TIMEOUT_S, t.host.timeouts.connect)
    dest.mkdir(parents=True)
    for e in entries:
        rel = e["path"]
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        size, sha = trust.stream_file(t, f"{remote_run}/{rel}", dest / rel, e["size"], idle, what=trust.printable(rel))
        if size != e["size"]:
            raise trust.Refused(f"{trust.printable(rel)}: size {size}, manifest says {e['size']}")
        if sha != e["sha256"]:
            raise trust.Refused(f"{trust.printable(rel)}: sha256 {sha[:16]}..., manifest says {e['sha256'][:16]}...")
    (dest / MANIFEST).write_bytes(raw_manifest)
    return trust.verify_run_folder(dest, rid, opts.max_run_bytes)


def _clean_incoming(host_dir: Path) -> None:
    """Remove temp folders left by fetches that were interrupted (their pid is gone): they are
    never committed; what they held is fetched again and verified from scratch."""
    for p in host_dir.glob(".incoming-*"):
        pid = p.name.rsplit("-", 1)[-1]
        alive = pid.isdigit() and Path(f"/proc/{pid}").exists() and int(pid) != os.getpid()
        if not alive:
            if p.is_symlink() or not p.is_dir():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)


def _check_which(which: str | None) -> None:
    if which in (None, "latest", "all"):
        return
    why = trust.check_run_id(which)
    if why:
        raise UsageError(f"--run {trust.printable(which)!r}: {why}", step="fetch",
                         hint="give a run id, latest or all")


def _refuse_dirty(host: Host, repo_root: Path, dirty_runs: list[str], git_local: dict) -> None:
    what = (f"runs {', '.join(dirty_runs)} were made from a dirty engine tree" if dirty_runs
            else f"the engine tree at {repo_root} has uncommitted changes")
    raise UsageError(f"refusing to commit results: {what}", host=host.name, step="fetch",
                     hint="commit your changes first, or pass --allow-dirty (recorded in the commit)")


def fetch_results(host: Host, repo_root: Path, opts: Options, progress: Progress) -> Outcome:
    log = progress.logger(host.name)
    repo_root = repo_root.resolve()
    host_dir = repo_root / "results" / host.name
    _check_which(opts.run)
    local = ({p.name for p in host_dir.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")}
             if host_dir.is_dir() else set())
    refused: list[tuple[str, str]] = []
    fetched, unchanged = [], []
    with open_transport(host, accept_new_host_key=opts.accept_new_host_key) as t, \
            tempfile.TemporaryDirectory(prefix="kdtree-fetch-") as scratch_dir:
        scratch = Path(scratch_dir) / "manifest.json"
        lay = layout_for(host, t)
        remote = []
        for name, done in list_remote_runs(t, lay.runs):
            why = trust.check_run_id(name)
            if why:
                refused.append((trust.printable(name), why))
            else:
                remote.append((name, done))
        wanted, running = select_runs(remote, local, opts.run)
        for rid in running:
            log(f"{rid}: still running (no final manifest yet); fetch it again once it is complete")
        manifests: dict[str, tuple[dict, list, bytes]] = {}
        for rid in wanted:
            try:
                manifests[rid] = _read_manifest(t, lay.run(rid), rid, opts, scratch)
            except trust.Refused as e:
                refused.append((rid, e.reason))
        wanted = [rid for rid in wanted if rid in manifests]
        if opts.dry_run:
            for rid in wanted:
                log(f"plan: fetch {lay.run(rid)} ({len(manifests[rid][1])} files) -> "
                    f"results/{host.name}/{rid}/" + (" (already here: re-check)" if rid in local else ""))
            for rid, why in refused:
                log(f"plan: refuse {rid}: {why}")
            log("plan: then regenerate docs/BENCHMARKS_" + host.name + ".md and commit" if not opts.no_commit else "plan: no commit")
            return Outcome(host.name, "fetch-results", f"dry run: {len(wanted)} runs to fetch", run_ids=wanted)
        git_local = provenance.git_info(repo_root)  # read only (GIT_OPTIONAL_LOCKS=0): no lock
        leftover = uncommitted_runs(repo_root, host_dir) if not opts.no_commit else []
        dirty_runs = [rid for rid in wanted if rid not in local and trust.is_dirty_run(rid, manifests[rid][0])]
        dirty_runs += [rid for rid in leftover if rid not in dirty_runs and trust.is_dirty_run(rid, _local_manifest(host_dir / rid))]
        if not opts.no_commit and not opts.allow_dirty and (dirty_runs or git_local.get("dirty")):
            _refuse_dirty(host, repo_root, dirty_runs, git_local)
        host_dir.mkdir(parents=True, exist_ok=True)
        _clean_incoming(host_dir)
        for rid in wanted:
            m, entries, raw = manifests[rid]
            if rid in local:
                try:
                    here = trust.verify_run_folder(host_dir / rid, rid, opts.max_run_bytes)
                except trust.Refused as e:
                    here = None
                    why = e.reason
                if here == m:
                    unchanged.append(rid)
                else:
                    refused.append((rid, f"results/{host.name}/{rid} exists and differs from the host's run"
                                    + (f" ({why})" if here is None else "")))
                continue
            progress.status(host.name, f"fetch {rid}")
            tmp = host_dir / f".incoming-{rid}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _download(t, lay.run(rid), tmp, entries, raw, rid, opts)
            except trust.Refused as e:
                shutil.rmtree(tmp, ignore_errors=True)
                refused.append((rid, e.reason))
                continue
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.rename(tmp, host_dir / rid)  # atomic: a run folder appears complete or not at all
            fetched.append(rid)
            log(f"{rid}: fetched and verified ({len(entries)} files): {trust.printable(m.get('summary'))}")
    # Runs here but not committed (an interrupted fetch, a failed commit): re-verified from scratch.
    for rid in [r for r in leftover if r not in fetched]:
        try:
            trust.verify_run_folder(host_dir / rid, rid, opts.max_run_bytes)
        except (trust.Refused, OSError) as e:
            _discard(repo_root, host_dir / rid)
            leftover.remove(rid)
            refused.append((trust.printable(rid), f"left here uncommitted and does not verify: "
                            f"{getattr(e, 'reason', e)}; removed"))
    for rid, why in refused:
        log(f"{rid}: REFUSED: {why}")
    to_commit = fetched + [r for r in leftover if r not in fetched]
    commit = None
    if to_commit and not opts.no_commit:
        report_paths = write_report(repo_root, host.name, log)
        paths = [f"results/{host.name}/{r}" for r in to_commit] + report_paths
        commit = commit_paths(repo_root, paths, commit_message(host, repo_root, to_commit, opts, git_local))
        log(f"committed {commit[:10]}: {len(to_commit)} runs ({', '.join(to_commit)})")
    summary = (f"{len(fetched)} fetched, {len(unchanged)} unchanged, {len(refused)} refused, "
               f"{len(running)} still running" + (f"; commit {commit[:10]}" if commit else ""))
    err = None
    if refused:
        err = TransferError(f"{len(refused)} runs refused: " + "; ".join(f"{r}: {w}" for r, w in refused),
                            host=host.name, step="fetch",
                            hint="nothing of those runs was kept; the other runs were fetched")
    return Outcome(host.name, "fetch-results", summary, err, to_commit,
                   {"refused": dict(refused), "running": running, "commit": commit})


def _local_manifest(folder: Path) -> dict | None:
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return m if isinstance(m, dict) else None


def commit_message(host: Host, repo_root: Path, run_ids: list[str], opts: Options, git_local: dict) -> str:
    host_dir = repo_root / "results" / host.name
    manifests = {r: _local_manifest(host_dir / r) or {} for r in run_ids}
    gits = {r: (m.get("git") if isinstance(m.get("git"), dict) else {}) for r, m in manifests.items()}
    shas = sorted({trust.printable(g.get("sha") or "unknown", 40) for g in gits.values()})
    dirty = [r for r in run_ids if trust.is_dirty_run(r, manifests[r])]
    lines = [f"results: {host.name}: {', '.join(run_ids)} (engine {', '.join(s[:10] for s in shas)})", ""]
    lines += [f"{r}: {trust.printable(m.get('summary'))}" for r, m in manifests.items()]
    lines += ["", f"Host: {host.name} ({host.address})"]
    lines += [f"Engine-Commit: {s}" for s in shas]
    lines += [f"Run-Id: {r}" for r in run_ids]
    if opts.allow_dirty and (dirty or git_local.get("dirty")):
        for r in dirty:
            lines.append(f"Allow-Dirty: {r} ran a dirty tree (diff sha256 {trust.printable(gits[r].get('diff_sha256'), 64)})")
        if git_local.get("dirty"):
            lines.append(f"Allow-Dirty: committed from a dirty tree (diff sha256 {git_local.get('diff_sha256')})")
    return "\n".join(lines) + "\n"
