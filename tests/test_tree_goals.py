"""bench/tree_goals.py: the goals are CUDA timings, so on a machine without a GPU (CI) the tool
must refuse with a clear message and exit code 2, never a traceback; --help works anywhere. The
goals themselves run on the GPU host (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tree_goals


def test_help_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as e:
        tree_goals.main(["--help"])
    assert e.value.code == 0
    assert "usage: python3 -m bench.tree_goals" in capsys.readouterr().out


def test_unknown_arguments_are_named(capsys):
    with pytest.raises(SystemExit) as e:
        tree_goals.main(["--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_without_a_cuda_device_it_refuses_cleanly(capsys, monkeypatch):
    torch = pytest.importorskip("torch", reason="bench.tree_goals needs torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tree_goals.main([]) == 2
    err = capsys.readouterr().err
    assert "torch reports no CUDA device" in err and "run it on the GPU host" in err


def test_a_cpu_only_library_is_refused(capsys, monkeypatch):
    torch = pytest.importorskip("torch", reason="bench.tree_goals needs torch")
    from native_helpers import native

    lib = native().library()
    if lib.has_cuda:
        pytest.skip(f"{lib.path} is a CUDA build: the refusal is for CPU-only builds")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tree_goals.main([]) == 2
    assert "is a CPU-only build: set KDTREE_LIB to a CUDA build" in capsys.readouterr().err


# ---- --run DIR: the goals judged on a fetched run (no GPU, no torch) -------------------------

BUDGETS = (15, 63, 255, 1023)


def _row(bench, backend, bs, budget, us, alone=None, **case):
    row = {"bench": bench, "backend": backend,
           "case": {"bs": bs, "budget": budget, **case}, "summary": {"median": us * 1e-6}}
    if alone is not None:
        row["kernel_alone"] = {"summary": {"median": alone * 1e-6}}
    return row


def _suite_files(tmp_path, gpu, cpu, accept=3.0):
    """A run folder whose kernels and tree_build suites hold gpu[(bs, budget)] (kernel alone, us)
    and cpu[(bs, budget)] (us), plus rows the goals must ignore."""
    kernels = [{"bench": "verify_attention", "backend": "cuda", "case": {"bs": 1, "tree": 16},
                "summary": {"median": 1e-5}}]
    tree = []
    for (bs, b), v in gpu.items():
        kernels.append(_row("tree_build", "cuda", bs, b, 20.0, alone=v, algo="auto"))
        kernels.append(_row("tree_build", "cuda", bs, b, 20.0, alone=0.1, algo="parallel"))
        tree.append(_row("tree_build", "native-cuda", bs, b, 20.0, alone=v))
        tree.append(_row("tree_build", "native-cuda-serial", bs, b, 20.0, alone=0.1))
    for (bs, b), v in cpu.items():
        kernels.append(_row("tree_build", "cpu", bs, b, v, algo="serial"))
        tree.append(_row("tree_build", "native-cpu", bs, b, v))
    kernels.append(_row("tree_accept", "cuda", 64, 255, 15.0, alone=accept, n=256))
    run = tmp_path / "20261204T000000Z-abc1234-bench"
    run.mkdir()
    (run / "kernels.json").write_text(json.dumps({"results": kernels}))
    (run / "tree_build.json").write_text(json.dumps({"results": tree}))
    return run


def _met():
    gpu = {(bs, b): {1: 4.0, 64: 5.0}[bs] + b / 100 for bs in (1, 64) for b in BUDGETS}
    gpu[(64, 63)] = 9.5
    gpu[(64, 1023)] = 55.0
    cpu = {k: v * 2 for k, v in gpu.items()}
    return gpu, cpu


def test_run_with_every_goal_met_passes(tmp_path, capsys):
    gpu, cpu = _met()
    assert tree_goals.main(["--run", str(_suite_files(tmp_path, gpu, cpu))]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert out.count("PASS build bs 64 budget 63 <= 10 us: 9.50 us") == 2  # both suites
    assert "PASS accept bs 64 budget 255 <= 4 us: 3.00 us" in out
    assert "CPU faster at 0 of 8" in out


def test_run_names_each_missed_goal_and_the_cells_behind_it(tmp_path, capsys):
    gpu, cpu = _met()
    gpu[(64, 63)] = 11.73
    cpu[(1, 15)] = 3.0  # the CPU wins one cell
    gpu[(1, 1023)] = 2 * gpu[(64, 1023)]  # bs 1 slower than bs 64 there
    cpu[(1, 1023)] = 1000.0
    assert tree_goals.main(["--run", str(_suite_files(tmp_path, gpu, cpu, accept=4.5))]) == 1
    out = capsys.readouterr().out
    assert "FAIL build bs 64 budget 63 <= 10 us: 11.73 us" in out
    assert "FAIL build CUDA (alone) faster than the CPU backend at every case: CPU faster at 1 " \
           "of 8; bs 1 budget 15: 3.00 vs 4.15 us" in out
    assert "FAIL build bs 1 no slower than bs 64 (+5 %)" in out
    assert "FAIL accept bs 64 budget 255 <= 4 us: 4.50 us" in out
    assert "PASS build bs 64 budget 1023 <= 60 us" in out


def test_the_cpu_is_judged_at_its_fast_state_where_the_record_has_one(tmp_path, capsys):
    # bs 1, budget 15: the CPU's median (8.30 us, the slow state) is slower than CUDA's 4.15 us,
    # but its fast state (3.10 us) is faster: the goal is judged against the fast state.
    gpu, cpu = _met()
    cpu[(1, 15)] = 8.3
    run = _suite_files(tmp_path, gpu, cpu)
    for name, backend in (("kernels", "cpu"), ("tree_build", "native-cpu")):
        f = run / f"{name}.json"
        doc = json.loads(f.read_text())
        for r in doc["results"]:
            if r["backend"] == backend and (r["case"]["bs"], r["case"]["budget"]) == (1, 15):
                r["cpu_states"] = {"fast": 3.1e-6, "slow": 8.4e-6, "calls": 50,
                                   "medians": [3.1e-6, 8.4e-6]}
        f.write_text(json.dumps(doc))
    assert tree_goals.main(["--run", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.count("CPU faster at 1 of 8; bs 1 budget 15: 3.10 vs 4.15 us") == 2


def test_run_without_a_goal_case_fails_it_as_missing(tmp_path, capsys):
    gpu, cpu = _met()
    del gpu[(64, 1023)]
    assert tree_goals.main(["--run", str(_suite_files(tmp_path, gpu, cpu))]) == 1
    assert "FAIL build bs 64 budget 1023 <= 60 us: missing" in capsys.readouterr().out


def _with_spread(run, params):
    f = run / "tree_build.json"
    doc = json.loads(f.read_text())
    doc["params"] = params
    f.write_text(json.dumps(doc))
    return run


def test_the_tree_build_suites_draws_and_floor_are_printed_not_judged(tmp_path, capsys):
    gpu, cpu = _met()
    draws = [9.1, 10.4, 9.8, 10.0, 11.2]
    run = _with_spread(_suite_files(tmp_path, gpu, cpu), {
        "draws": {"bs": 64, "budget": 63, "seeds": [1, 2, 3, 4, 5],
                  "kernel_alone_s": [x * 1e-6 for x in draws], "invalid_seeds": []},
        "graph_floor": {"summary": {"median": 2.25e-6}}})
    assert tree_goals.main(["--run", str(run)]) == 0  # the suite's own case (9.50 us) is judged
    out = capsys.readouterr().out
    assert ("  native-cuda bs 64 budget 63, 5 more draws, kernel alone: min 9.10, median 10.00, "
            "max 11.20 us; 3 of 5 <= 10 us") in out
    assert "  graph floor (a one-element torch fill, kernel alone): 2.25 us" in out
    assert out.count("more draws") == 1  # the tree_build suite's only


def test_invalid_draws_are_named_and_malformed_ones_refused(tmp_path, capsys):
    gpu, cpu = _met()
    run = _with_spread(_suite_files(tmp_path, gpu, cpu), {
        "draws": {"bs": 64, "budget": 63, "seeds": [], "kernel_alone_s": [],
                  "invalid_seeds": [77]}})
    tree_goals.main(["--run", str(run)])
    assert "  native-cuda bs 64 budget 63 draws: none timed (1 INVALID)" in capsys.readouterr().out
    _with_spread(run, {"draws": {"bs": 64, "kernel_alone_s": [1e-5]}})
    assert tree_goals.main(["--run", str(run)]) == 2
    err = capsys.readouterr().err
    assert "params' draws or graph_floor is malformed (KeyError: 'budget')" in err


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "absent", "no such folder"),
    (lambda p: p, "neither kernels.json nor tree_build.json is there"),
    (lambda p: (p / "kernels.json").write_text("{not json") and p,
     "kernels.json: not readable JSON"),
    (lambda p: (p / "tree_build.json").write_text('{"results": {}}') and p,
     "tree_build.json: no 'results' list"),
    (lambda p: (p / "tree_build.json").write_text(
        '{"results": [{"bench": "tree_build", "backend": "native-cpu", "case": {"bs": 1}}]}')
     and p, "tree_build.json: result 0 is malformed (KeyError: 'budget')"),
    (lambda p: (p / "kernels.json").write_text(
        '{"results": [{"bench": "tree_build", "backend": "cuda", "case": 5}]}') and p,
     "kernels.json: result 0 is malformed (AttributeError:"),
])
def test_a_bad_run_is_refused_with_what_is_wrong(tmp_path, capsys, make, message):
    assert tree_goals.main(["--run", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_committed_h200_run_is_read_with_its_real_schema(capsys):
    run = Path(__file__).resolve().parents[1] / "results/h200/20261204T093653Z-6c68048-dirty-bench"
    if not run.is_dir():
        pytest.skip(f"{run} is not in this checkout")
    assert tree_goals.main(["--run", str(run)]) == 1  # two goals are still open there
    out = capsys.readouterr().out
    assert "FAIL build bs 64 budget 63 <= 10 us: 11.73 us" in out  # kernels suite
    assert "FAIL build bs 64 budget 63 <= 10 us: 11.56 us" in out  # tree_build suite
    assert "PASS accept bs 64 budget 255 <= 4 us: 3.38 us" in out
    assert out.count("CPU faster at 1 of 20") == 2


def test_a_committed_runs_draws_and_floor_are_read_with_their_real_schema(capsys):
    run = Path(__file__).resolve().parents[1] / "results/h200/20261205T183702Z-1052ab6-dirty-bench"
    if not run.is_dir():
        pytest.skip(f"{run} is not in this checkout")
    assert tree_goals.main(["--run", str(run)]) == 1  # bs 64 budget 63 and the CPU are open
    out = capsys.readouterr().out
    assert ("  native-cuda bs 64 budget 63, 16 more draws, kernel alone: min 9.87, median 10.73, "
            "max 11.22 us; 2 of 16 <= 10 us") in out
    assert "  graph floor (a one-element torch fill, kernel alone): 1.11 us" in out


def test_the_live_runs_medians_are_judged_like_a_fetched_runs():
    us = {("build", "auto", 64, 63): 9.0, ("build", "parallel", 64, 63): 1.0,
          ("build", "auto", 1, 63): 8.0, ("cpu", 1, 63): 20.0, ("cpu", 64, 63): 99.0,
          ("accept", "parallel", 64, 255): 3.0, ("accept", "walk", 64, 255): 9.0}
    assert tree_goals.judged_times(us) == {
        ("gpu", 64, 63): 9.0, ("gpu", 1, 63): 8.0, ("cpu", 1, 63): 20.0, ("cpu", 64, 63): 99.0,
        ("accept", 64, 255): 3.0}
