"""Invoke tasks: thin wrappers over engine/remote/ (docs/PIPELINE.md is the user guide).

    invoke deploy test-remote bench fetch-results          # the main job, on hosts/local.yaml
    invoke bench --host ct200,h200 --quick --detach
    invoke fetch-results --host ct200 --run latest

deploy, test-remote, bench, fetch-results and doctor take --host (a name in hosts/, a YAML path,
or a comma list; default local), --dry-run (print the plan, change nothing), --json (a
machine-readable summary on stdout, errors included) and --accept-new-host-key; serve takes
--host and --accept-new-host-key. Exit codes: 0 ok, 1 tests failed, 2 regression,
3 host/SSH/transfer, 4 build failed, 5 bad usage or configuration (Invoke's own usage errors
too), 70 an internal error (traceback in .kdtree/debug.log), 130 interrupted (Ctrl-C stopped
the remote run). Errors are one line per host on stderr.
"""

from __future__ import annotations

import functools
import importlib.util
import json as jsonlib
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from invoke import Argument, Exit, Task, task

REPO = Path(__file__).resolve().parent
HOSTS_DIR = REPO / "hosts"
INTERNAL_ERROR_EXIT = 70
HOST_HELP = {
    "host": "host name in hosts/, a YAML path, or a comma list (default: local)",
    "dry_run": "print the plan and change nothing",
    "json": "print a JSON summary on stdout",
    "accept_new_host_key": "trust an unknown SSH host key once and record it in known_hosts",
}


def _fail(line: str, code: int) -> None:
    print(line, file=sys.stderr)
    raise Exit(code=code)


def _guarded(fn):
    """User errors: one line + their exit code. Anything else: traceback to the debug log."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from engine.remote.errors import KdtError
        try:
            return fn(*args, **kwargs)
        except Exit:
            raise
        except KdtError as e:
            _json_error(fn.__name__, kwargs, str(e), e.exit_code)
            _fail(str(e), e.exit_code)
        except Exception as e:
            log = REPO / ".kdtree" / "debug.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                f.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {fn.__name__}\n")
                f.write(traceback.format_exc())
            line = f"error: internal: {type(e).__name__}: {e} (traceback in {log})"
            _json_error(fn.__name__, kwargs, line, INTERNAL_ERROR_EXIT)
            _fail(line, INTERNAL_ERROR_EXIT)
    return wrapper


def _wants_json(kwargs: dict | None = None) -> bool:
    return bool((kwargs or {}).get("json")) or "--json" in sys.argv[1:]


def _json_error(task_name: str, kwargs: dict | None, line: str, code: int) -> None:
    """With --json, an error before any host reported (a config or usage error) is still JSON on
    stdout: {"task", "exit_code", "error", "hosts": []}; the line also goes to stderr."""
    if _wants_json(kwargs):
        print(jsonlib.dumps({"task": task_name.replace("_", "-"), "exit_code": code, "error": line,
                             "hosts": []}, indent=2), flush=True)


def _usage_errors_exit_5() -> None:
    """Invoke exits 1 on its own usage errors (an unknown task or flag, a missing value); the
    contract is 5 (ARCHITECTURE.md). Its parser's ParseError becomes Exit(5) with one line."""
    from invoke.exceptions import ParseError
    from invoke.parser import Parser
    if getattr(Parser.parse_argv, "_kdt_usage", False):
        return
    original = Parser.parse_argv

    def parse_argv(self, argv):
        try:
            result = original(self, argv)
        except (ParseError, ValueError) as e:  # ValueError: a flag's value failed its cast (int)
            line = f"error: usage: {e} (see `invoke --list` and `invoke <task> --help`)"
            _json_error("usage", None, line, 5)
            raise Exit(message=line, code=5) from None
        _check_chain(result)
        return result
    parse_argv._kdt_usage = True
    Parser.parse_argv = parse_argv


