"""Plans: what a task will do on a host, as data, before anything is done.

Every task first builds a `Plan` (its steps: exact argv, cwd, env, timeouts; the paths it
touches); `--dry-run` prints it, the unit tests assert on it, and the executors in
engine/remote/pipeline.py run it. Nothing here touches a host or the file system beyond
reading the local checkout (which sources exist, the git state).

The remote folder (ARCHITECTURE.md), for remote_dir R and the host's cuda_arch A:

    R/src/                     the synced tree          R/build/A/libkdtree.so, bundles/
    R/cache/                   generated inputs (weights), reused across runs (KDTREE_CACHE)
    R/runs/<run-id>/           one run's files          R/.lock
    R/build/A/deploy.json      the digests of the last good build (cuda/, its command line and
                               the compiler's version) and bundles (engine/reference, engine/kdtr):
                               a deploy skips each step whose inputs did not change

Run id: `<UTC yyyymmddThhmmssZ>-<git short sha (7)>[-dirty]-<kind>`, kind = test | bench.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .inventory import Host
from .overrides import cpu_profile

DEFAULT_BENCH_SUITES = "kernels,tree_build,e2e"
SELFTEST = "selftest"        # the built-in suite of engine/remote/selftest.py
RUNNER_MARGIN_S = 120        # provenance, hashing and the manifest, after the steps
# test-remote's quick profile: the native programs plus these pytest files, which check every
# kernel and the engine against the reference (the rest of `-m native` is serving and benches).
QUICK_NATIVE_TESTS = ("test_native_kdtr.py", "test_native_tree.py", "test_native_tree_accept.py",
                      "test_native_attention.py", "test_native_engine.py")


def quick_profile(host: Host, opts: "Options") -> bool:
    """--quick, --full, else the host's kind: a CPU host runs the quick profile, a GPU host the full one."""
    return opts.quick or (not opts.full and cpu_profile(host))


@dataclass(frozen=True)
class Options:
    """Every task flag; each task reads the ones it has."""
    dry_run: bool = False
    as_json: bool = False
    accept_new_host_key: bool = False
    no_deploy: bool = False       # test-remote / bench: skip the deploy first
    no_build: bool = False        # deploy only syncs
    suite: str | None = None      # test-remote: native | selftest; bench: suites for python -m bench
    quick: bool = False           # test-remote / bench: the quick profile (the default on a CPU host)
    full: bool = False            # test-remote / bench: the full profile (the default on a GPU host)
    detach: bool = False
    run: str | None = None        # fetch-results: None (new ones) | latest | all | a run id
    no_commit: bool = False
    allow_dirty: bool = False
    max_run_bytes: int = 512 * 1024 * 1024  # fetch-results: cap on one run's files (trust.py)
    lock_wait_s: float = 600.0
    url: str | None = None        # bench: the service suite measures this server (python -m bench --url)
    interrupt: object = field(default=None, compare=False, repr=False)  # pipeline.Interrupt (Ctrl-C)


@dataclass(frozen=True)
class Layout:
    remote_dir: str
    arch: str

    @property
    def src(self) -> str:
        return f"{self.remote_dir}/src"

    @property
    def build(self) -> str:
        return f"{self.remote_dir}/build/{self.arch.replace(',', '+')}"

    @property
    def bundles(self) -> str:
        return f"{self.build}/bundles"

    @property
    def lib(self) -> str:
        return f"{self.build}/libkdtree.so"

    @property
    def runs(self) -> str:
        return f"{self.remote_dir}/runs"

    def run(self, run_id: str) -> str:
        return f"{self.runs}/{run_id}"

    @property
    def cache(self) -> str:
        """Inputs the suites generate and reuse (the tiny model's weights: bench/weights.py)."""
        return f"{self.remote_dir}/cache"


@dataclass
class Step:
    name: str
    what: str                               # one line for people
    argv: list[str] | None = None           # None: done by the client (sync, lock)
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    junit: str | None = None                # relative to the run folder; required when set
    skip_codes: dict[str, str] = field(default_factory=dict)
    skipped: str | None = None              # why this step will not run


@dataclass
class Plan:
    task: str
    host: str
    address: str
    steps: list[Step]
    paths: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def step(self, name: str) -> Step:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"plan {self.task} on {self.host} has no step {name!r}: "
                       f"{[s.name for s in self.steps]}")

    def render(self) -> list[str]:
        out = [f"plan: {self.task} on {self.host} ({self.address})"]
        out += [f"  {k}: {v}" for k, v in self.paths.items()]
        for i, s in enumerate(self.steps, 1):
            out.append(f"  {i}. {s.name}: {s.what}" + (f"  [skipped: {s.skipped}]" if s.skipped else ""))
            if s.argv and not s.skipped:
                env = " ".join(f"{k}={v}" for k, v in s.env.items())
                out.append(f"       $ {'cd ' + s.cwd + ' && ' if s.cwd else ''}{env + ' ' if env else ''}"
                           f"{' '.join(s.argv)}" + (f"   (timeout {s.timeout:g} s)" if s.timeout else ""))
        out += [f"  note: {n}" for n in self.notes]
        return out

    def to_dict(self) -> dict:
        return asdict(self)


