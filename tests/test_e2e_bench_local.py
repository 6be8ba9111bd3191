"""End-to-end on the local transport: `invoke bench --suite kernels,tree_build,e2e,service
--quick` then `invoke fetch-results --no-commit`, in a throwaway clone with a throwaway
remote_dir. The fetched run folder holds results only: no weights (they are inputs, cached in
<remote_dir>/cache by bench/weights.py) and no large file. The host's cache starts with the
session's quick weights (conftest.py `quick_weights`), as a host that ran a suite before has
them; training them on a host with an empty cache is tested in tests/test_bench_e2e_drafter.py
and tests/test_training_target.py, and by every first run on a new host."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import yaml

from e2e_helpers import Invoke, explain, make_clone, run_ids

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN_FILE_MAX_BYTES = 512 * 1024
RUN_FOLDER_MAX_BYTES = 2 * 1024 * 1024


@pytest.mark.skipif(shutil.which("g++") is None, reason="the cpu build needs g++")
def test_bench_all_cpu_suites_then_fetch_keeps_the_run_folder_small(tmp_path, quick_weights):
    clone = make_clone(tmp_path / "repo")
    remote = tmp_path / "remote"
    quick_weights(remote / "cache")
    host = tmp_path / "hosts" / "lhost.yaml"
    host.parent.mkdir()
    host.write_text(yaml.safe_dump({"transport": "local", "remote_dir": str(remote), "cuda_arch": "cpu",
                                         "python": sys.executable}))
    inv = Invoke(clone)
    r = inv("bench", "--host", str(host), "--suite", "kernels,tree_build,e2e,service", "--quick",
            "--json", timeout=900)
    assert r.returncode == 0, explain(r)
    (rid,) = run_ids(r)
    r = inv("fetch-results", "--host", str(host), "--no-commit", timeout=300)
    assert r.returncode == 0, explain(r)
    run = clone / "results" / "lhost" / rid
    assert (run / "manifest.json").is_file(), explain(r)
    files = [p for p in run.rglob("*") if p.is_file()]
    assert {"kernels.json", "tree_build.json", "e2e.json", "service.json"} <= {p.name for p in files}
    assert not [p.name for p in files if p.suffix == ".safetensors"]
    assert not [(p.name, p.stat().st_size) for p in files if p.stat().st_size > RUN_FILE_MAX_BYTES]
    assert sum(p.stat().st_size for p in files) < RUN_FOLDER_MAX_BYTES
    for suite in ("e2e", "service"):
        w = json.loads((run / f"{suite}.json").read_text())["params"]["weights"]
        assert w["path"].startswith(str(remote / "cache" / "weights")), (suite, w["path"])
        assert w["sha256"]["model.safetensors"] and w["config"], suite