def _check_chain(contexts) -> None:
    """Every task's flags of the command line checked before the first task runs, so that in
    `invoke deploy bench --suite nosuch` nothing touches a host (exit 5)."""
    from engine.remote.errors import KdtError
    from engine.remote import overrides
    for ctx in contexts:
        if not getattr(ctx, "name", None):
            continue
        v = {name: a.value for name, a in ctx.args.items()}
        try:
            if ctx.name == "bench":
                import bench as bench_pkg
                overrides.validate_bench_suites(v.get("suite"), bench_pkg.SUITES)
            if ctx.name == "test-remote":
                overrides.validate_test_suite(v.get("suite"))
            if ctx.name in ("bench", "test-remote"):
                overrides.validate_profile(bool(v.get("quick")), bool(v.get("full")))
            if ctx.name == "fetch-results":
                overrides.validate_run(v.get("run"))
            if v.get("timeout"):
                overrides.parse_timeouts(v["timeout"])
        except KdtError as e:
            _json_error(ctx.name, None, str(e), e.exit_code)
            raise Exit(message=str(e), code=e.exit_code) from None




_usage_errors_exit_5()


def _remote(name: str, host: str | None, as_json: bool, **flags) -> None:
    """Resolve the hosts, run engine.remote.pipeline.<name> on each in parallel, report, exit."""
    from engine.remote import pipeline, results
    from engine.remote.chain import parse_chain
    from engine.remote.inventory import resolve_hosts
    from engine.remote.overrides import apply_overrides, parse_timeouts
    from engine.remote.plan import Options
    from engine.remote.progress import Progress

    # Flags shared by the chain (`invoke deploy test-remote --host h200`): engine/remote/chain.py.
    chain = parse_chain(sys.argv)
    host = host or chain.host
    as_json = as_json or chain.json
    flags["dry_run"] = flags.get("dry_run", False) or chain.dry_run
    flags["accept_new_host_key"] = flags.get("accept_new_host_key", False) or chain.accept_new_host_key
    timeouts = parse_timeouts(flags.pop("timeout", None))
    hosts = apply_overrides(resolve_hosts(host, HOSTS_DIR), HOSTS_DIR, timeouts)
    opts = Options(as_json=as_json, interrupt=pipeline.Interrupt(), **flags)
    fn = getattr(results, name) if name == "fetch_results" else getattr(pipeline, name)
    with Progress([h.name for h in hosts], live=False if as_json else None) as progress:
        outcomes = _interruptible(lambda: pipeline.run_hosts(fn, hosts, REPO, opts, progress), opts.interrupt,
                                  progress)
    task_name = name.replace("_", "-")
    for o in outcomes:
        if o.error is None:
            print(f"{o.host}: {task_name}: ok: {o.summary}", file=sys.stderr if as_json else sys.stdout)
        else:
            print(str(o.error), file=sys.stderr)
    if as_json:
        print(jsonlib.dumps({"task": task_name, "exit_code": pipeline.worst_exit(outcomes),
                             "hosts": [o.to_dict() for o in outcomes]}, indent=2))
    code = pipeline.worst_exit(outcomes)
    if code:
        raise Exit(code=code)


def _interruptible(work, interrupt, progress):
    """Run `work` in a thread; Ctrl-C here asks once, on a terminal, "stop the remote run? [y/N]"
    (y: stop it, N: leave it running and stop waiting; without a terminal: stop). The hosts'
    threads then stop their remote steps' process groups (engine/remote/pipeline.py _follow)."""
    import signal
    import threading
    box: dict = {}
    done = threading.Event()  # not Thread.join: a KeyboardInterrupt inside join() can leave
                              # is_alive() False while the thread still runs (CPython gh-90882)

    def target():
        try:
            box["out"] = work()
        except BaseException as e:  # re-raised in this thread
            box["err"] = e
        finally:
            done.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    threading.Thread(target=target, name="kdt-pipeline", daemon=True).start()
    asked = False
    while not done.is_set():
        try:
            done.wait(0.2)
        except KeyboardInterrupt:
            if asked:
                print("interrupt: already handling Ctrl-C; waiting for the host(s) to stop", file=sys.stderr)
                continue
            asked = True
            if sys.stdin.isatty() and sys.stderr.isatty():
                answer = progress.ask("\nstop the remote run? [y/N] ").lower()
                (interrupt.stop if answer in ("y", "yes") else interrupt.detach).set()
            else:
                interrupt.stop.set()
    if "err" in box:
        raise box["err"]
    return box["out"]


