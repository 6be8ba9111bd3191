"""cuda/build.sh and cuda/cmake_build.sh refuse a malformed --define before compiling anything
(the value reaches compile lines, so only NAME or NAME=VALUE of plain characters passes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["build.sh", "cmake_build.sh"])
@pytest.mark.parametrize("bad", ["", "1X", "X;touch /tmp/y", "X=$(id)", "X Y", "X=a b"])
def test_a_malformed_define_is_refused(tmp_path, script, bad):
    r = subprocess.run(["bash", str(ROOT / "cuda" / script), "--arch", "cpu", "--out",
                        str(tmp_path), "--define", bad], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 5
    assert f"--define: '{bad}' is not NAME or NAME=VALUE" in r.stderr
    assert not any(tmp_path.iterdir())  # nothing built
