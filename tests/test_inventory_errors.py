"""engine.remote.errors: the one-line format and the exit codes of ARCHITECTURE.md."""

from __future__ import annotations

import pytest

from engine.remote import errors as E

EXIT_CODES = {E.ConfigError: 5, E.UsageError: 5, E.HostUnreachable: 3, E.HostKeyError: 3, E.TransferError: 3,
              E.StepTimeout: 3, E.LockTimeout: 3, E.BuildFailed: 4, E.TestsFailed: 1, E.RegressionFound: 2}


@pytest.mark.parametrize("cls,code", EXIT_CODES.items(), ids=[c.__name__ for c in EXIT_CODES])
def test_exit_codes_and_tree(cls, code):
    err = cls("what broke", host="ct200", step="build", hint="do this")
    assert isinstance(err, E.KdtError) and err.exit_code == code
    assert str(err) == "error: ct200: build: what broke (do this)"


def test_missing_parts_are_left_out_and_context_fills_them():
    err = E.TransferError("put failed")
    assert str(err) == "error: put failed"
    raised = err.with_context(host="h1", step="sync")
    assert raised is err and str(err) == "error: h1: sync: put failed" and err.args == (str(err),)
    err.with_context(host="other", step="other")  # known parts are never overwritten
    assert (err.host, err.step) == ("h1", "sync")
