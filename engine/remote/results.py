"""The results store: `results/<host>/<run-id>/`, verified downloads, and the results commit.

    fetch_results(host, repo_root, opts, progress) -> Outcome

1. List `<remote_dir>/runs/`; a run is complete when its manifest.json exists (the runner
   writes it last, atomically). Which runs: opts.run None = complete runs not yet in results/;
   "latest" = the newest complete run; "all" = every complete run (ones already here are
   re-checked against the host's manifest); else one run id. Incomplete runs are reported as
   still running, never fetched.
2. Refuse (exit 5) before downloading when a run was made from a dirty engine tree, or the
   local tree is dirty, unless opts.allow_dirty (then recorded in the commit message).
3. Download the files the manifest lists into `results/<host>/.incoming-<run-id>-<pid>/`,
   check every size and sha256, then rename into `results/<host>/<run-id>/`. A file that does
   not verify refuses that run (exit 3) and leaves nothing behind.
4. Regenerate the report (engine.remote.report.write_report, imported lazily) and make one
   commit holding exactly the new run folders, earlier fetched-but-uncommitted ones (an
   interrupted fetch) and the report files: `git add -- P` then `git commit --only -- P`, so
   nothing else staged or changed is ever committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import threading
from pathlib import Path, PurePosixPath

from . import provenance
from .errors import KdtError, TransferError, UsageError
from .inventory import Host
from .hostfiles import layout_for, read_remote_json
from .outcome import Outcome
from .plan import Options
from .progress import Progress
from .connect import open_transport
from .transport import Transport

MANIFEST = "manifest.json"
_GIT_LOCK = threading.Lock()  # hosts fetch in parallel threads; git has one index


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def safe_relpath(rel: str) -> bool:
    """A manifest path that stays inside its run folder."""
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "\\" not in rel


def verify_folder(folder: Path, manifest: dict) -> list[str]:
    """Problems found checking every listed file's size and sha256 (empty: verified)."""
    problems = []
    files = manifest.get("files")
    if not isinstance(files, list):
        return [f"{MANIFEST} has no file list"]
    for entry in files:
        rel = entry.get("path", "")
        if not safe_relpath(rel):
            problems.append(f"{rel!r}: path leaves the run folder")
            continue
        p = folder / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
        elif p.stat().st_size != entry.get("size"):
            problems.append(f"{rel}: size {p.stat().st_size}, manifest says {entry.get('size')}")
        elif sha256_file(p) != entry.get("sha256"):
            problems.append(f"{rel}: sha256 {sha256_file(p)[:16]}..., manifest says {str(entry.get('sha256'))[:16]}...")
    return problems


