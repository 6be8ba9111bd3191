"""bench/tree_profile.py: parsing the tree builds' per-phase cycle probes (the GPU run itself
needs a KDT_PAR_PROFILE build on CUDA and is not run here)."""

from __future__ import annotations

import subprocess

import pytest

from bench import tree_profile

# Two calls of a two-block launch, interleaved as device printf may interleave them, with
# unrelated output between; block 1's second build takes an extra refinement.
TEXT = """\
BLK 0 900 5
PROF 0 1 100
PROF 1 1 110
PROF 0 101 200
PROF 0 99 300
PROF 1 101 210
PROF 1 99 320
some other line
PROF 0 1 120
PROF 0 101 220
PROF 1 1 100
PROF 1 101 250
PROF 1 5 4000
PROF 1 201 260
PROF 0 99 310
PROF 1 99 330
PROF 2 1 50
"""


def test_parse_keeps_each_blocks_last_complete_build():
    blocks = tree_profile.parse(TEXT)
    assert [b.index for b in blocks] == [0, 1]  # block 2 never finished a build: left out
    assert blocks[0].phases == [(1, 120), (101, 220), (99, 310)]
    assert blocks[1].phases == [(1, 100), (101, 250), (5, 4000), (201, 260), (99, 330)]
    assert [b.total for b in blocks] == [650, 4940]


def test_summary_names_the_phases_of_the_median_and_slowest_blocks():
    out = tree_profile.summary(tree_profile.parse(TEXT))
    assert "2 block(s); cycles per block: min 650, median 4940 (block 1), max 4940" in out
    # With two blocks the median is the slower one, shown once.
    assert out.count("block 1: 4940 cycles") == 1
    assert "level 1: write" in out and "histogram pass" in out and "visibility rows" in out


def test_phase_names():
    assert tree_profile.phase_name(3) == "first threshold"
    assert tree_profile.phase_name(71) == "queue: its runs placed"
    assert tree_profile.phase_name(107) == "level 7: runs"
    assert tree_profile.phase_name(215) == "level 15: write"
    assert tree_profile.phase_name(332) == "level 32: bound check"
    assert tree_profile.phase_name(100) == "probe 100"
    assert tree_profile.phase_name(57) == "probe 57"


def test_no_probe_lines_is_a_clear_error():
    with pytest.raises(ValueError, match="KDT_PAR_PROFILE"):
        tree_profile.parse("BLK 0 1 2\nPROF x y z\nPROF 0 1\n")


@pytest.mark.parametrize("args", [["--budget", "0"], ["--budget", "1025"], ["--bs", "0"]])
def test_bad_arguments_are_refused(args, capsys):
    with pytest.raises(SystemExit) as e:
        tree_profile.main(args)
    assert e.value.code == 2
    assert "--budget must be in 1..1024" in capsys.readouterr().err


def test_warp_build_lines_end_at_probe_69():
    # The warp build prints one request's four phases at once (a warp per request); a request
    # whose lines stop before 69 is incomplete and left out.
    text = ("PROF 3 60 18\nPROF 3 61 2700\nPROF 3 62 5200\nPROF 3 69 960\n"
            "PROF 0 60 20\nPROF 0 61 2800\nPROF 0 62 5300\nPROF 0 69 990\n"
            "PROF 5 60 20\nPROF 5 61 2800\n")
    blocks = tree_profile.parse(text)
    assert [b.index for b in blocks] == [0, 3]
    assert blocks[1].phases == [(60, 18), (61, 2700), (62, 5200), (69, 960)]
    out = tree_profile.summary(blocks)
    assert "warp: pops" in out and "warp: outputs" in out


def test_warp_algo_refuses_budget_1024(capsys):
    with pytest.raises(SystemExit) as e:
        tree_profile.main(["--algo", "warp", "--budget", "1024"])
    assert e.value.code == 2
    assert "--algo warp takes budgets up to 1023" in capsys.readouterr().err


@pytest.mark.parametrize("graph", [False, True])
def test_graph_flag_reaches_the_child_and_the_header(monkeypatch, capsys, graph):
    seen = {}

    def fake_run(cmd, env, **kw):
        seen["cmd"], seen["algo"] = cmd, env["KDT_TREE_BUILD"]
        return subprocess.CompletedProcess(cmd, 0, stdout=TEXT, stderr="")

    monkeypatch.setattr(tree_profile.subprocess, "run", fake_run)
    assert tree_profile.main(["--budget", "63", "--bs", "2"] + (["--graph"] if graph else [])) == 0
    assert ("--graph" in seen["cmd"]) == graph and seen["algo"] == "parallel"
    out = capsys.readouterr().out
    assert ("a CUDA graph replayed" in out) == graph
    assert ("launched one by one" in out) != graph
    assert "2 block(s)" in out
