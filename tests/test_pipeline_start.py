"""A run that cannot start: --no-deploy with nothing deployed is refused before any run folder
exists, and a runner that fails to start takes its fresh run folder with it (fetch-results
would otherwise wait on a run that never began)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from engine.remote import pipeline
from engine.remote.errors import TransferError, UsageError
from engine.remote.inventory import parse_host
from engine.remote.plan import Options
from engine.remote.progress import Progress
from engine.remote.transport import LocalTransport

REPO = Path(__file__).resolve().parents[1]


def box(tmp_path: Path):
    return parse_host("box", {"transport": "local", "remote_dir": str(tmp_path / "remote"), "cuda_arch": "cpu"},
                      source=tmp_path / "box.yaml")


def progress() -> Progress:
    return Progress(["box"], stream=io.StringIO(), live=False)


def test_no_deploy_with_nothing_deployed_is_refused_before_a_run_folder(tmp_path):
    with pytest.raises(UsageError) as e:
        pipeline.test_remote(box(tmp_path), REPO, Options(no_deploy=True), progress())
    msg = str(e.value)
    assert msg.startswith("error: box: test: --no-deploy, but nothing is deployed in ") and "invoke deploy" in msg, msg
    assert not (tmp_path / "remote" / "runs").exists()


class NoSpawn(LocalTransport):
    def spawn_detached(self, argv, *, cwd, env, log_path):
        raise TransferError("could not start the runner (test)")


def test_a_runner_that_cannot_start_leaves_no_run_folder(tmp_path, monkeypatch):
    (tmp_path / "remote" / "src").mkdir(parents=True)  # "deployed", so the start is attempted
    monkeypatch.setattr(pipeline, "open_transport", lambda host, **_: NoSpawn(host))
    with pytest.raises(TransferError, match="could not start the runner") as e:
        pipeline.test_remote(box(tmp_path), REPO, Options(no_deploy=True), progress())
    assert (e.value.host, e.value.step) == ("box", "test")
    runs = tmp_path / "remote" / "runs"
    assert runs.is_dir() and not [p.name for p in runs.iterdir() if p.is_dir()]
    assert not (tmp_path / "remote" / ".lock").exists(), "the lock is released"


class LinkGone(NoSpawn):
    def run(self, argv_or_script, **kw):
        if "rm -rf" in str(argv_or_script):
            raise TransferError("the link dropped (test)")
        return super().run(argv_or_script, **kw)


def test_when_the_cleanup_fails_too_the_start_error_is_reported(tmp_path, monkeypatch):
    (tmp_path / "remote" / "src").mkdir(parents=True)
    monkeypatch.setattr(pipeline, "open_transport", lambda host, **_: LinkGone(host))
    with pytest.raises(TransferError, match="could not start the runner"):
        pipeline.test_remote(box(tmp_path), REPO, Options(no_deploy=True), progress())
