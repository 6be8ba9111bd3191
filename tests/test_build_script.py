"""cuda/build.sh and cuda/cmake_build.sh refuse a malformed --define before compiling anything
(the value reaches compile lines, so only NAME or NAME=VALUE of plain characters passes); build.sh
compiles through ccache when it is installed, so that clones in other folders share objects."""

from __future__ import annotations

import json
import os
import shutil
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


NEEDS_CCACHE = pytest.mark.skipif(shutil.which("ccache") is None,
                                  reason="ccache is not installed (.ci/run installs it)")


def _tiny_tree(root: Path) -> Path:
    """A cuda/ folder with build.sh, one library source and one test program."""
    cuda = root / "cuda"
    for sub in ("src", "include", "tests"):
        (cuda / sub).mkdir(parents=True)
    (cuda / "build.sh").write_text((ROOT / "cuda" / "build.sh").read_text())
    (cuda / "src" / "one.cpp").write_text(
        'extern "C" __attribute__((visibility("default"))) int one() { return 1; }\n')
    (cuda / "tests" / "test_one.cpp").write_text(
        'extern "C" int one();\nint main() { return one() == 1 ? 0 : 1; }\n')
    return cuda


def _build(root: Path, env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """Builds a tiny tree under root into root/out (--arch cpu); the run and its build_info."""
    cuda = _tiny_tree(root)
    r = subprocess.run(["bash", str(cuda / "build.sh"), "--arch", "cpu", "--out", str(root / "out")],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert subprocess.run([str(root / "out" / "test_one")], timeout=30).returncode == 0
    return r, json.loads((root / "out" / "build_info.json").read_text())


def _ccache_stats(env: dict) -> dict[str, int]:
    out = subprocess.run(["ccache", "--print-stats"], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines() if "\t" in line)
            if v.strip().isdigit()}


@NEEDS_CCACHE
def test_clones_in_other_folders_share_ccache_objects(tmp_path):
    env = {**os.environ, "CCACHE_DIR": str(tmp_path / "cache")}
    env.pop("KDT_CCACHE", None)
    for n, clone in enumerate(("a", "b")):
        r, info = _build(tmp_path / clone, env)
        assert "(through ccache)" in r.stdout
        assert info["launcher"].startswith("ccache")
        stats = _ccache_stats(env)
        hits = stats.get("direct_cache_hit", 0) + stats.get("preprocessed_cache_hit", 0)
        # The first clone compiles both sources; the second finds both in the cache although
        # its paths differ.
        assert (hits, stats.get("cache_miss", 0)) == ((0, 2) if n == 0 else (2, 2)), stats


@NEEDS_CCACHE
def test_kdt_ccache_0_compiles_without_the_cache(tmp_path):
    env = {**os.environ, "CCACHE_DIR": str(tmp_path / "cache"), "KDT_CCACHE": "0"}
    r, info = _build(tmp_path / "a", env)
    assert "through" not in r.stdout
    assert info["launcher"] is None
    assert not (tmp_path / "cache").exists() or not any(
        _ccache_stats(env).get(k, 0) for k in ("cache_miss", "direct_cache_hit"))