def list_remote_runs(t: Transport, runs_dir: str) -> list[tuple[str, bool]]:
    """(run id, complete) for every run folder on the host, oldest first."""
    q = shlex.quote(runs_dir)
    r = t.run(f"[ -d {q} ] || exit 0\ncd {q} && for d in */; do [ -d \"$d\" ] || continue; d=${{d%/}}; "
              f"if [ -f \"$d/{MANIFEST}\" ]; then echo \"complete $d\"; else echo \"running $d\"; fi; done",
              timeout=t.host.timeouts.connect)
    if not r.ok:
        raise TransferError(f"listing {runs_dir}: {r.tail()}", host=t.host.name, step="fetch")
    runs = [(line.split(" ", 1)[1], line.startswith("complete")) for line in r.stdout.splitlines() if " " in line]
    return sorted(runs)


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
    r = subprocess.run(["git", "-C", str(repo_root), *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise TransferError(f"git {' '.join(args[:2])}: {r.stderr.strip() or r.stdout.strip()}",
                            step="commit", hint=f"in {repo_root}")
    return r.stdout


def uncommitted_runs(repo_root: Path, host_dir: Path) -> list[str]:
    """Run folders under results/<host>/ that git does not track yet (an interrupted fetch)."""
    if not host_dir.is_dir():
        return []
    out = _git(repo_root, "ls-files", "--others", "--exclude-standard", "--", str(host_dir.relative_to(repo_root)))
    names = {Path(p).relative_to(host_dir.relative_to(repo_root)).parts[0] for p in out.splitlines() if p}
    return sorted(n for n in names if not n.startswith(".") and (host_dir / n / MANIFEST).is_file())


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


def _download(t: Transport, remote_run: str, dest: Path, manifest: dict) -> list[str]:
    for entry in manifest.get("files", []):
        rel = entry.get("path", "")
        if not safe_relpath(rel):
            return [f"{rel!r}: path leaves the run folder"]
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        t.get(f"{remote_run}/{rel}", dest / rel)
    t.get(f"{remote_run}/{MANIFEST}", dest / MANIFEST)
    got = json.loads((dest / MANIFEST).read_text())
    if got != manifest:
        return [f"{MANIFEST} changed while it was fetched"]
    return verify_folder(dest, manifest)


def _clean_incoming(host_dir: Path) -> None:
    """Remove temp folders left by fetches that were interrupted (their pid is gone)."""
    for p in host_dir.glob(".incoming-*"):
        pid = p.name.rsplit("-", 1)[-1]
        alive = pid.isdigit() and Path(f"/proc/{pid}").exists() and int(pid) != os.getpid()
        if not alive:
            shutil.rmtree(p, ignore_errors=True)


def fetch_results(host: Host, repo_root: Path, opts: Options, progress: Progress) -> Outcome:
    log = progress.logger(host.name)
    repo_root = repo_root.resolve()
    host_dir = repo_root / "results" / host.name
    local = {p.name for p in host_dir.iterdir() if p.is_dir() and not p.name.startswith(".")} if host_dir.is_dir() else set()
    with open_transport(host, accept_new_host_key=opts.accept_new_host_key) as t:
        lay = layout_for(host, t)
        remote = list_remote_runs(t, lay.runs)
        wanted, running = select_runs(remote, local, opts.run)
        for rid in running:
            log(f"{rid}: still running (no final manifest yet); fetch it again once it is complete")
        manifests = {}
        for rid in wanted:
            manifests[rid] = read_remote_json(t, f"{lay.run(rid)}/{MANIFEST}")
        if opts.dry_run:
            for rid in wanted:
                log(f"plan: fetch {lay.run(rid)} ({len(manifests[rid].get('files', []))} files) -> "
                    f"results/{host.name}/{rid}/" + (" (already here: re-check)" if rid in local else ""))
            log("plan: then regenerate docs/BENCHMARKS_" + host.name + ".md and commit" if not opts.no_commit else "plan: no commit")
            return Outcome(host.name, "fetch-results", f"dry run: {len(wanted)} runs to fetch", run_ids=wanted)
        git_local = provenance.git_info(repo_root)
        dirty_runs = [rid for rid in wanted if rid not in local and (manifests[rid].get("git") or {}).get("dirty")]
        if not opts.no_commit and not opts.allow_dirty and (dirty_runs or git_local.get("dirty")):
            what = (f"runs {', '.join(dirty_runs)} were made from a dirty engine tree" if dirty_runs
                    else f"the engine tree at {repo_root} has uncommitted changes")
            raise UsageError(f"refusing to commit results: {what}", host=host.name, step="fetch",
                             hint="commit your changes first, or pass --allow-dirty (recorded in the commit)")
        host_dir.mkdir(parents=True, exist_ok=True)
        _clean_incoming(host_dir)
        fetched, refused, unchanged = [], [], []
        for rid in wanted:
            m = manifests[rid]
            if rid in local:
                here = json.loads((host_dir / rid / MANIFEST).read_text()) if (host_dir / rid / MANIFEST).is_file() else None
                if here == m and not verify_folder(host_dir / rid, m):
                    unchanged.append(rid)
                else:
                    refused.append((rid, f"results/{host.name}/{rid} exists and differs from the host's run"))
                continue
            progress.status(host.name, f"fetch {rid}")
            tmp = host_dir / f".incoming-{rid}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                problems = _download(t, lay.run(rid), tmp, m)
            except KdtError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if problems:
                shutil.rmtree(tmp, ignore_errors=True)
                refused.append((rid, "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")))
                continue
            os.rename(tmp, host_dir / rid)  # atomic: a run folder appears complete or not at all
            fetched.append(rid)
            log(f"{rid}: fetched and verified ({len(m.get('files', []))} files): {m.get('summary')}")
    for rid, why in refused:
        log(f"{rid}: REFUSED: {why}")
    leftover = [r for r in uncommitted_runs(repo_root, host_dir) if r not in fetched]
    to_commit = fetched + leftover
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
        err = TransferError(f"{len(refused)} runs did not verify: " + "; ".join(f"{r}: {w}" for r, w in refused),
                            host=host.name, step="fetch", hint="nothing of those runs was kept; rerun the run if the host copy is damaged")
    return Outcome(host.name, "fetch-results", summary, err, to_commit,
                   {"refused": dict(refused), "running": running, "commit": commit})


def commit_message(host: Host, repo_root: Path, run_ids: list[str], opts: Options, git_local: dict) -> str:
    host_dir = repo_root / "results" / host.name
    manifests = {r: json.loads((host_dir / r / MANIFEST).read_text()) for r in run_ids}
    shas = sorted({(m.get("git") or {}).get("sha") or "unknown" for m in manifests.values()})
    dirty = [r for r, m in manifests.items() if (m.get("git") or {}).get("dirty")]
    lines = [f"results: {host.name}: {', '.join(run_ids)} (engine {', '.join(s[:10] for s in shas)})", ""]
    lines += [f"{r}: {m.get('summary')}" for r, m in manifests.items()]
    lines += ["", f"Host: {host.name} ({host.address})"]
    lines += [f"Engine-Commit: {s}" for s in shas]
    lines += [f"Run-Id: {r}" for r in run_ids]
    if opts.allow_dirty and (dirty or git_local.get("dirty")):
        for r in dirty:
            lines.append(f"Allow-Dirty: {r} ran a dirty tree (diff sha256 {manifests[r]['git'].get('diff_sha256')})")
        if git_local.get("dirty"):
            lines.append(f"Allow-Dirty: committed from a dirty tree (diff sha256 {git_local.get('diff_sha256')})")
    return "\n".join(lines) + "\n"
