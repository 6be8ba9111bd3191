"""bench harness (bench/__init__.py, bench/__main__.py) with fake suites: files written, schema,
provenance and build blocks, failing and missing suites isolated, exit codes."""

from __future__ import annotations

import json
import sys
import types

import pytest

import bench
from bench import __main__ as cli


def _suite(name, run):
    mod = types.ModuleType(f"bench.{name}")
    mod.NAME = name
    mod.run = run
    return mod


class FakeLib:
    path = "/x/build/cpu/libkdtree.so"
    build_info = {"arch": "cpu", "cuda": False, "commands": ["g++ -O3 -c a.cpp -o a.o"]}


def _ok_run(ctx):
    return {"params": {"quick": ctx.quick}, "results": [
        {"bench": "b", "backend": "cpu", "case": {"n": 1}, "validation": {"ok": True},
         "samples": [1e-6, 2e-6, 3e-6], "summary": bench.timing.summarize([1e-6, 2e-6, 3e-6])}],
        "table": "a  b\n-  -\n"}


@pytest.fixture
def fakes(monkeypatch):
    """kernels: ok; tree_build: raises; pipeline: invalid record; e2e: not importable."""
    import bench.timing  # noqa: F401

    def boom(ctx):
        raise ValueError("deliberate failure in a fake suite")

    def invalid(ctx):
        return {"params": {}, "results": [{"bench": "x", "backend": "cpu", "case": {},
                                           "validation": {"ok": False, "error": "differs at [3]"},
                                           "samples": []}], "table": "t\n"}

    monkeypatch.setitem(sys.modules, "bench.kernels", _suite("kernels", _ok_run))
    monkeypatch.setitem(sys.modules, "bench.tree_build", _suite("tree_build", boom))
    monkeypatch.setitem(sys.modules, "bench.pipeline", _suite("pipeline", invalid))
    monkeypatch.setitem(sys.modules, "bench.e2e", None)  # import raises ModuleNotFoundError
    prov = types.ModuleType("engine.remote.provenance")
    prov.collect = lambda repo_root, build_dir=None: {"git": {"sha": "abc"}, "build_dir": str(build_dir)}
    monkeypatch.setitem(sys.modules, "engine.remote.provenance", prov)
    import engine.remote

    monkeypatch.setattr(engine.remote, "provenance", prov, raising=False)


def test_suites_run_in_isolation_and_write_json(tmp_path, fakes):
    ctx = bench.Context(out_dir=tmp_path, quick=True, library=FakeLib())
    out = bench.run_suites(["kernels", "tree_build", "pipeline", "e2e"], ctx, log=open("/dev/null", "w"))
    assert [o.status for o in out] == ["ok", "failed", "invalid", "failed"]
    doc = json.loads((tmp_path / "kernels.json").read_text())
    assert doc["schema"] == bench.SCHEMA and doc["suite"] == "kernels" and doc["status"] == "ok"
    assert doc["params"] == {"quick": True}
    assert doc["results"][0]["samples"] == [1e-6, 2e-6, 3e-6]
    assert doc["provenance"]["git"]["sha"] == "abc"
    assert doc["provenance"]["build_dir"] == "/x/build/cpu"
    assert doc["build"]["library"] == FakeLib.path
    assert doc["build"]["commands"] == FakeLib.build_info["commands"]
    assert "ceilings" not in doc  # the fake never asked for them
    assert (tmp_path / "kernels.txt").read_text() == "a  b\n-  -\n"
    failed = json.loads((tmp_path / "tree_build.json").read_text())
    assert "deliberate failure" in failed["error"] and "Traceback" in failed["traceback"]
    assert "FAILED" in (tmp_path / "tree_build.txt").read_text()
    inv = json.loads((tmp_path / "pipeline.json").read_text())
    assert "differs at [3]" in inv["error"]
    missing = json.loads((tmp_path / "e2e.json").read_text())
    assert missing["status"] == "failed" and "e2e" in missing["error"]


def test_ceilings_are_measured_once_and_recorded(tmp_path, monkeypatch, fakes):
    calls = []
    from bench import ceilings

    monkeypatch.setattr(ceilings, "measure", lambda d, quick: calls.append(d) or {"copy": {"value": 1.0}})

    def uses(ctx):
        ctx.ceilings("cpu")
        ctx.ceilings("cpu")
        return _ok_run(ctx)

    monkeypatch.setitem(sys.modules, "bench.kernels", _suite("kernels", uses))
    monkeypatch.setitem(sys.modules, "bench.service", _suite("service", uses))
    ctx = bench.Context(out_dir=tmp_path, library=FakeLib())
    bench.run_suites(["kernels", "service"], ctx, log=open("/dev/null", "w"))
    assert calls == ["cpu"]
    for name in ("kernels", "service"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["ceilings"] == {"cpu": {"copy": {"value": 1.0}}}


def test_bad_suite_output_is_a_failure(tmp_path, monkeypatch, fakes):
    monkeypatch.setitem(sys.modules, "bench.kernels", _suite("kernels", lambda ctx: {"params": {}}))
    out = bench.run_suites(["kernels"], bench.Context(out_dir=tmp_path), log=open("/dev/null", "w"))
    assert out[0].status == "failed" and "results" in out[0].error


def test_cli_exit_codes(tmp_path, fakes, monkeypatch, capsys):
    monkeypatch.setattr(bench, "load_library", lambda: (FakeLib(), None))
    assert cli.main(["--suite", "kernels", "--out", str(tmp_path), "--device", "cpu"]) == 0
    assert cli.main(["--suite", "kernels,tree_build", "--out", str(tmp_path), "--device", "cpu"]) == 1
    assert "deliberate failure" in capsys.readouterr().err
    assert cli.main(["--suite", "kernels,pipeline", "--out", str(tmp_path), "--device", "cpu"]) == 1
    assert cli.main(["--suite", "nope", "--out", str(tmp_path)]) == 5
    assert "unknown suite 'nope'" in capsys.readouterr().err
    assert cli.main(["--suite", "kernels", "--out", str(tmp_path), "--device", "tpu"]) == 5
    assert cli.main(["--out", str(tmp_path)]) == 5  # --suite missing


def test_device_cuda_without_gpu_is_usage_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: --device cuda is valid here")
    with pytest.raises(bench.UsageError, match="no CUDA device"):
        bench.resolve_devices("cuda")
    assert bench.resolve_devices("all") == ["cpu"]


def test_format_table_aligns():
    t = bench.format_table(["name", "us"], [["a", 1.5], ["long name", 1234.5], ["c", None]])
    lines = t.splitlines()
    assert lines[0].startswith("name") and len({len(l) for l in lines[:2]}) == 1
    assert lines[3].endswith("1234") and lines[4].endswith("-")
