"""The pipeline: deploy, test-remote, bench, doctor on one host, and several hosts in parallel.

    deploy(host, repo_root, opts, progress)        -> Outcome   sync + build (+ bundles)
    test_remote(host, repo_root, opts, progress)   -> Outcome   deploy, then a `test` run
    bench(host, repo_root, opts, progress)         -> Outcome   deploy, then a `bench` run
    doctor(host, repo_root, opts, progress)        -> Outcome
    run_hosts(fn, hosts, repo_root, opts, progress) -> [Outcome]   one thread per host

Each builds its plan (engine/remote/plan.py) first; with opts.dry_run it prints the plan and
returns (it connects, to show the sync's files and real paths, but changes nothing). A run is
executed on the host by engine/remote/runner.py from the synced source, which finalizes the run
folder's manifest.json; test_remote and bench read it back for their summary line.

Expected failures raise KdtError (engine/remote/errors.py); a run whose tests failed is not an
exception but an Outcome carrying TestsFailed, so its run id is still reported. run_hosts turns
every host's result or error into an Outcome and never lets one host's failure lose another's;
an unexpected exception becomes exit code 70 with its traceback in .kdtree/debug.log.
"""

from __future__ import annotations

import json
import shlex
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from . import provenance
from .errors import (BuildFailed, ConfigError, Interrupted, KdtError, StepTimeout, TestsFailed,
                     TransferError, UsageError)
from .inventory import Host
from .locks import RemoteLock
from .plan import (BUILD_INPUTS, BUNDLE_INPUTS, Layout, Options, Plan, make_run_id, plan_deploy,
                   plan_run, runner_request, source_digest)
from .progress import Progress
from .connect import open_transport
from .hostfiles import layout_for, read_remote_json, write_remote_json
from .outcome import INTERNAL_ERROR_EXIT, Outcome
from .transport import Transport

DEBUG_LOG = Path(".kdtree") / "debug.log"


def _n(x) -> int:
    return len(x) if isinstance(x, (list, tuple, set, dict)) else int(x or 0)


def _sync_module():
    from . import sync  # the orchestration core's module; imported when a deploy needs it
    return sync


def _print_plan(plan: Plan, log: Callable[[str], None]) -> None:
    for line in plan.render():
        log(line)


# ---- deploy ----------------------------------------------------------------------------------------

