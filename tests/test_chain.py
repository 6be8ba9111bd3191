"""Flags shared by a chain of tasks (engine/remote/chain.py) reach every task of the chain."""

import subprocess
import sys
from pathlib import Path

import pytest

from engine.remote.chain import ChainOptions, parse_chain
from engine.remote.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
INVOKE = ["/x/site-packages/invoke/__main__.py"]


def test_flags_after_the_last_task_apply_to_the_chain():
    got = parse_chain(INVOKE + ["deploy", "test-remote", "bench", "--quick", "fetch-results",
                                "--host", "h200", "--no-commit", "--dry-run"])
    assert got == ChainOptions(host="h200", dry_run=True)


def test_equals_form_and_bool_flags():
    got = parse_chain(INVOKE + ["deploy", "--host=a,b", "--json", "doctor", "--accept-new-host-key"])
    assert got == ChainOptions(host="a,b", json=True, accept_new_host_key=True)


def test_same_host_twice_is_fine_different_hosts_are_an_error():
    assert parse_chain(INVOKE + ["deploy", "--host", "a", "bench", "--host", "a"]).host == "a"
    with pytest.raises(UsageError, match="--host given twice"):
        parse_chain(INVOKE + ["deploy", "--host", "a", "bench", "--host", "b"])
    with pytest.raises(UsageError, match="needs a value"):
        parse_chain(INVOKE + ["deploy", "--host"])


def test_other_programs_command_lines_are_ignored():
    assert parse_chain(["/usr/bin/pytest", "--host", "x"]) == ChainOptions()
    assert parse_chain(["/usr/local/bin/inv", "deploy", "--host", "x"]).host == "x"


def test_invoke_chain_plans_every_task_on_the_given_host(tmp_path):
    host = tmp_path / "box.yaml"
    host.write_text(f"transport: local\nremote_dir: {tmp_path / 'remote'}\ncuda_arch: cpu\n")
    r = subprocess.run([sys.executable, "-m", "invoke", "deploy", "test-remote", "--host", str(host),
                        "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "plan: deploy on box" in out and "plan: test on box" in out, out
    assert "box: deploy: ok" in r.stdout and "box: test-remote: ok" in r.stdout, r.stdout
    assert not (tmp_path / "remote").exists()  # a plan touches nothing
    assert "[local]" not in out
