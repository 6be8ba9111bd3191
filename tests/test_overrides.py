"""Per-run overrides (engine/remote/overrides.py) and the checks made before a host is touched:
`--timeout STEP=SECONDS`, the git-ignored hosts/<name>.local.yaml overlay, suite / run id /
flag validation (exit 5, also for Invoke's own usage errors, JSON on stdout with --json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.remote.errors import ConfigError, UsageError
from engine.remote.inventory import load_host
from engine.remote.overrides import (apply_overrides, parse_timeouts, validate_bench_suites, validate_run,
                                     validate_test_suite)

REPO = Path(__file__).resolve().parents[1]


def test_parse_timeouts_repeatable_and_comma_lists():
    assert parse_timeouts(["bench=7200", "build=60,test=90.5"]) == {"bench": 7200.0, "build": 60.0, "test": 90.5}
    assert parse_timeouts(None) == {} and parse_timeouts("sync=5") == {"sync": 5.0}
    for bad in ("bench", "bench=0", "bench=-3", "bench=x", "nosuch=5"):
        with pytest.raises(UsageError, match="--timeout"):
            parse_timeouts([bad])


def test_local_overlay_and_timeout_flag_win_over_the_tracked_file(tmp_path):
    (tmp_path / "box.yaml").write_text("transport: local\nremote_dir: /srv/kd/box\ncuda_arch: cpu\n"
                                       "timeouts: {bench: 3600, build: 100}\nenv: {A: '1'}\n")
    (tmp_path / "box.local.yaml").write_text("timeouts: {bench: 9000}\nenv: {B: '2'}\n")
    (h,) = apply_overrides([load_host("box", tmp_path)], tmp_path)
    assert (h.timeouts.bench, h.timeouts.build, dict(h.env)) == (9000.0, 100.0, {"A": "1", "B": "2"})
    (h,) = apply_overrides([load_host("box", tmp_path)], tmp_path, parse_timeouts("bench=42"))
    assert h.timeouts.bench == 42.0 and h.source == tmp_path / "box.yaml"
    # the embedded default `local` takes an overlay too
    (tmp_path / "local.local.yaml").write_text("timeouts: {test: 7}\n")
    (h,) = apply_overrides([load_host("local", tmp_path)], tmp_path)
    assert h.timeouts.test == 7.0 and h.cuda_arch == "cpu"
    (tmp_path / "box.local.yaml").write_text("timeouts: {bench: -1}\n")
    with pytest.raises(ConfigError, match="box.local.yaml"):
        apply_overrides([load_host("box", tmp_path)], tmp_path)


def test_overlays_are_git_ignored():
    r = subprocess.run(["git", "-C", str(REPO), "check-ignore", "hosts/local.local.yaml"], capture_output=True)
    assert r.returncode == 0


def test_validation():
    validate_bench_suites(None, ("kernels", "e2e"))
    validate_bench_suites("kernels,e2e", ("kernels", "e2e"))
    validate_bench_suites("selftest", ("kernels",))
    for bad in ("nosuch", "kernels,", "kernels,nosuch"):
        with pytest.raises(UsageError, match="--suite"):
            validate_bench_suites(bad, ("kernels", "e2e"))
    validate_test_suite("native")
    with pytest.raises(UsageError):
        validate_test_suite("kernels")
    for ok in (None, "latest", "all", "20261129T133011Z-4ae82b6-test", "20261129T133011Z-4ae82b6-dirty-bench"):
        validate_run(ok)
    with pytest.raises(UsageError):
        validate_run("../etc")


def _invoke(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def host_file(tmp_path):
    p = tmp_path / "box.yaml"
    p.write_text(f"transport: local\nremote_dir: {tmp_path / 'remote'}\ncuda_arch: cpu\npython: {sys.executable}\n")
    return p


def test_bad_suite_in_a_chain_exits_5_before_anything_touches_the_host(tmp_path, host_file):
    r = _invoke(tmp_path, "deploy", "bench", "--suite", "nosuch", "--host", str(host_file))
    assert r.returncode == 5, r.stderr
    assert "unknown suite 'nosuch'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "remote").exists()


@pytest.mark.parametrize("args", [("nosuchtask",), ("bench", "--nosuchflag"), ("bench", "--quick", "--full"),
                                  ("fetch-results", "--run", "bogus"), ("bench", "--timeout", "bench=x"),
                                  ("deploy", "--lock-wait", "abc"), ("bench", "--suite")])
def test_usage_errors_exit_5_with_one_line(tmp_path, host_file, args):
    r = _invoke(tmp_path, *args, "--host", str(host_file))
    assert r.returncode == 5, (r.returncode, r.stderr)
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "remote").exists()


def test_json_config_error_is_json_on_stdout(tmp_path):
    r = _invoke(tmp_path, "deploy", "--host", str(tmp_path / "missing.yaml"), "--json")
    assert r.returncode == 5
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 5 and "missing.yaml" in doc["error"] and doc["hosts"] == []