LOCK_HELP = {"lock_wait": "seconds to wait for <remote_dir>/.lock held by someone else (600)",
             "timeout": "STEP=SECONDS for this run only (connect, sync, build, test, bench); repeat or comma-list "
                        "(e.g. --timeout bench=7200); hosts/<name>.local.yaml keeps such settings for this machine"}
PROFILE_HELP = {"quick": "the quick profile (the default on a CPU host: cuda_arch cpu)",
                "full": "the full profile (the default on a GPU host)"}


@task(auto_shortflags=False, iterable=["timeout"], help=HOST_HELP | LOCK_HELP | {"no_build": "sync only, do not build"})
@_guarded
def deploy(c, host=None, dry_run=False, json=False, accept_new_host_key=False, no_build=False, lock_wait=600,
           timeout=None):
    """Sync the source to the host(s) and build libkdtree.so there (skipped when cuda/ did not change)."""
    _remote("deploy", host, json, dry_run=dry_run, accept_new_host_key=accept_new_host_key, no_build=no_build,
            lock_wait_s=_seconds(lock_wait, "--lock-wait"), timeout=timeout)


def _seconds(value, flag: str) -> float:
    from engine.remote.errors import UsageError
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = -1.0
    if not v >= 0:
        raise UsageError(f"{flag} {value!r}: expected a number of seconds >= 0", step="command line")
    return v


@task(auto_shortflags=False, iterable=["timeout"], help=HOST_HELP | LOCK_HELP | PROFILE_HELP | {
    "no_deploy": "run against what is already deployed", "no_build": "deploy syncs only",
    "suite": "native (default: cuda/run_tests.sh + pytest -m native; on a CPU host only the kernel and "
             "engine tests) or selftest (the pipeline's own check)",
    "detach": "start the run in its own session on the host, print the run id, return"})
@_guarded
def test_remote(c, host=None, dry_run=False, json=False, accept_new_host_key=False, no_deploy=False,
                no_build=False, suite=None, lock_wait=600, quick=False, full=False, detach=False, timeout=None):
    """Deploy, then run the native tests and pytest -m native on the host(s); exit 1 on failures."""
    from engine.remote.overrides import validate_profile, validate_test_suite
    validate_test_suite(suite)
    validate_profile(quick, full)
    _remote("test_remote", host, json, dry_run=dry_run, accept_new_host_key=accept_new_host_key,
            no_deploy=no_deploy, no_build=no_build, suite=suite, lock_wait_s=_seconds(lock_wait, "--lock-wait"),
            quick=quick, full=full, detach=detach, timeout=timeout)


@task(auto_shortflags=False, iterable=["timeout"], help=HOST_HELP | LOCK_HELP | PROFILE_HELP | {
    "suite": "comma list for python -m bench (default kernels,tree_build,e2e), all, or selftest",
    "detach": "start the run in its own session on the host, print the run id, return",
    "no_deploy": "run against what is already deployed", "no_build": "deploy syncs only",
    "url": "service suite: measure the server already running at URL (as seen on the host)"})
