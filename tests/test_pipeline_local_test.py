"""`invoke test`'s pytest workers (tasks.pytest_workers): how many, when none, and a bad value
refused before anything is built."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tasks_mod():
    spec = importlib.util.spec_from_file_location("kdt_tasks_under_test", REPO / "tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def with_xdist(monkeypatch, tasks_mod):
    """pytest_workers sees pytest-xdist installed, whether or not it is here."""
    real = importlib.util.find_spec
    monkeypatch.setattr(tasks_mod.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "xdist" else real(name, *a))
    return tasks_mod


@pytest.mark.parametrize("cpus, expect", [(1, []), (2, ["-n", "2"]), (3, ["-n", "3"]),
                                          (64, ["-n", "4"]), (None, [])])
def test_default_is_one_worker_per_core_at_most_four(with_xdist, cpus, expect):
    args, line = with_xdist.pytest_workers(0, "", cpus)
    assert args == expect
    assert line.startswith(f"pytest workers: {expect[1] if expect else 1}")


def test_an_explicit_count_wins_over_the_cores(with_xdist):
    assert with_xdist.pytest_workers(3, "", 64)[0] == ["-n", "3"]
    assert with_xdist.pytest_workers(6, "", 2)[0] == ["-n", "6"]
    args, line = with_xdist.pytest_workers(1, "", 64)
    assert args == [] and "serial" in line


@pytest.mark.parametrize("pytest_args", ["-n 8", "-n8", "--numprocesses=3", "--numprocesses 2",
                                         "tests/test_x.py -p no:xdist -x"])
def test_pytest_args_that_choose_their_own_workers_are_left_alone(with_xdist, pytest_args):
    args, line = with_xdist.pytest_workers(0, pytest_args, 16)
    assert args == [] and "--pytest-args" in line


def test_other_pytest_args_keep_the_workers(with_xdist):
    assert with_xdist.pytest_workers(0, "tests/test_x.py -x --no-header -k 'not slow'", 2)[0] == \
        ["-n", "2"]


def test_without_xdist_the_suite_runs_serially_and_says_why(monkeypatch, tasks_mod):
    real = importlib.util.find_spec
    monkeypatch.setattr(tasks_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "xdist" else real(name, *a))
    args, line = tasks_mod.pytest_workers(0, "", 8)
    assert args == []
    assert "pytest-xdist is not installed" in line and "not 4" in line


def test_a_negative_count_is_refused(tasks_mod):
    with pytest.raises(ValueError, match="--workers must be >= 0.*got -2"):
        tasks_mod.pytest_workers(-2, "", 2)


def test_the_task_refuses_a_negative_count_before_building():
    r = subprocess.run([sys.executable, "-m", "invoke", "test", "--workers", "-1"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: local: test: --workers must be >= 0" in r.stderr
    assert "cuda/build.sh" not in r.stdout  # nothing ran before the refusal
