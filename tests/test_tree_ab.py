"""bench/tree_ab.py: two builds of the library (or more) side by side on the same requests (on
the CPU backend here; the CUDA run needs a GPU). No timed assertions: only that every library is
validated and timed on every case, and that bad arguments and wrong trees are reported."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from native_helpers import native

from bench import tree_ab


@pytest.fixture(scope="module")
def two_libs(tmp_path_factory):
    lib = native().library().path
    other = tmp_path_factory.mktemp("libb") / "libkdtree.so"
    shutil.copyfile(lib, other)  # a second file: the loader maps it separately
    return lib, other


def test_parse_cases():
    assert tree_ab.parse_cases("64:1023, 1:15") == [(64, 1023), (1, 15)]
    for bad, says in (("1x15", "'1x15' is not bs:budget"), ("1:2:3", "is not bs:budget"),
                      ("0:15", "bs must be in 1..4096"), ("1:2000", "budget in 1..1024")):
        with pytest.raises(ValueError, match=says):
            tree_ab.parse_cases(bad)


def test_times_both_libraries_on_every_case(two_libs, capsys):
    a, b = two_libs
    rc = tree_ab.main([str(a), str(b), "--device", "cpu", "--cases", "1:15,3:63", "--rounds", "1"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    rows = [line.split() for line in out[1:]]
    assert [r[:4] for r in rows] == [["bs", "1", "B", "15"], ["bs", "3", "B", "63"]]
    for r in rows:  # A us, B us, B / A: positive numbers, the ratio theirs
        ta, tb, ratio = map(float, r[4:7])
        assert ta > 0 and tb > 0 and ratio == pytest.approx(tb / ta, rel=0.01, abs=1e-3)


def test_several_changes_against_one_base(two_libs, tmp_path, capsys):
    a, b = two_libs
    c = tmp_path / "libkdtree.so"
    shutil.copyfile(a, c)
    rc = tree_ab.main([str(a), str(b), str(c), "--device", "cpu", "--cases", "1:15",
                       "--rounds", "1"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0].split()[1:8] == ["A", "us", "B", "us", "C", "us", "B"]
    assert f"C {c}" in out[0]
    r = out[1].split()
    ta, tb, tc, rb, rc_ = map(float, r[4:9])
    assert min(ta, tb, tc) > 0
    assert rb == pytest.approx(tb / ta, rel=0.01, abs=1e-3)
    assert rc_ == pytest.approx(tc / ta, rel=0.01, abs=1e-3)


def test_each_library_leads_a_round_in_turn(two_libs, tmp_path, capsys, monkeypatch):
    """The first timed in a round can measure differently, so the lead rotates: rounds of A B C,
    B C A, C A B (the timer sees which library each call runs)."""
    import bench.native_calls
    import bench.timing

    a, b = two_libs
    c = tmp_path / "libkdtree.so"
    shutil.copyfile(a, c)
    whose, order = {}, []
    real_prepare, real_time = bench.native_calls.prepare_tree_build, bench.timing.time_cpu

    def prepare(lib, *args):
        p = real_prepare(lib, *args)
        whose[p.run] = lib.path
        return p

    def time_cpu(fn, reps):
        order.append(whose[fn])
        return real_time(fn, reps=reps)

    monkeypatch.setattr(bench.native_calls, "prepare_tree_build", prepare)
    monkeypatch.setattr(bench.timing, "time_cpu", time_cpu)
    rc = tree_ab.main([str(a), str(b), str(c), "--device", "cpu", "--cases", "1:3",
                       "--rounds", "4"])
    assert rc == 0, capsys.readouterr().out
    A, B, C = (str(x) for x in (a, b, c))
    assert [str(p) for p in order] == [A, B, C, B, C, A, C, A, B, A, B, C]


def test_a_wrong_tree_fails_the_run_and_is_not_timed(two_libs, capsys, monkeypatch):
    import bench.validate

    monkeypatch.setattr(bench.validate, "check_exact", lambda *a, **k: {"ok": False,
                                                                       "error": "tokens differ"})
    a, b = two_libs
    rc = tree_ab.main([str(a), str(b), "--device", "cpu", "--cases", "1:15", "--rounds", "1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL bs 1 budget 15: wrong tree: A: tokens differ; B: tokens differ" in out


@pytest.mark.parametrize("args, says", [
    (["--cases", "1x15"], "'1x15' is not bs:budget"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--device", "cuda"], "CPU-only build"),
    (["--timing", "call"], "CUDA options"),
    (["--after-torch"], "CUDA options"),
])
def test_bad_arguments_are_named(two_libs, capsys, args, says):
    a, b = two_libs
    if "--device" not in args:
        args = args + ["--device", "cpu"]
    if says == "CPU-only build" and native().library().has_cuda:
        pytest.skip("the test library is a CUDA build: the CPU-only refusal cannot be shown")
    with pytest.raises(SystemExit) as e:
        tree_ab.main([str(a), str(b)] + args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_missing_and_identical_libraries_are_refused(two_libs, tmp_path, capsys):
    a, b = two_libs
    for args, says in (([str(a), str(tmp_path / "nope.so")], "no library at"),
                       ([str(a), str(a)], "are one library"),
                       ([str(a), str(b), str(b)], "are one library")):
        with pytest.raises(SystemExit) as e:
            tree_ab.main(args + ["--device", "cpu"])
        assert e.value.code == 2 and says in capsys.readouterr().err


def _run_folder(path, results):
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernels.json").write_text(json.dumps({"results": results}))
    return path


def test_draw_from_gives_the_suites_own_requests(tmp_path, monkeypatch):
    """The seed a kernels-suite record carries draws again exactly the requests the suite built
    its tree from (captured here from the suite's own call on the CPU backend)."""
    from bench import kernels

    lib = native().library()
    seen = {}
    real = kernels.prepare_tree_build

    def capture(lib_, device, inp, budget):
        seen.setdefault("inp", {k: np.array(v, copy=True) for k, v in inp.items()})
        return real(lib_, device, inp, budget)

    monkeypatch.setattr(kernels, "prepare_tree_build", capture)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    recs = kernels._tree_and_accept(lib, "cpu", 3, 15, np.random.default_rng(seed), seed,
                                    lambda fn: [1e-6])
    assert recs and all(r["validation"]["ok"] for r in recs)
    run = _run_folder(tmp_path / "run", recs)
    seeds = tree_ab.run_seeds(run, "cpu")
    assert seeds == {(3, 15): seed} and tree_ab.run_seeds(run, "cuda") == {}
    again = tree_ab.drawn_inputs(seeds[(3, 15)], 3, 15)
    assert set(again) == set(seen["inp"])
    for k, v in seen["inp"].items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)