def _deploy_on(t: Transport, host: Host, repo_root: Path, opts: Options, progress: Progress,
               plans: list[dict] | None = None) -> str:
    """Sync and build on an open transport; returns the summary line. A dry run appends its
    plan to `plans` (for --json) and changes nothing."""
    log = progress.logger(host.name)
    sync = _sync_module()
    files = sync.git_file_list(repo_root)
    lay = layout_for(host, t)
    plan = plan_deploy(host, lay, repo_root, opts, n_files=len(files))
    if opts.dry_run:
        _print_plan(plan, log)
        rep = sync.sync(repo_root, t, dry_run=True, log=log)
        if plans is not None:
            plans.append({**plan.to_dict(), "sync": {"method": rep.method, "send": list(rep.sent),
                                                     "delete": list(rep.deleted), "bytes": rep.bytes_sent}})
        return "dry run: nothing changed"
    with RemoteLock(t, purpose="deploy", wait_s=opts.lock_wait_s,
                    hold_s=host.timeouts.sync + 2 * host.timeouts.build + 300, log=log, step="deploy"):
        progress.status(host.name, "sync")
        rep = sync.sync(repo_root, t, dry_run=False, log=log)
        summary = (f"sync ({rep.method}): {_n(rep.sent)} sent, {_n(rep.unchanged)} unchanged, "
                   f"{_n(rep.deleted)} deleted, {rep.bytes_sent} bytes in {rep.seconds:.1f} s")
        build = plan.step("build")
        if build.skipped:
            return summary + f"; build skipped ({build.skipped})"
        bundles = plan.step("bundles")
        stamp_path = f"{lay.build}/deploy.json"
        probe = _deploy_probe(t, host, lay, stamp_path)
        stamp = probe["stamp"] or {}
        digests = {"build": source_digest(repo_root, files, build.argv, BUILD_INPUTS, probe["toolchain"]),
                   "bundles": source_digest(repo_root, files, bundles.argv or [], BUNDLE_INPUTS)}
        todo = []
        if stamp.get("build_digest") == digests["build"] and probe["lib"]:
            log(f"build: up to date ({lay.lib}, digest {digests['build'][:12]} of cuda/, the build "
                f"line and {probe['toolchain'].splitlines()[0] if probe['toolchain'] else 'the compiler'})")
        else:
            todo.append(build)
        if bundles.skipped:
            log(f"bundles: skipped ({bundles.skipped})")
        elif todo or stamp.get("bundles_digest") != digests["bundles"] or not probe["bundles"]:
            todo.append(bundles)
        if not todo:
            return summary + "; build up to date"
        cancel = getattr(opts.interrupt, "stop", None)  # Ctrl-C kills the step's group on the host
        for step in todo:
            if cancel is not None and cancel.is_set():
                raise Interrupted(f"stopped before {step.name} (Ctrl-C)", host=host.name, step=step.name)
            progress.status(host.name, step.name)
            log(f"{step.name}: $ {' '.join(step.argv)}")
            try:
                r = t.run(step.argv, cwd=step.cwd, env=step.env, timeout=step.timeout,
                          on_output=progress.output(host.name), cancel=cancel)
            except KdtError as e:
                raise e.with_context(host=host.name, step=step.name)
            if not r.ok:
                raise BuildFailed(f"`{' '.join(step.argv)}` exited {r.exit_code}"
                                  + (f" ({r.signal})" if r.signal else "") + f": {r.tail(3)}",
                                  host=host.name, step=step.name,
                                  hint="the full output is above; run `invoke build` locally to reproduce")
        write_remote_json(t, stamp_path, {"build_digest": digests["build"], "bundles_digest": digests["bundles"],
                                          "toolchain": probe["toolchain"], "build_argv": build.argv,
                                          "git": provenance.git_info(repo_root),
                                          "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return summary + "; " + " and ".join("built " + lay.lib if s is build else "regenerated the bundles"
                                             for s in todo)


_PROBE_SEP = "--kdt-deploy-probe--"


def _deploy_probe(t: Transport, host: Host, lay: Layout, stamp_path: str) -> dict:
    """One round trip: the last deploy's stamp, whether the library and bundles exist, and the
    compiler versions the build would use (g++, and nvcc for a GPU arch)."""
    q = shlex.quote
    compilers = "g++ --version 2>/dev/null | head -n 1"
    if host.cuda_arch != "cpu":
        compilers += "; nvcc --version 2>/dev/null | tail -n 2"
    r = t.run(f"cat {q(stamp_path)} 2>/dev/null; echo {_PROBE_SEP}; test -f {q(lay.lib)} && echo lib; "
              f"test -d {q(lay.bundles)} && echo bundles; echo {_PROBE_SEP}; {compilers}",
              timeout=host.timeouts.connect)
    parts = r.stdout.split(_PROBE_SEP + "\n")
    if not r.ok or len(parts) != 3:
        raise TransferError(f"probing {lay.build}: {r.tail()}", host=host.name, step="deploy")
    try:
        stamp = json.loads(parts[0]) if parts[0].strip() else None
    except ValueError:
        stamp = None  # a torn or hand-edited stamp: rebuild
    return {"stamp": stamp, "lib": "lib" in parts[1].split(), "bundles": "bundles" in parts[1].split(),
            "toolchain": parts[2].strip()}


def deploy(host: Host, repo_root: Path, opts: Options, progress: Progress) -> Outcome:
    plans: list[dict] = []
    with open_transport(host, accept_new_host_key=opts.accept_new_host_key) as t:
        summary = _deploy_on(t, host, repo_root, opts, progress, plans)
    return Outcome(host.name, "deploy", summary, details={"plans": plans} if plans else {})


# ---- runs: test-remote and bench --------------------------------------------------------------------

def _new_run_dir(t: Transport, lay: Layout, git: dict, kind: str) -> str:
    """Create runs/<run-id>/ (mkdir, not -p: two runs never share a folder); returns the id."""
    for _ in range(5):
        run_id = make_run_id(git, kind)
        r = t.run(f"mkdir -p {shlex.quote(lay.runs)} && mkdir {shlex.quote(lay.run(run_id))}",
                  timeout=t.host.timeouts.connect)
        if r.ok:
            return run_id
        time.sleep(1.0)  # the id has a one-second clock: the next one differs
    raise TransferError(f"cannot create a run folder under {lay.runs}: {r.tail()}", host=t.host.name)


def _require_deployed(t: Transport, host: Host, lay: Layout, kind: str) -> None:
    """--no-deploy runs what is already on the host: say so at once when nothing is."""
    if not t.run(f"test -d {shlex.quote(lay.src)}", timeout=host.timeouts.connect).ok:
        raise UsageError(f"--no-deploy, but nothing is deployed in {lay.src}", host=host.name, step=kind,
                         hint=f"drop --no-deploy, or run `invoke deploy --host {host.name}` first")


def _run(kind: str, host: Host, repo_root: Path, opts: Options, progress: Progress) -> Outcome:
    log = progress.logger(host.name)
    git = provenance.git_info(repo_root)
    with open_transport(host, accept_new_host_key=opts.accept_new_host_key) as t:
        deployed, plans = "", []
        if not opts.no_deploy:
            deployed = _deploy_on(t, host, repo_root, opts, progress, plans)
        lay = layout_for(host, t)
        if opts.no_deploy and not opts.dry_run:
            _require_deployed(t, host, lay, kind)
        if opts.dry_run:
            plan = plan_run(kind, host, lay, make_run_id(git, kind), repo_root, opts)
            _print_plan(plan, log)
            return Outcome(host.name, kind, "dry run: nothing changed", details={"plans": plans + [plan.to_dict()]})
        lock = RemoteLock(t, purpose=f"{kind} run", wait_s=opts.lock_wait_s, log=log, step=kind,
                          hold_s=(host.timeouts.test if kind == "test" else host.timeouts.bench) + 600)
        lock.acquire()
        try:
            run_id = _new_run_dir(t, lay, git, kind)
            plan = plan_run(kind, host, lay, run_id, repo_root, opts)
            runner = plan.step("runner")
            request = runner_request(plan, run_id, git, host, lay, opts,
                                     lock={"path": lock.path, "token": lock.token})
            write_remote_json(t, f"{lay.run(run_id)}/request.json", request)
            env = {**runner.env, provenance.GIT_ENV: json.dumps(git)}
            progress.status(host.name, f"{kind} {run_id}")
            log(f"{kind}: run {run_id} in {lay.run(run_id)}")
            # The runner always runs in its own session on the host and holds the lock itself:
            # it survives this client, and a run is never left going without the lock. Attached,
            # this client follows its output (live progress) and stops it on Ctrl-C.
            interrupt = opts.interrupt or Interrupt()
            if interrupt.stop.is_set():
                raise Interrupted("stopped before the run started (Ctrl-C)", host=host.name, step=kind)
            runner_log = f"{lay.runs}/{run_id}.runner.log"
            try:
                pid = t.spawn_detached(runner.argv, cwd=runner.cwd, env=env, log_path=runner_log)
            except KdtError as e:
                # Nothing ran: the folder goes, or fetch-results would wait on it for ever (unless
                # the link is gone too: the start's error is the one to report).
                try:
                    t.run(f"rm -rf -- {shlex.quote(lay.run(run_id))}", timeout=host.timeouts.connect)
                except KdtError:
                    pass
                raise e.with_context(host=host.name, step=kind)
            lock.handoff(pid)
            if opts.detach:
                return Outcome(host.name, kind, f"started {run_id} detached (pid {pid}); "
                               + _follow_hint(host, lay, run_id), run_ids=[run_id], details={"pid": pid})
            left = _follow(t, host, lay, run_id, pid, runner.timeout, progress, interrupt, lock)
            if left:
                return Outcome(host.name, kind, f"left {run_id} running (pid {pid}); " + _follow_hint(host, lay, run_id),
                               run_ids=[run_id], details={"pid": pid})
        finally:
            lock.release()
        manifest = read_remote_json(t, f"{lay.run(run_id)}/manifest.json")
    if manifest is None:
        err = TestsFailed("the runner ended without a manifest", host=host.name, step=kind,
                          hint=f"see {lay.runs}/{run_id}.runner.log and {lay.run(run_id)}/logs on the host")
        return Outcome(host.name, kind, f"{run_id}: incomplete", err, [run_id])
    summary = f"{run_id}: {manifest.get('summary')}"
    err = None
    if manifest.get("state") == "interrupted":
        err = Interrupted(f"interrupted: run {run_id} stopped (its process group killed, its manifest "
                          "says interrupted, the lock released)", host=host.name, step=kind,
                          hint=f"its logs: `invoke fetch-results --run {run_id} --no-commit`")
    elif not manifest.get("ok"):
        failed = [n for n, s in manifest["status"].items() if s.get("status") == "failed"]
        timed_out = [n for n in failed if "timed out" in (manifest["status"][n].get("reason") or "")]
        cls = StepTimeout if timed_out else TestsFailed  # a step past its timeout is exit 3, like any
        err = cls(f"{run_id}: {', '.join(failed)} failed: {manifest.get('summary')}",
                  host=host.name, step=kind,
                  hint=(f"give it longer with --timeout {kind}=SECONDS, or set timeouts.{kind} in "
                        f"hosts/{host.name}.local.yaml (git-ignored); " if timed_out else "")
                  + f"logs in {lay.run(run_id)}/logs; `invoke fetch-results --run {run_id}` brings them home")
    return Outcome(host.name, kind, summary, err, [run_id],
                   {"deploy": deployed, "status": manifest.get("status")})


class Interrupt:
    """Ctrl-C on the client, shared by the hosts' threads: `stop` (stop the remote runs and mark
    them interrupted) or `detach` (leave them running and stop waiting). tasks.py sets them."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.detach = threading.Event()


FOLLOW_POLL_S = 0.5
STOP_WAIT_S = 30.0      # for the runner to kill its step and write the manifest after TERM
_FOLLOW_SEP = "--kdt-follow--"


def _follow_hint(host: Host, lay: Layout, run_id: str) -> str:
    where = "" if host.transport == "local" else f"on {host.name}: "
    return (f"follow it with `tail -f {lay.runs}/{run_id}.runner.log` ({where}its status is "
            f"{lay.run(run_id)}/status.json); `invoke fetch-results --host {host.name} --run {run_id}` "
            "once it is complete")


def _follow(t: Transport, host: Host, lay: Layout, run_id: str, pid: int, timeout: float | None,
            progress: Progress, interrupt: Interrupt, lock: RemoteLock) -> bool:
    """Pass the runner's new output lines on as they come (`progress: ...` lines update the
    host's status cell), until its manifest is final and it has exited. On interrupt.stop: TERM
    the runner (it kills its step's group, writes an interrupted manifest, releases the lock),
    then KILL its group if it lingers and release the lock ourselves. True when left running
    (interrupt.detach). StepTimeout past `timeout`."""
    log = progress.logger(host.name)
    q = shlex.quote
    runner_log, manifest = f"{lay.runs}/{run_id}.runner.log", f"{lay.run(run_id)}/manifest.json"
    offset, t0, stop_sent, killed = 0, time.monotonic(), None, False
    while True:
        r = t.run(f"tail -c +{offset + 1} {q(runner_log)} 2>/dev/null | head -c 1048576; echo; echo {_FOLLOW_SEP}; "
                  f"test -f {q(manifest)} && echo final; kill -0 {int(pid)} 2>/dev/null && echo alive; exit 0",
                  timeout=host.timeouts.connect)
        data, _, state = r.stdout.rpartition("\n" + _FOLLOW_SEP + "\n")
        data = data[:-1] if data.endswith("\n") else data  # the `echo` after tail
        done = data.rfind("\n")
        if done >= 0:
            for line in data[:done].split("\n"):
                if line.startswith("progress: "):
                    progress.status(host.name, line[len("progress: "):])
                else:
                    log(f"  {line}")
            offset += len(data[:done + 1].encode())
        final, alive = "final" in state.split(), "alive" in state.split()
        if final and not alive:
            return False
        if not alive:  # gone without a manifest: killed (OOM, KILL) before it could write one
            return False
        if interrupt.detach.is_set() and stop_sent is None:
            return True
        if interrupt.stop.is_set() and stop_sent is None:
            log(f"stopping run {run_id}: TERM to the runner (pid {pid}); it kills its step's process group")
            t.run(f"kill -TERM {int(pid)} 2>/dev/null; exit 0", timeout=host.timeouts.connect)
            stop_sent = time.monotonic()
        if stop_sent is not None and not killed and time.monotonic() - stop_sent > STOP_WAIT_S:
            log(f"run {run_id}: the runner did not finish {STOP_WAIT_S:g} s after TERM: KILL to its group")
            t.run(f"kill -KILL -- -{int(pid)} 2>/dev/null; exit 0", timeout=host.timeouts.connect)
            lock.handed_off, lock.held = False, True  # its owner.json still carries our token
            killed = True
        if timeout is not None and stop_sent is None and time.monotonic() - t0 > timeout:
            t.run(f"kill -TERM {int(pid)} 2>/dev/null; sleep 10; kill -KILL -- -{int(pid)} 2>/dev/null; exit 0",
                  timeout=host.timeouts.connect + 15)
            lock.handed_off, lock.held = False, True
            raise StepTimeout(f"run {run_id} ran past {timeout:g} s; the runner's process group was killed",
                              host=host.name, hint=f"give it longer with --timeout {'test' if run_id.endswith('test') else 'bench'}"
                              f"=SECONDS, or timeouts in hosts/{host.name}.local.yaml")
        time.sleep(FOLLOW_POLL_S)


def test_remote(host: Host, repo_root: Path, opts: Options, progress: Progress) -> Outcome:
    return _run("test", host, repo_root, opts, progress)


def bench(host: Host, repo_root: Path, opts: Options, progress: Progress) -> Outcome:
    return _run("bench", host, repo_root, opts, progress)




# ---- several hosts --------------------------------------------------------------------------------

Task = Callable[[Host, Path, Options, Progress], Outcome]


def run_hosts(fn: Task, hosts: list[Host], repo_root: Path, opts: Options, progress: Progress) -> list[Outcome]:
    """fn on every host in parallel threads; one Outcome per host, in the order given."""
    task = fn.__name__.replace("_", "-")
    debug_lock = threading.Lock()

    def one(host: Host) -> Outcome:
        progress.status(host.name, f"{task}: starting")
        try:
            out = fn(host, repo_root, opts, progress)
        except KdtError as e:
            out = Outcome(host.name, task, "", e.with_context(host=host.name, step=task))
        except Exception as e:  # a bug, not a user error: traceback to the debug log
            path = repo_root / DEBUG_LOG
            with debug_lock:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "a") as f:
                    f.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {task} on {host.name}\n")
                    f.write(traceback.format_exc())
            err = KdtError(f"internal error: {type(e).__name__}: {e}", host=host.name, step=task,
                           hint=f"traceback in {path}")
            err.exit_code = INTERNAL_ERROR_EXIT
            out = Outcome(host.name, task, "", err)
        progress.status(host.name, f"{task}: {'ok' if out.error is None else f'failed (exit {out.exit_code})'}")
        return out

    if len(hosts) == 1:
        return [one(hosts[0])]
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        return list(pool.map(one, hosts))


def worst_exit(outcomes: list[Outcome]) -> int:
    return max((o.exit_code for o in outcomes), default=0)


# ---- doctor ----------------------------------------------------------------------------------------

def doctor(host: Host, repo_root: Path, opts: Options, progress: Progress) -> Outcome:
    """Connect and check what the pipeline needs; fails (exit 5) when the host does not match
    its inventory entry (missing python/numpy/g++, nvcc for a GPU arch, GPUs, arch, disk)."""
    from .doctor import check_host
    log = progress.logger(host.name)
    if opts.dry_run:
        log(f"plan: doctor on {host.name} ({host.address}): connect, then probe python and its modules "
            f"(numpy, torch, safetensors, yaml, aiohttp, pytest), g++, nvcc, cmake, rsync, tar, nvidia-smi "
            f"and free disk in {host.remote_dir}")
        return Outcome(host.name, "doctor", "dry run: nothing changed")
    with open_transport(host, accept_new_host_key=opts.accept_new_host_key) as t:
        checks = check_host(t, host)
    for c in checks:
        log(f"{c['status']:>4}  {c['check']}: {c['detail']}")
    failed = [c for c in checks if c["status"] == "FAIL"]
    summary = f"{len(checks) - len(failed)}/{len(checks)} checks ok" + (
        f"; failed: {', '.join(c['check'] for c in failed)}" if failed else "")
    err = None
    if failed:
        err = ConfigError("; ".join(f"{c['check']}: {c['detail']}" for c in failed), host=host.name,
                          step="doctor", hint=f"fix the host or its inventory file {host.source or '(embedded)'}")
    return Outcome(host.name, "doctor", summary, err, details={"checks": checks})
