"""Plans are data: host facts in, exact commands and paths out (engine/remote/plan.py)."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pytest

from engine.remote.inventory import parse_host
from engine.remote.plan import (DEFAULT_BENCH_SUITES, Layout, Options, make_run_id, plan_deploy,
                                plan_run, runner_request, source_digest)

RD = "/srv/kd/remote"


def host(**fields):
    data = {"transport": "local", "remote_dir": RD, "cuda_arch": "sm_120", "python": "/opt/py/bin/python3"}
    data.update(fields)
    return parse_host("box", data, source=Path("/hosts/box.yaml"))


@pytest.fixture
def repo(tmp_path):
    """A checkout with the files the plans look for."""
    for rel in ("engine/kdtr/__main__.py", "cuda/run_tests.sh", "cuda/build.sh"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("# stub\n")
    return tmp_path


def test_layout_paths():
    lay = Layout(RD, "sm_90,sm_120")
    assert lay.src == f"{RD}/src" and lay.runs == f"{RD}/runs"
    assert lay.build == f"{RD}/build/sm_90+sm_120" and lay.lib == f"{RD}/build/sm_90+sm_120/libkdtree.so"
    assert lay.run("X") == f"{RD}/runs/X" and lay.bundles == f"{lay.build}/bundles"


def test_deploy_plan_exact_commands(repo):
    h = host(timeouts={"build": 77})
    plan = plan_deploy(h, Layout(RD, h.cuda_arch), repo, Options(), n_files=12)
    assert [s.name for s in plan.steps] == ["lock", "sync", "build", "bundles", "unlock"]
    b = plan.step("build")
    assert b.argv == ["bash", f"{RD}/src/cuda/build.sh", "--arch", "sm_120", "--out", f"{RD}/build/sm_120"]
    assert b.cwd == RD and b.timeout == 77 and b.skipped is None
    g = plan.step("bundles")
    assert g.argv == ["/opt/py/bin/python3", "-m", "engine.kdtr", "generate", "--out", f"{RD}/build/sm_120/bundles"]
    assert g.env["PYTHONPATH"] == f"{RD}/src" and g.cwd == f"{RD}/src"
    assert "12 files" in plan.step("sync").what
    text = "\n".join(plan.render())
    assert "bash /srv/kd/remote/src/cuda/build.sh --arch sm_120" in text and "(timeout 77 s)" in text


def test_deploy_plan_no_build_and_missing_generator(repo):
    h = host()
    plan = plan_deploy(h, Layout(RD, h.cuda_arch), repo, Options(no_build=True))
    assert plan.step("build").skipped == "--no-build" and plan.step("bundles").skipped == "--no-build"
    (repo / "engine/kdtr/__main__.py").unlink()
    plan = plan_deploy(h, Layout(RD, h.cuda_arch), repo, Options())
    assert plan.step("build").skipped is None and "engine/kdtr/" in plan.step("bundles").skipped


def test_test_plan_native(repo):
    h = host(timeouts={"test": 50})
    lay = Layout(RD, h.cuda_arch)
    plan = plan_run("test", h, lay, "RID", repo, Options())
    assert [s.name for s in plan.steps] == ["lock", "runner", "native-tests", "pytest-native"]
    run = f"{RD}/runs/RID"
    native, pyt = plan.step("native-tests"), plan.step("pytest-native")
    assert native.argv == ["bash", f"{RD}/src/cuda/run_tests.sh", "--build", f"{RD}/build/sm_120",
                           "--bundles", f"{RD}/build/sm_120/bundles", "--junit", f"{run}/native-junit.xml"]
    assert native.junit == "native-junit.xml" and pyt.junit == "pytest-junit.xml"
    assert pyt.argv[:5] == ["/opt/py/bin/python3", "-m", "pytest", "-m", "native"]
    assert pyt.argv[-2:] == ["--junitxml", f"{run}/pytest-junit.xml"] and pyt.skip_codes == {"5": "pytest selected no native tests"}
    for s in (native, pyt):
        assert s.env["KDTREE_LIB"] == f"{RD}/build/sm_120/libkdtree.so" and s.timeout == 50
    runner = plan.step("runner")
    assert runner.argv == ["/opt/py/bin/python3", "-m", "engine.remote.runner", run]
    assert runner.timeout == 50 + 50 + 120


def test_test_plan_without_run_tests_sh_skips_native(repo):
    (repo / "cuda/run_tests.sh").unlink()
    h = host()
    plan = plan_run("test", h, Layout(RD, h.cuda_arch), "RID", repo, Options())
    assert "run_tests.sh" in plan.step("native-tests").skipped
    req = runner_request(plan, "RID", {"sha": "a" * 40}, h, Layout(RD, h.cuda_arch), Options(), None)
    assert [s["name"] for s in req["steps"]] == ["pytest-native"]
    assert req["skipped"] == {"native-tests": plan.step("native-tests").skipped}


def test_selftest_and_bench_plans(repo):
    h = host()
    lay = Layout(RD, h.cuda_arch)
    t = plan_run("test", h, lay, "R", repo, Options(suite="selftest"))
    assert [s.name for s in t.steps] == ["lock", "runner", "selftest"] and t.step("selftest").junit == "selftest-junit.xml"
    b = plan_run("bench", h, lay, "R", repo, Options())
    assert b.step("bench").argv == ["/opt/py/bin/python3", "-m", "bench", "--suite", DEFAULT_BENCH_SUITES,
                                    "--out", f"{RD}/runs/R"]
    q = plan_run("bench", h, lay, "R", repo, Options(suite="kernels", quick=True))
    assert q.step("bench").argv[-4:] == ["kernels", "--out", f"{RD}/runs/R", "--quick"]
    d = plan_run("bench", h, lay, "R", repo, Options(detach=True))
    assert "detached" in d.step("runner").what


def test_runner_request_carries_git_host_and_lock(repo):
    h = host()
    lay = Layout(RD, h.cuda_arch)
    plan = plan_run("bench", h, lay, "R", repo, Options(quick=True))
    git = {"sha": "b" * 40, "dirty": True}
    req = runner_request(plan, "R", git, h, lay, Options(quick=True), {"path": f"{RD}/.lock", "token": "t"})
    assert req["run_id"] == "R" and req["kind"] == "bench" and req["git"] == git
    assert req["host"]["name"] == "box" and req["build_dir"] == f"{RD}/build/sm_120" and req["arch"] == "sm_120"
    assert req["lock"] == {"path": f"{RD}/.lock", "token": "t"} and req["options"]["quick"] is True
    assert [s["name"] for s in req["steps"]] == ["bench"]


def test_run_id_format():
    now = dt.datetime(2026, 11, 29, 7, 5, 9, tzinfo=dt.timezone.utc)
    assert make_run_id({"sha": "0123456789abcdef", "dirty": False}, "test", now) == "20261129T070509Z-0123456-test"
    assert make_run_id({"sha": "0123456789abcdef", "dirty": True}, "bench", now) == "20261129T070509Z-0123456-dirty-bench"
    assert re.match(r"^\d{8}T\d{6}Z-nogit-test$", make_run_id({"sha": None}, "test"))


def test_source_digest_changes_with_content_and_build_line(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    d1 = source_digest(tmp_path, ["a.txt"], ["bash", "build.sh"])
    assert d1 == source_digest(tmp_path, ["a.txt"], ["bash", "build.sh"])
    assert d1 != source_digest(tmp_path, ["a.txt"], ["bash", "build.sh", "--debug"])
    (tmp_path / "a.txt").write_text("two")
    assert d1 != source_digest(tmp_path, ["a.txt"], ["bash", "build.sh"])


def test_python_env_is_public_and_shared_with_serve(repo):
    """engine/remote/serve.py uses plan.python_env, never a private name of plan.py."""
    import ast

    from engine.remote import plan, serve

    lay = Layout(RD, "sm_90")
    assert plan.python_env(lay) == {"PYTHONPATH": f"{RD}/src", "PYTHONDONTWRITEBYTECODE": "1",
                                    "KDTREE_CACHE": f"{RD}/cache"}
    bundles = next(s for s in plan_deploy(host(), lay, repo, Options()).steps if s.name == "bundles")
    assert bundles.env == plan.python_env(lay)
    tree = ast.parse(Path(serve.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "plan"
                for a in n.names]
    assert "python_env" in imported and not [n for n in imported if n.startswith("_")], imported


def test_build_digest_covers_only_what_the_build_reads(tmp_path):
    """docs/, results, tests and the orchestration never change the build's digest; cuda/, the
    build line and the compiler version do."""
    from engine.remote.plan import BUILD_INPUTS, BUNDLE_INPUTS
    files = ["cuda/src/a.cpp", "docs/X.md", "engine/remote/p.py", "engine/kdtr/c.py"]
    for rel in files:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("one")
    argv = ["bash", "build.sh"]
    b1 = source_digest(tmp_path, files, argv, BUILD_INPUTS, "g++ 13.2")
    k1 = source_digest(tmp_path, files, ["gen"], BUNDLE_INPUTS)
    (tmp_path / "docs/X.md").write_text("two")
    (tmp_path / "engine/remote/p.py").write_text("two")
    assert source_digest(tmp_path, files + ["docs/BENCHMARKS_x.md"], argv, BUILD_INPUTS, "g++ 13.2") == b1
    assert source_digest(tmp_path, files, ["gen"], BUNDLE_INPUTS) == k1
    assert source_digest(tmp_path, files, argv, BUILD_INPUTS, "g++ 14.1") != b1
    (tmp_path / "engine/kdtr/c.py").write_text("two")
    assert source_digest(tmp_path, files, argv, BUILD_INPUTS, "g++ 13.2") == b1
    assert source_digest(tmp_path, files, ["gen"], BUNDLE_INPUTS) != k1
    (tmp_path / "cuda/src/a.cpp").write_text("two")
    assert source_digest(tmp_path, files, argv, BUILD_INPUTS, "g++ 13.2") != b1


def test_cpu_host_gets_the_quick_profile_and_flags_override(repo):
    cpu, gpu = host(cuda_arch="cpu"), host()
    for h, opts, quick in ((cpu, Options(), True), (cpu, Options(full=True), False),
                           (gpu, Options(), False), (gpu, Options(quick=True), True)):
        lay = Layout(RD, h.cuda_arch)
        b = plan_run("bench", h, lay, "R", repo, opts).step("bench")
        assert ("--quick" in b.argv) is quick, (h.cuda_arch, opts, b.argv)
        t = plan_run("test", h, lay, "R", repo, opts).step("pytest-native")
        assert (t.argv[4] == "native and not slow") is quick, t.argv
        assert (f"{RD}/src/tests" in t.argv) is not quick, t.argv