# ---- run ids and the source digest -------------------------------------------------------------

def make_run_id(git: dict, kind: str, now: dt.datetime | None = None) -> str:
    now = now or dt.datetime.now(dt.timezone.utc)
    sha = (git.get("sha") or "nogit")[:7]
    return f"{now:%Y%m%dT%H%M%SZ}-{sha}{'-dirty' if git.get('dirty') else ''}-{kind}"


# What each deploy step reads: a change anywhere else (docs/, results, tests, the orchestration
# itself) never rebuilds. The build also depends on its command line and the compiler version.
BUILD_INPUTS = ("cuda/",)
BUNDLE_INPUTS = ("engine/reference/", "engine/kdtr/")


def source_digest(repo_root: Path, files: list[str], build_argv: list[str],
                  prefixes: tuple[str, ...] | None = None, toolchain: str = "") -> str:
    """sha256 over the path and bytes of each synced file under `prefixes` (all files when None),
    the step's command line and the toolchain's version text: equal digests mean the last good
    output of that step on the host is still current."""
    h = hashlib.sha256(json.dumps(build_argv).encode() + b"\0" + toolchain.encode() + b"\0")
    for rel in sorted(files):
        if prefixes is not None and not rel.startswith(prefixes):
            continue
        p = repo_root / rel
        h.update(rel.encode() + b"\0")
        if p.is_file():
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


# ---- plans ---------------------------------------------------------------------------------------

def python_env(lay: Layout) -> dict[str, str]:
    """The environment of every Python command run from the synced tree on a host: `lay.src`
    on PYTHONPATH (the synced source is the package; it is never installed), and no bytecode
    written (a `__pycache__` inside src/ would show up as changes to the next sync), and
    KDTREE_CACHE in the tool's own folder (generated inputs such as weights stay inside
    remote_dir and out of run folders). Used by the plans here and by engine/remote/serve.py."""
    return {"PYTHONPATH": lay.src, "PYTHONDONTWRITEBYTECODE": "1", "KDTREE_CACHE": lay.cache}


def plan_deploy(host: Host, lay: Layout, repo_root: Path, opts: Options, n_files: int | None = None) -> Plan:
    build_argv = ["bash", f"{lay.src}/cuda/build.sh", "--arch", host.cuda_arch, "--out", lay.build]
    steps = [
        Step("lock", f"hold {lay.remote_dir}/.lock (wait up to {opts.lock_wait_s:g} s)"),
        Step("sync", f"sync {n_files if n_files is not None else 'the'} files of `git ls-files -co "
                     f"--exclude-standard` into {lay.src}/ (rsync, else a tar of changed files)",
             timeout=host.timeouts.sync),
        Step("build", f"build libkdtree.so for {host.cuda_arch} into {lay.build} (skipped when "
                      "cuda/, the build line and the compiler match deploy.json's digest)",
             argv=build_argv, cwd=lay.remote_dir, timeout=host.timeouts.build),
        Step("bundles", f"generate the KDTR test bundles into {lay.bundles} (skipped when "
                        "engine/reference and engine/kdtr did not change)",
             argv=[host.python, "-m", "engine.kdtr", "generate", "--out", lay.bundles],
             cwd=lay.src, env=python_env(lay), timeout=host.timeouts.build),
        Step("unlock", f"release {lay.remote_dir}/.lock"),
    ]
    if opts.no_build:
        steps[2].skipped = steps[3].skipped = "--no-build"
    elif not (repo_root / "engine" / "kdtr" / "__main__.py").is_file():
        steps[3].skipped = "engine/kdtr/ (the bundle generator) is not in the source yet"
    return Plan("deploy", host.name, host.address, steps,
                paths={"remote_dir": lay.remote_dir, "src": lay.src, "build": lay.build})


