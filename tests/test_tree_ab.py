"""bench/tree_ab.py: two builds of the library side by side on the same requests (on the CPU
backend here; the CUDA run needs a GPU). No timed assertions: only that both libraries are
validated and timed on every case, and that bad arguments and wrong trees are reported."""

from __future__ import annotations

import shutil

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
    a, _ = two_libs
    for args, says in (([str(a), str(tmp_path / "nope.so")], "no library at"),
                       ([str(a), str(a)], "are one library")):
        with pytest.raises(SystemExit) as e:
            tree_ab.main(args + ["--device", "cpu"])
        assert e.value.code == 2 and says in capsys.readouterr().err
