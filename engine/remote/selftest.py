"""A tiny built-in suite that exercises the pipeline without the real kernels.

    python3 -m engine.remote.selftest test  --junit FILE
    python3 -m engine.remote.selftest bench --out DIR [--quick]

`invoke test-remote --suite selftest` and `invoke bench --suite selftest` run these on a host
instead of cuda/run_tests.sh + pytest and `python -m bench`: the end-to-end tests use them to
drive every pipeline path in seconds on two CPU cores. They check real things (the host's python
and numpy import, a sha256 round trip, the run folder is writable) and write the same kinds of
files as the real suites: a JUnit XML, and a benchmark JSON with raw samples plus a .txt table.

Knobs, for the tests (set through the inventory's `env`):
  KDTREE_SELFTEST_FAIL=1       one test case fails (the "failing remote test" path)
  KDTREE_SELFTEST_SECONDS=N    the bench sleeps N seconds first (to cut a connection mid-run)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _case_numpy() -> str | None:
    import numpy as np
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    return None if float(a.sum()) == 66.0 else f"numpy sum of arange(12) is {a.sum()}, expected 66"


def _case_sha256() -> str | None:
    got = hashlib.sha256(b"kdtree").hexdigest()
    want = hashlib.new("sha256", b"kdtree").hexdigest()
    return None if got == want else f"sha256 mismatch {got} != {want}"


def _case_forced_failure() -> str | None:
    if os.environ.get("KDTREE_SELFTEST_FAIL") == "1":
        return "KDTREE_SELFTEST_FAIL=1 asks this case to fail"
    return None


CASES = {"numpy_imports": _case_numpy, "sha256_roundtrip": _case_sha256,
         "forced_failure_knob": _case_forced_failure}


def run_tests(junit: Path) -> int:
    suite = ET.Element("testsuite", name="selftest")
    failures = 0
    for name, fn in CASES.items():
        t0 = time.monotonic()
        try:
            problem = fn()
        except Exception as e:  # a crash in a case is that case's failure, reported in the XML
            problem = f"{type(e).__name__}: {e}"
        case = ET.SubElement(suite, "testcase", classname="selftest", name=name,
                             time=f"{time.monotonic() - t0:.6f}")
        if problem:
            failures += 1
            ET.SubElement(case, "failure", message=problem).text = problem
        print(f"selftest {name}: {'FAILED: ' + problem if problem else 'ok'}")
    suite.set("tests", str(len(CASES)))
    suite.set("failures", str(failures))
    junit.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(junit, encoding="utf-8", xml_declaration=True)
    return 1 if failures else 0


def run_bench(out: Path, quick: bool) -> int:
    wait = float(os.environ.get("KDTREE_SELFTEST_SECONDS", "0"))
    n = max(1, int(wait))
    for i in range(1, n + 1):  # a slow "suite" that says where it is, as bench suites do
        time.sleep(wait / n)
        print(f"progress: selftest (1/1) case {i}/{n}, {i * wait / n:.0f} s elapsed, "
              f"~{(n - i) * wait / n:.0f} s left", flush=True)
    reps = 5 if quick else 50
    payload = os.urandom(1 << 16)
    samples = []
    for _ in range(reps):  # monotonic clock: sha256 of 64 KiB
        t0 = time.perf_counter()
        hashlib.sha256(payload).digest()
        samples.append(time.perf_counter() - t0)
    s = sorted(samples)
    median = s[len(s) // 2]
    record = {"name": "sha256_64KiB", "bytes": len(payload), "samples": samples,
              "summary": {"median": median, "min": s[0], "n": len(s)},
              "bytes_per_s": len(payload) / median, "formula": "bytes / median seconds"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "selftest.json").write_text(json.dumps(
        {"suite": "selftest", "params": {"quick": quick, "reps": reps}, "results": [record]}, indent=2))
    (out / "selftest.txt").write_text(f"sha256 64 KiB: median {median * 1e6:.1f} us over {reps} reps\n")
    print(f"selftest bench: {reps} reps, median {median * 1e6:.1f} us")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m engine.remote.selftest")
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("test")
    t.add_argument("--junit", type=Path, required=True)
    b = sub.add_parser("bench")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    return run_tests(a.junit) if a.what == "test" else run_bench(a.out, a.quick)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