@_guarded
def bench(c, host=None, dry_run=False, json=False, accept_new_host_key=False, suite=None, quick=False,
          full=False, detach=False, no_deploy=False, no_build=False, lock_wait=600, url=None, timeout=None):
    """Deploy, then run the benchmarks on the host(s) into a run folder (quick grid on a CPU host)."""
    import bench as bench_pkg
    from engine.remote.overrides import validate_bench_suites, validate_profile
    validate_bench_suites(suite, bench_pkg.SUITES)
    validate_profile(quick, full)
    _remote("bench", host, json, dry_run=dry_run, accept_new_host_key=accept_new_host_key, suite=suite,
            quick=quick, full=full, detach=detach, no_deploy=no_deploy, no_build=no_build,
            lock_wait_s=_seconds(lock_wait, "--lock-wait"), url=url, timeout=timeout)


# ---- serving (engine/remote/serve.py; docs/SERVING.md) ---------------------------------------------

@task(auto_shortflags=False, help={
    "host": "one host name in hosts/ or a YAML path (default: local)", "mode": "ar or ddtree (default ddtree)",
    "budget": "DDTree node budget (63)", "port": "port on the host, bound to 127.0.0.1 there (8000)",
    "weights": "weights folder on the host (default: the tiny model in <remote_dir>/weights/tiny)",
    "accept_new_host_key": HOST_HELP["accept_new_host_key"]})
@_guarded
def serve(c, host=None, mode="ddtree", budget=63, port=8000, weights=None, accept_new_host_key=False):
    """Start our OpenAI-compatible server on a deployed host, wait for /health, print its URL."""
    from engine.remote.inventory import resolve_hosts
    from engine.remote.overrides import apply_overrides
    from engine.remote.serve import start_server
    hosts = apply_overrides(resolve_hosts(host, HOSTS_DIR), HOSTS_DIR)
    if len(hosts) != 1:
        _fail(f"error: serve: --host {host!r}: give exactly one host", 5)
    info = start_server(hosts[0], mode=mode, budget=int(budget), port=int(port), weights=weights,
                        accept_new_host_key=accept_new_host_key)
    print("\n".join(info.lines()))


@task(auto_shortflags=False, help=HOST_HELP | {
    "run": "a run id, latest, or all (default: every complete run not yet in results/)",
    "no_commit": "download and verify only", "allow_dirty": "commit results of a dirty engine tree (recorded)",
    "max_run_bytes": "refuse a run whose files add up to more bytes than this (536870912 = 512 MiB)"})
@_guarded
def fetch_results(c, host=None, dry_run=False, json=False, accept_new_host_key=False, run=None,
                  no_commit=False, allow_dirty=False, max_run_bytes=512 * 1024 * 1024):
    """Bring complete runs home verified into results/<host>/, regenerate the report, commit."""
    try:
        cap = int(max_run_bytes)
    except (TypeError, ValueError):
        cap = 0
    if cap <= 0:
        _fail(f"error: fetch-results: --max-run-bytes {max_run_bytes!r}: expected a positive integer", 5)
    from engine.remote.overrides import validate_run
    validate_run(run)
    _remote("fetch_results", host, json, dry_run=dry_run, accept_new_host_key=accept_new_host_key, run=run,
            no_commit=no_commit, allow_dirty=allow_dirty, max_run_bytes=cap)


@task(auto_shortflags=False, help=HOST_HELP)
@_guarded
def doctor(c, host=None, dry_run=False, json=False, accept_new_host_key=False):
    """Check connectivity, host key, python/numpy, nvcc/cmake/rsync, GPUs vs cuda_arch, free disk."""
    _remote("doctor", host, json, dry_run=dry_run, accept_new_host_key=accept_new_host_key)


@task(auto_shortflags=False)
@_guarded
def hosts(c):
    """List the inventory (hosts/*.yaml) with each host's transport, address, arch and GPUs."""
    from engine.remote.errors import KdtError
    from engine.remote.inventory import load_host
    from engine.remote.overrides import with_overlay
    files = sorted(p for p in HOSTS_DIR.glob("*.yaml") if not p.name.endswith(".local.yaml"))  # overlays
    bad = 0
    for path in files or [Path("local")]:
        try:
            h = with_overlay(load_host(str(path) if path.suffix else "local", HOSTS_DIR), HOSTS_DIR)
        except KdtError as e:
            print(str(e), file=sys.stderr)
            bad += 1
            continue
        gpus = f"{h.gpus.count} x {h.gpus.model}" if h.gpus.count else "no GPUs"
        print(f"{h.name:<12} {h.transport:<6} {h.address:<32} {h.cuda_arch:<14} {gpus:<36} {h.remote_dir}")
    if bad:
        raise Exit(code=5)


