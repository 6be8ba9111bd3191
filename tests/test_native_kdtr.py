"""The native test programs on bundles that Python writes now (fresh seed): the C++ KDTR reader
must read every bundle engine.kdtr writes (F32, BF16, every kernel), and the tree programs must
match the reference's expected outputs. Runs cuda/run_tests.sh as CI and the hosts do."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from native_helpers import native  # noqa: F401

pytestmark = pytest.mark.native

REPO = Path(__file__).resolve().parents[1]


def test_run_tests_on_fresh_bundles(tmp_path):
    lib = native().library()
    build = lib.path.parent
    programs = sorted(p.name for p in build.glob("test_*") if os.access(p, os.X_OK))
    for needed in ("test_kdtr_reader", "test_tree_build", "test_tree_accept"):
        if needed not in programs:
            pytest.skip(f"{build} has no {needed} (KDTREE_LIB points at a library built "
                        "without the test programs)")
    seed = secrets.randbits(31)
    gen = subprocess.run([sys.executable, "-m", "engine.kdtr", "generate", "--out",
                          str(tmp_path / "bundles"), "--quick", "--seed", str(seed)],
                         cwd=REPO, capture_output=True, text=True)
    assert gen.returncode == 0, f"seed={seed}: bundle generation failed:\n{gen.stderr[-2000:]}"
    junit = tmp_path / "junit.xml"
    r = subprocess.run(["bash", str(REPO / "cuda" / "run_tests.sh"), "--build", str(build),
                        "--bundles", str(tmp_path / "bundles"), "--junit", str(junit)],
                       capture_output=True, text=True)
    root = ET.parse(junit).getroot()
    cases = {(s.get("name"), c.get("name")): c for s in root for c in s}
    # Every tree and reader program must have read the bundles (not just its built-in cases).
    for prog, prefix in (("test_tree_build", "bundle/"), ("test_tree_accept", "bundle/"),
                         ("test_kdtr_reader", "bundle/verify_attention/")):
        assert any(p == prog and n.startswith(prefix) for p, n in cases), \
            f"seed={seed}: {prog} ran no {prefix}* case"
    mine = {k: c for k, c in cases.items() if k[0] in ("test_tree_build", "test_tree_accept",
                                                         "test_kdtr_reader")}
    failed = [f"{p} {n}: {c.find('failure').get('message')}" for (p, n), c in mine.items()
              if c.find("failure") is not None]
    assert not failed, f"seed={seed}:\n" + "\n".join(failed) + f"\n{r.stdout[-2000:]}"
