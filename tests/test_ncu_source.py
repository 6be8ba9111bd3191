"""bench/ncu_source.py: summing Nsight Compute's per-instruction source page between barriers
(the profile itself needs ncu and a GPU and is not run here)."""

from __future__ import annotations

import pytest

from bench import ncu_source

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed",'
          '"stall_barrier","stall_no_inst","stall_wait","stall_barrier (Not Issued)"')


def page(rows: list[str], name: str = "void k(int)") -> str:
    return f'"Kernel Name","{name}",\n{HEADER}\n' + "\n".join(rows) + "\n"


# Two phases: an exit-free stretch ending at a barrier, then one ending at EXIT; 0x40 never ran.
ROWS = [
    '"0x7f0000000000","LDS R0, [R1]","4","3","8","0","3","1","0"',
    '"0x7f0000000010","BAR.SYNC.DEFER_BLOCKING 0x0","10","10","8","9","0","1","9"',
    '"0x7f0000000020","IADD3 R2, R0, 0x1, RZ","1","1","8","0","0","1","0"',
    '"0x7f0000000030","@P0 BRA 0x7f0000000050","0","0","8","0","0","0","0"',
    '"0x7f0000000040","DADD R4, R2, R6","0","0","0","0","0","0","0"',
    '"0x7f0000000090","EXIT","5","5","1,024","0","5","0","0"',
]


def write(tmp_path, text: str):
    p = tmp_path / "src.csv"
    p.write_text(text)
    return str(p)


def test_load_reads_rows_relative_to_the_first_instruction(tmp_path):
    name, rows = ncu_source.load(write(tmp_path, page(ROWS)))
    assert name == "void k(int)"
    assert [r.address for r in rows] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x90]
    assert rows[5].executed == 1024  # thousands separators
    assert rows[1].reasons == {"barrier": 9.0, "no_inst": 0.0, "wait": 1.0}  # issued columns only


def test_regions_end_at_barriers_and_exits(tmp_path):
    _, rows = ncu_source.load(write(tmp_path, page(ROWS)))
    regs = ncu_source.regions(rows)
    assert [(g.first, g.last) for g in regs] == [(0x0, 0x10), (0x20, 0x90)]
    assert [g.samples for g in regs] == [14.0, 6.0]
    assert [g.ran for g in regs] == [2, 3]  # the DADD never ran
    assert regs[1].executed == 8 + 8 + 0 + 1024
    assert regs[0].reasons() == {"barrier": 9.0, "no_inst": 3.0, "wait": 2.0}


def test_summary_gives_totals_lines_and_each_regions_share(tmp_path):
    out = ncu_source.summary(*ncu_source.load(write(tmp_path, page(ROWS))))
    assert "samples 20; instructions executed 1056; 5 of 6 instructions ran" in out
    # 0x00-0x30 run on the first 128-byte line, 0x90 on the second (0x40 never ran)
    assert "on 2 lines of 128 bytes" in out
    assert "stalls: barrier 45.0%, no_inst 40.0%, wait 15.0%" in out
    assert "     0-    10" in out and "(70.0%)" in out and "barrier:9 no_inst:3 wait:2" in out
    assert "    20-    90" in out and "(30.0%)" in out
    # min_share hides the smaller region
    assert "    20-    90" not in ncu_source.summary(*ncu_source.load(write(tmp_path, page(ROWS))),
                                                  min_share=50)


def test_only_the_first_kernels_page_is_read(tmp_path):
    text = page(ROWS[:2]) + page(ROWS[2:], name="void other()")
    name, rows = ncu_source.load(write(tmp_path, text))
    assert name == "void k(int)" and len(rows) == 2


@pytest.mark.parametrize("text, message", [
    ("Address,Source\n1,2\n3,4\n", "not an ncu source page"),
    ('"Kernel Name","k",\n"Address","Source"\n"0x0","NOP"\n', r"lacks column\(s\) Instructions Executed, Warp Stall"),
    (page(['"0x10","NOP","x","0","1","0","0","0","0"']), ":3: not a number"),
    (page([]), "no instruction rows"),
])
def test_bad_pages_are_clear_errors(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        ncu_source.load(write(tmp_path, text))


def test_main_reports_a_bad_file_without_a_traceback(tmp_path, capsys):
    assert ncu_source.main([str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncu_source: ") and "cannot read" in err


def test_main_prints_the_summary(tmp_path, capsys):
    assert ncu_source.main([write(tmp_path, page(ROWS)), "--min-share", "0"]) == 0
    assert "void k(int)" in capsys.readouterr().out


def test_min_share_out_of_range_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ncu_source.main([write(tmp_path, page(ROWS)), "--min-share", "101"])
    assert e.value.code == 2
    assert "--min-share must be a percentage" in capsys.readouterr().err