def _sh(argv: list[str], code: int, env: dict | None = None) -> None:
    print("$ " + " ".join(argv), flush=True)
    r = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})})
    if r.returncode != 0:
        _fail(f"error: local: {argv[1] if argv[0] in ('bash', sys.executable) else argv[0]}: "
              f"exited {r.returncode}", code)


@task(auto_shortflags=False, help={"arch": "cpu, sm_90, sm_90a, sm_120, a comma list (sm_90a,sm_90,sm_120) or native (default cpu)"})
@_guarded
def build(c, arch="cpu"):
    """Build libkdtree.so and the native programs locally into build/<arch>."""
    _sh(["bash", "cuda/build.sh", "--arch", arch, "--out", f"build/{arch.replace(',', '+')}"], 4)


def pytest_workers(requested: int, pytest_args: str, cpus: int | None) -> tuple[list[str], str]:
    """pytest-xdist arguments for `invoke test` and a line saying what they are: `requested`
    workers (0: one per core, at most 4), or none when that is 1, when pytest_args picks its own
    (-n, --numprocesses, -p no:xdist) or when pytest-xdist is not installed. ValueError when
    requested < 0."""
    if requested < 0:
        raise ValueError(f"--workers must be >= 0 (0: one per core, at most 4), got {requested}")
    args = pytest_args.split()
    if any(a in ("-n", "--numprocesses", "no:xdist") or a.startswith(("-n", "--numprocesses=")) for a in args):
        return [], "pytest workers: as --pytest-args says"
    n = requested or max(1, min(cpus or 1, 4))
    if n == 1:
        return [], "pytest workers: 1 (serial)"
    if importlib.util.find_spec("xdist") is None:
        return [], f"pytest workers: 1 (pytest-xdist is not installed, so not {n}: pip install -e \".[dev]\")"
    return ["-n", str(n)], f"pytest workers: {n} (pytest-xdist; --workers 1 runs serially)"


@task(auto_shortflags=False, help={"pytest_args": "extra pytest arguments, e.g. \"tests/test_x.py -x\"",
                                   "workers": "pytest processes (pytest-xdist; 0, the default: one per core, at most 4; 1: serial)"})