def test_draw_from_times_both_libraries_on_the_runs_requests(two_libs, tmp_path, capsys,
                                                             monkeypatch):
    """The rows of the compared device give the seed: the suite draws the CPU's and the CUDA
    backend's requests with seeds of their own (a real run holds both)."""
    a, b = two_libs
    run = _run_folder(tmp_path / "run", [
        _tree_row(2, 15, 7, "cpu"), _tree_row(2, 15, 8, "cuda"),
        {"bench": "verify_attention", "backend": "cpu", "case": {"bs": 2}, "seed": 9}])
    drawn = []
    real = tree_ab.drawn_inputs
    monkeypatch.setattr(tree_ab, "drawn_inputs",
                        lambda seed, bs, budget: drawn.append(seed) or real(seed, bs, budget))
    rc = tree_ab.main([str(a), str(b), "--device", "cpu", "--cases", "2:15", "--rounds", "1",
                       "--draw-from", str(run)])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and out[1].split()[:4] == ["bs", "2", "B", "15"] and drawn == [7]


def _tree_row(bs, budget, seed, backend="cpu"):
    return {"bench": "tree_build", "backend": backend, "case": {"bs": bs, "budget": budget},
            "seed": seed}


@pytest.mark.parametrize("results, args, says", [
    (None, [], "cannot read"),
    ("not json", [], "is not JSON"),
    ({"results": 3}, [], "has no 'results' list"),
    ({"results": [{"bench": "tree_build", "backend": "cpu", "case": {"bs": 1}, "seed": 1}]}, [],
     "result 0 has no usable case and seed"),
    ({"results": [_tree_row(1, 15, -1)]}, [], "seed -1 is not a non-negative integer"),
    ({"results": [_tree_row(1, 15, 1), _tree_row(1, 15, 2)]}, [],
     "cpu bs 1 budget 15 has two seeds (1 and 2)"),
    ({"results": [_tree_row(1, 15, 1)]}, ["--cases", "1:15,4:63"],
     "has no cpu tree case 4:63 (it has 1:15)"),
    ({"results": [_tree_row(1, 15, 1, "cuda")]}, [], "has no cpu tree case 1:15 (it has none)"),
    ({"results": [_tree_row(1, 15, 1)]}, ["--cases", "1:15", "--seed", "3"],
     "--seed and --draw-from both choose the requests"),
])
def test_draw_from_refuses_what_it_cannot_use(two_libs, tmp_path, capsys, results, args, says):
    a, b = two_libs
    run = tmp_path / "run"
    run.mkdir()
    if results is not None:
        (run / "kernels.json").write_text(results if isinstance(results, str)
                                          else json.dumps(results))
    with pytest.raises(SystemExit) as e:
        tree_ab.main([str(a), str(b), "--device", "cpu", "--draw-from", str(run)]
                     + (args or ["--cases", "1:15"]))
    assert e.value.code == 2 and says in capsys.readouterr().err
