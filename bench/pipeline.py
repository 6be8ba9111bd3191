"""Suite `pipeline`: the deploy/fetch machinery itself, timed over a loopback sshd.

    python -m bench --suite pipeline --out DIR [--quick]

What is timed (monotonic clock; each sample is connect + the step + close, as a deploy does):
- `first_deploy`: the whole source tree (this checkout's `git ls-files -co --exclude-standard`)
  into an empty remote_dir;
- `noop_redeploy`: the same again with nothing changed (one probe, nothing sent);
- `one_file_redeploy`: one mid-sized file changed (fresh random bytes each sample);
- `fetch`: a run folder (manifest + JSON + logs + JUnit, fresh random contents) brought home file
  by file with `Transport.get` and every file's sha256 checked against its manifest, which is how
  fetch-results downloads.
For both sync methods: `rsync`, and `tar` (rsync hidden through the host's `env: PATH`).
Targets (issue 2): noop_redeploy under 1 s and under 10% of first_deploy, per method; each noop
record carries `targets` with both verdicts. Validation before trusting a time: after every
deploy sample the remote tree's sha256s must equal the local ones and the report must say what
was expected (everything / nothing / exactly one file sent), and every fetched file must verify.

The source tree is copied into a throwaway git repo first (this checkout is never modified),
and the remote folder lives in a temp folder; the sshd is engine/remote/loopback.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench import REPO_ROOT, format_table
from bench.timing import summarize

NAME = "pipeline"
NOOP_LIMIT_S = 1.0
NOOP_LIMIT_FRACTION = 0.10


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _copy_tree_as_repo(src_root: Path, dest: Path) -> list[str]:
    """dest = a fresh git repo holding the files sync would send from src_root (one commit)."""
    from engine.remote.sync import git_file_list

    files = git_file_list(src_root)
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if (src_root / rel).is_symlink():
            os.symlink(os.readlink(src_root / rel), dest / rel)
        else:
            shutil.copy2(src_root / rel, dest / rel)
    git = ["git", "-C", str(dest), "-c", "user.name=bench", "-c", "user.email=bench@invalid"]
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "bench copy"], check=True)
    return files


def _remote_matches(repo: Path, src: Path, files: list[str]) -> str | None:
    """None when src/ holds exactly `files` with the repo's contents, else what differs."""
    there = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() or p.is_symlink())
    if there != sorted(files):
        extra, missing = set(there) - set(files), set(files) - set(there)
        return f"remote file set differs: {len(missing)} missing, {len(extra)} extra"
    for rel in files:
        a, b = repo / rel, src / rel
        if a.is_symlink() or b.is_symlink():
            if os.readlink(a) != os.readlink(b):
                return f"{rel}: symlink differs"
        elif _sha256(a) != _sha256(b):
            return f"{rel}: content differs"
    return None


def _make_run_folder(folder: Path, rng_bytes) -> dict:
    """A run folder like the runner leaves: files plus a final manifest.json (path, size, sha256)."""
    layout = {"kernels.json": 400_000, "tree_build.json": 250_000, "e2e.json": 120_000,
              "kernels.txt": 4_000, "pytest-junit.xml": 60_000, "native-junit.xml": 30_000,
              **{f"logs/step{i}.log": 50_000 for i in range(6)}}
    entries = []
    for rel, size in layout.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng_bytes(size))
        entries.append({"path": rel, "size": size, "sha256": _sha256(path)})
    manifest = {"schema": 1, "run_id": "bench-fetch", "files": entries}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def _fetch(transport, remote_run: str, dest: Path, manifest: dict) -> str | None:
    """Download every manifest file, verify size + sha256; None when all verify."""
    for entry in manifest["files"]:
        local = dest / entry["path"]
        transport.get(f"{remote_run}/{entry['path']}", local)
        if local.stat().st_size != entry["size"] or _sha256(local) != entry["sha256"]:
            return f"{entry['path']}: does not verify"
    transport.get(f"{remote_run}/manifest.json", dest / "manifest.json")
    return None


def _record(step: str, method: str, samples: list[float], files: int, bytes_sent: list[int],
            sent: list[int], problem: str | None, **extra) -> dict:
    r = {"bench": "pipeline", "backend": method, "case": {"step": step, "method": method, "files": files},
         "samples": samples, "summary": summarize(samples), "files_sent": sent, "bytes_sent": bytes_sent,
         "validation": {"ok": problem is None, **({"error": problem} if problem else {})}}
    r.update(extra)
    return r


def _ssh_baseline(host, reps: int) -> list[float]:
    """Seconds of one `true` over an open connection: the host's fixed cost per command (sshd
    session + the user's shell start-up, e.g. a .bashrc), which bounds every step above."""
    from engine.remote.connect import open_transport

    with open_transport(host) as t:
        t.run(["true"])
        samples = []
        for _ in range(reps):
            t0 = time.monotonic()
            t.run(["true"])
            samples.append(time.monotonic() - t0)
    return samples