@_guarded
def test(c, pytest_args="", workers=0):
    """The whole test suite: import layers, cpu build, CUDA compile check, bundles, native tests, pytest."""
    try:
        xdist, workers_line = pytest_workers(workers, pytest_args, os.cpu_count())
    except ValueError as e:
        _fail(f"error: local: test: {e}", 2)
    # engine/'s layers (pyproject.toml [tool.importlinter]): an upward import names both modules.
    _sh([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()", "--no-cache"], 1)
    _sh(["bash", "cuda/build.sh", "--arch", "cpu", "--out", "build/cpu"], 4)
    if shutil.which("nvcc"):
        _sh(["bash", "cuda/build.sh", "--arch", "sm_90a,sm_90,sm_120", "--out", "build/fat"], 4)
    else:
        print("nvcc not found: skipping the sm_90a,sm_90,sm_120 compile check")
    env = {"KDTREE_LIB": str(REPO / "build/cpu/libkdtree.so")}
    if (REPO / "engine/kdtr/__main__.py").is_file():
        _sh([sys.executable, "-m", "engine.kdtr", "generate", "--out", "build/cpu/bundles"], 1, env)
    native_failed = False
    if (REPO / "cuda/run_tests.sh").is_file():  # a failure here still lets pytest run: exit 1 at the end
        argv = ["bash", "cuda/run_tests.sh", "--build", "build/cpu", "--bundles", "build/cpu/bundles",
                "--junit", "build/cpu/native-junit.xml"]
        print("$ " + " ".join(argv), flush=True)
        native_failed = subprocess.run(argv, cwd=REPO, env={**os.environ, **env}).returncode != 0
    argv = [sys.executable, "-m", "pytest", "-q", *xdist, *pytest_args.split()]
    print(workers_line, flush=True)
    print("$ " + " ".join(argv), flush=True)
    p = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    last = ""
    for line in p.stdout:
        sys.stdout.write(line)
        if line.strip():
            last = line.strip()
    code = p.wait()
    print(f"pytest: {last}")
    if native_failed:
        print("error: local: cuda/run_tests.sh reported failures (see its output above)", file=sys.stderr)
    if code or native_failed:
        raise Exit(code=1)


@task(auto_shortflags=False, help={"host": "only this host's report (default: every host in results/)"})
@_guarded
def report(c, host=None):
    """Regenerate docs/BENCHMARKS_<host>.md from results/<host>/."""
    from engine.remote.report import write_report
    results = REPO / "results"
    names = [host] if host else sorted(p.name for p in results.iterdir() if p.is_dir()) if results.is_dir() else []
    if not names:
        _fail("error: report: no results/<host>/ folders yet (run invoke fetch-results first)", 5)
    for name in names:
        if not (results / name).is_dir():
            _fail(f"error: report: results/{name} does not exist", 5)
        written = write_report(results / name, REPO / "docs")
        print(f"{name}: report written: {written}")


class _AgainstArgument(Argument):
    """--against, which also marks RUN_B as given (as "", meaning "not given"), so that
    `compare RUN --against latest` parses although RUN_B is positional: Invoke's positional
    arguments are all required, and this is how one of them becomes optional."""
    run_b: Argument

    def set_value(self, value, cast: bool = True) -> None:
        super().set_value(value, cast)
        if self.run_b.value is None:
            self.run_b.set_value("", cast=False)


class _CompareTask(Task):
    def get_arguments(self, ignore_unknown_help=None):
        args = super().get_arguments(ignore_unknown_help)
        by_name = {a.name: a for a in args}
        against = by_name["against"]
        against.__class__ = _AgainstArgument  # same fields, one more behaviour
        against.run_b = by_name["run_b"]
        return args


@task(klass=_CompareTask, positional=["run_a", "run_b"], auto_shortflags=False,
      help={"run_a": "baseline run (id, path or latest)", "run_b": "candidate run (id, path or latest), compared against RUN_A",
            "against": "latest: compare RUN_A against the newest other bench run of its host (then no RUN_B)",
            "threshold": "slowdown fraction that counts as a regression (0.05)"})
@_guarded
def compare(c, run_a, run_b=None, against=None, threshold=0.05):
    """Compare runs like with like: `compare RUN_A RUN_B` (either may be latest) or `compare RUN
    --against latest`; exit 2 on a regression beyond the allowed change, 5 when nothing compares."""
    from engine.remote.compare import compare_runs, resolve_pair
    run_b = run_b or None  # "" = left out (see _AgainstArgument)
    if against not in (None, "latest") or (run_b is None) == (against is None):
        _fail("error: compare: give RUN_B (compare RUN_A RUN_B) or --against latest, not both", 5)
    try:  # `latest` may stand for either run; --against latest: RUN_A is the candidate
        a, b = resolve_pair(REPO / "results", "latest", run_a) if against else resolve_pair(REPO / "results", run_a, run_b)
    except ValueError as e:
        _fail(f"error: compare: {e}", 5)
    try:
        cmp = compare_runs(a, b, float(threshold))
    except ValueError as e:  # not bench runs, a bad threshold: the user's input
        _fail(f"error: compare: {e}", 5)
    print(cmp.format(), end="")
    if cmp.exit_code:
        raise Exit(code=cmp.exit_code)
