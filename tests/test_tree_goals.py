"""bench/tree_goals.py: the goals are CUDA timings, so on a machine without a GPU (CI) the tool
must refuse with a clear message and exit code 2, never a traceback; --help works anywhere. The
goals themselves run on the GPU host (docs/BENCHMARKS.md)."""

from __future__ import annotations

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