def _pipeline_deploy_fn(host, repo: Path):
    """A callable running the real `invoke deploy` code path (sync + build + bundles) for host,
    or (None, why) when engine.remote.pipeline is not importable in this checkout."""
    try:
        from engine.remote.pipeline import deploy
        from engine.remote.plan import Options
        from engine.remote.progress import Progress
    except ImportError as e:
        return None, f"engine.remote.pipeline not importable: {e}"

    def run_deploy():
        with open(os.devnull, "w") as devnull:
            progress = Progress([host.name], stream=devnull, live=False, quiet_output=True)
            outcome = deploy(host, repo, Options(), progress)
        if outcome.error is not None:
            raise RuntimeError(f"deploy failed: {outcome.error}")
        return outcome.summary

    return run_deploy, None


def run(ctx) -> dict:
    from engine.remote.inventory import load_host
    from engine.remote.loopback import LoopbackSshd, path_without, sshd_missing_reason
    from engine.remote.sync import sync
    from engine.remote.connect import open_transport

    reason = sshd_missing_reason()
    if reason:
        raise RuntimeError(f"pipeline suite needs a loopback sshd: {reason}")
    reps = 3 if ctx.quick else 7
    seed = int.from_bytes(os.urandom(4), "little")
    import random

    rng = random.Random(seed)
    records, rows, notes = [], [], []

    def add_row(method, step, samples, sent, nbytes, problem):
        s = summarize(samples)
        rows.append([method, step, s["median"] * 1e3, s["p10"] * 1e3, s["p90"] * 1e3, sent, nbytes,
                     "ok" if problem is None else "INVALID: " + problem[:50]])

    with tempfile.TemporaryDirectory(prefix="kdt-bench-pipeline-") as tmp_s, LoopbackSshd() as sshd:
        tmp = Path(tmp_s)
        repo = tmp / "repo"
        repo.mkdir()
        files = _copy_tree_as_repo(REPO_ROOT, repo)
        tree_bytes = sum((repo / f).lstat().st_size for f in files)
        # The file changed in one_file_redeploy: the median-sized regular file of the tree.
        regular = sorted((f for f in files if not (repo / f).is_symlink()), key=lambda f: (repo / f).stat().st_size)
        victim = regular[len(regular) // 2]
        no_rsync = path_without(["rsync"], tmp / "bin-without-rsync")
        methods = ["rsync", "tar"] if shutil.which("rsync") else ["tar"]

        def host_for(name: str, **fields):
            return load_host(str(sshd.write_host_yaml(tmp / "hosts" / f"{name}.yaml", **fields)), tmp / "hosts")

        base = _ssh_baseline(host_for("bench-baseline", remote_dir=str(tmp / "remote-baseline")), reps)
        records.append(_record("ssh_exec_true", "ssh", base, 0, [0] * reps, [0] * reps, None))
        add_row("ssh", "exec `true`", base, 0, 0, None)

        # 1. The sync layer alone (connect + sync + close), per method.
        for method in methods:
            remote = tmp / f"remote-{method}"
            env = {"PATH": no_rsync} if method == "tar" else None
            host = host_for(f"bench-{method}", remote_dir=str(remote), env=env)

            def deploy():
                t0 = time.monotonic()
                with open_transport(host) as t:
                    rep = sync(repo, t, log=lambda _line: None)
                return time.monotonic() - t0, rep

            stats = {}
            for step in ("first_deploy", "noop_redeploy", "one_file_redeploy"):
                samples, bytes_sent, sent, problem = [], [], [], None
                for _ in range(reps):
                    if step == "first_deploy":
                        shutil.rmtree(remote, ignore_errors=True)
                    elif step == "one_file_redeploy":
                        (repo / victim).write_bytes(rng.randbytes(max((repo / victim).stat().st_size, 64)))
                    seconds, rep = deploy()
                    if rep.method != method:
                        problem = problem or f"sync used {rep.method}, expected {method}"
                    want = {"first_deploy": len(files), "noop_redeploy": 0, "one_file_redeploy": 1}[step]
                    if len(rep.sent) != want:
                        problem = problem or f"{len(rep.sent)} files sent, expected {want}"
                    problem = problem or _remote_matches(repo, remote / "src", files)
                    samples.append(seconds)
                    bytes_sent.append(rep.bytes_sent)
                    sent.append(len(rep.sent))
                stats[step] = summarize(samples)["median"]
                extra = _targets(stats, step)
                if step == "first_deploy":
                    extra["rates"] = {"tree_MB_per_s": {"value": tree_bytes / 1e6 / stats[step],
                                                        "formula": "tree bytes / 1e6 / median seconds"}}
                records.append(_record(f"sync_{step}", method, samples, len(files), bytes_sent, sent, problem,
                                       changed_file=victim if step == "one_file_redeploy" else None, **extra))
                add_row(method, f"sync {step}", samples, max(sent), max(bytes_sent), problem)

        # 2. The real deploy (engine.remote.pipeline.deploy: lock, sync, build, bundles).
        remote = tmp / "remote-deploy"
        host = host_for("bench-deploy", remote_dir=str(remote))
        run_deploy, why = _pipeline_deploy_fn(host, repo)
        if run_deploy is None:
            notes.append(f"full deploy not measured: {why}")
        else:
            try:
                _time_full_deploy(run_deploy, remote, repo, files, victim, rng, reps, ctx.quick, records, add_row)
            except Exception as e:  # e.g. the tree does not build right now: the sync figures still stand
                notes.append(f"full deploy not measured: {type(e).__name__}: {' '.join(str(e).split())[-2000:]}")

        # 3. fetch: a run folder over SSH, file by file with sha256 checks.
        remote_run = tmp / "remote-fetch" / "runs" / "bench-fetch"
        manifest = _make_run_folder(remote_run, rng.randbytes)
        run_bytes = sum(e["size"] for e in manifest["files"])
        host = host_for("bench-fetch", remote_dir=str(tmp / "remote-fetch"))
        samples, problem = [], None
        for i in range(reps):
            dest = tmp / f"fetched-{i}"
            t0 = time.monotonic()
            with open_transport(host) as t:
                problem = problem or _fetch(t, str(remote_run), dest, manifest)
            samples.append(time.monotonic() - t0)
        nfiles = len(manifest["files"]) + 1
        records.append(_record("fetch", "sftp", samples, nfiles, [run_bytes] * reps, [nfiles] * reps, problem,
                               rates={"MB_per_s": {"value": run_bytes / 1e6 / summarize(samples)["median"],
                                                   "formula": "run folder bytes / 1e6 / median seconds"}}))
        add_row("sftp", "fetch run folder", samples, nfiles, run_bytes, problem)

    verdicts = [f"{r['backend']} {r['case']['step']}: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r["targets"].items())
                for r in records if "targets" in r]
    table = format_table(["method", "step", "median ms", "p10 ms", "p90 ms", "files sent", "bytes sent", "check"], rows)
    table += "\nno-change redeploy targets:\n" + "".join(f"  {v}\n" for v in verdicts)
    table += "".join(f"note: {n[:300]}{' ... (in the JSON)' if len(n) > 300 else ''}\n" for n in notes)
    return {"params": {"reps": reps, "seed": seed, "tree_files": len(files), "tree_bytes": tree_bytes,
                       "methods": methods, "transport": "ssh to a loopback sshd (127.0.0.1)", "notes": notes,
                       "targets": {"noop_under_s": NOOP_LIMIT_S, "noop_under_fraction_of_first": NOOP_LIMIT_FRACTION}},
            "results": records, "table": table}


def _time_full_deploy(run_deploy, remote: Path, repo: Path, files, victim, rng, reps, quick, records, add_row):
    stats = {}
    deploy_reps = {"first_deploy": 1 if quick else 2, "noop_redeploy": reps, "one_file_redeploy": 1 if quick else 2}
    for step, n in deploy_reps.items():
        samples, problem, summaries = [], None, []
        for _ in range(n):
            if step == "first_deploy":
                shutil.rmtree(remote, ignore_errors=True)
            elif step == "one_file_redeploy":
                (repo / victim).write_bytes(rng.randbytes(max((repo / victim).stat().st_size, 64)))
            t0 = time.monotonic()
            summaries.append(run_deploy())
            samples.append(time.monotonic() - t0)
            problem = problem or _remote_matches(repo, remote / "src", files)
        stats[step] = summarize(samples)["median"]
        records.append(_record(f"deploy_{step}", "pipeline.deploy", samples, len(files), [], [], problem,
                               deploy_summaries=summaries, **_targets(stats, step)))
        add_row("deploy", step, samples, None, None, problem)


def _targets(stats: dict, step: str) -> dict:
    """For a noop_redeploy: both issue-2 targets and the noop/first ratio."""
    if step != "noop_redeploy":
        return {}
    noop, first = stats[step], stats["first_deploy"]
    return {"targets": {f"median under {NOOP_LIMIT_S:g} s": noop < NOOP_LIMIT_S,
                        f"median under {NOOP_LIMIT_FRACTION:.0%} of first_deploy": noop < NOOP_LIMIT_FRACTION * first},
            "rates": {"noop_over_first": {"value": noop / first, "formula": "median(noop_redeploy) / median(first_deploy)"}}}