def runner_steps_test(host: Host, lay: Layout, run_dir: str, repo_root: Path, opts: Options) -> list[Step]:
    env = {**python_env(lay), "KDTREE_LIB": lay.lib}
    if (opts.suite or "native") == SELFTEST:
        return [Step("selftest", "the built-in pipeline selftest (engine/remote/selftest.py)",
                     argv=[host.python, "-m", "engine.remote.selftest", "test", "--junit",
                           f"{run_dir}/selftest-junit.xml"],
                     cwd=lay.src, env=env, timeout=host.timeouts.test, junit="selftest-junit.xml")]
    if opts.suite not in (None, "native"):
        raise ValueError(f"test suite {opts.suite!r}")  # tasks.py checks it first (UsageError)
    native = Step("native-tests", "the native test programs (cuda/run_tests.sh), JUnit XML",
                  argv=["bash", f"{lay.src}/cuda/run_tests.sh", "--build", lay.build, "--bundles",
                        lay.bundles, "--junit", f"{run_dir}/native-junit.xml"],
                  cwd=lay.src, env=env, timeout=host.timeouts.test, junit="native-junit.xml")
    if not (repo_root / "cuda" / "run_tests.sh").is_file():
        native.skipped = "cuda/run_tests.sh is not in the source yet"
    if quick_profile(host, opts):
        what = "pytest -m 'native and not slow' on the kernel and engine tests (quick profile)"
        select = ["native and not slow"] + [f"{lay.src}/tests/{f}" for f in QUICK_NATIVE_TESTS
                                            if (repo_root / "tests" / f).is_file()]
    else:
        what, select = "pytest -m native", ["native", f"{lay.src}/tests"]
    pytest = Step("pytest-native", f"{what} against the host's libkdtree.so, JUnit XML",
                  argv=[host.python, "-m", "pytest", "-m", select[0], "-q", "-p", "no:cacheprovider",
                        *select[1:], "--junitxml", f"{run_dir}/pytest-junit.xml"],
                  cwd=lay.src, env=env, timeout=host.timeouts.test, junit="pytest-junit.xml",
                  skip_codes={"5": "pytest selected no native tests"})
    return [native, pytest]


def runner_steps_bench(host: Host, lay: Layout, run_dir: str, opts: Options) -> list[Step]:
    env = {**python_env(lay), "KDTREE_LIB": lay.lib}
    suite = opts.suite or DEFAULT_BENCH_SUITES
    if suite == SELFTEST:
        argv = [host.python, "-m", "engine.remote.selftest", "bench", "--out", run_dir]
    else:
        argv = [host.python, "-m", "bench", "--suite", suite, "--out", run_dir]
    quick = quick_profile(host, opts)
    if quick:
        argv.append("--quick")
    if opts.url and suite != SELFTEST:  # the service suite measures a running server (serving area)
        argv += ["--url", opts.url]
    return [Step("bench", f"benchmark suites {suite}{' (quick profile)' if quick else ' (full profile)'}",
                 argv=argv, cwd=lay.src, env=env, timeout=host.timeouts.bench)]


def plan_run(kind: str, host: Host, lay: Layout, run_id: str, repo_root: Path, opts: Options) -> Plan:
    """The test or bench run: the runner, its steps, the run folder."""
    run_dir = lay.run(run_id)
    steps = (runner_steps_test(host, lay, run_dir, repo_root, opts) if kind == "test"
             else runner_steps_bench(host, lay, run_dir, opts))
    runner = Step("runner", f"run the steps below in {run_dir} and finalize manifest.json"
                            + (" (detached: survives the connection)" if opts.detach else ""),
                  argv=[host.python, "-m", "engine.remote.runner", run_dir], cwd=lay.src,
                  env=python_env(lay),
                  timeout=sum(s.timeout or 0 for s in steps if not s.skipped) + RUNNER_MARGIN_S)
    return Plan(kind, host.name, host.address,
                [Step("lock", f"hold {lay.remote_dir}/.lock"), runner, *steps],
                paths={"run": run_dir, "library": lay.lib})


def runner_request(plan: Plan, run_id: str, git: dict, host: Host, lay: Layout, opts: Options,
                   lock: dict | None) -> dict:
    """request.json for engine/remote/runner.py: the plan's host-side steps, not skipped ones."""
    steps = [s for s in plan.steps if s.name not in ("lock", "runner")]
    return {
        "schema": 1, "run_id": run_id, "kind": plan.task,
        "host": {"name": host.name, "address": host.address, "source": str(host.source or "embedded")},
        "git": git, "build_dir": lay.build, "arch": host.cuda_arch,
        "options": {"suite": opts.suite, "quick": quick_profile(host, opts), "detach": opts.detach},
        "steps": [{"name": s.name, "argv": s.argv, "cwd": s.cwd, "env": s.env, "timeout": s.timeout,
                   "junit": s.junit, "skip_codes": s.skip_codes} for s in steps if not s.skipped],
        "skipped": {s.name: s.skipped for s in steps if s.skipped},
        "lock": lock,
    }
