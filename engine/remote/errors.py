"""Errors of the orchestration library: one tree, each carrying where it happened.

Library code raises these; only ``tasks.py`` turns them into exit codes (one line on stderr,
no traceback). Every error carries the host (inventory name), the step (``config``, ``connect``,
``sync``, ``build``, ``test``, ``bench``, ``fetch``, ...), what went wrong and a hint for the fix,
and prints as ``error: <host>: <step>: <what> (<hint>)`` (unknown segments left out).

    KdtError                      exit_code  meaning
    ├── ConfigError                   5      a host YAML or a setting is malformed (names file and field)
    ├── UsageError                    5      bad command-line usage
    ├── HostUnreachable               3      cannot connect / authenticate / the link dropped
    ├── HostKeyError                  3      unknown or changed host key (prints the SHA256 fingerprint)
    ├── TransferError                 3      put / get / sync failed or a file did not verify
    ├── StepTimeout                   3      a remote step ran past its timeout (its process group was killed)
    ├── LockTimeout                   3      <remote_dir>/.lock stayed held past the wait
    ├── BuildFailed                   4      the build on the host failed
    ├── TestsFailed                   1      native tests or pytest failed (or a JUnit file was missing)
    ├── RegressionFound               2      a benchmark comparison found a significant slowdown
    └── Interrupted                 130      Ctrl-C: the remote step was stopped (its run marked interrupted)

Exit code 0 is success; codes follow ARCHITECTURE.md "Exit codes of the tasks".
"""

from __future__ import annotations


class KdtError(Exception):
    """Base of every expected failure. ``exit_code`` is what the task exits with."""

    exit_code = 1

    def __init__(self, what: str, *, host: str | None = None, step: str | None = None,
                 hint: str | None = None):
        self.what = what
        self.host = host
        self.step = step
        self.hint = hint
        super().__init__(str(self))

    def __str__(self) -> str:
        # Segments that are unknown are left out rather than printed as placeholders.
        parts = ["error"] + [p for p in (self.host, self.step) if p] + [self.what]
        line = ": ".join(parts)
        if self.hint:
            line += f" ({self.hint})"
        return line

    def with_context(self, *, host: str | None = None, step: str | None = None) -> "KdtError":
        """Fill in host / step when the raiser did not know them; returns self for `raise`."""
        if self.host is None and host is not None:
            self.host = host
        if self.step is None and step is not None:
            self.step = step
        self.args = (str(self),)
        return self


class ConfigError(KdtError):
    exit_code = 5


class UsageError(KdtError):
    exit_code = 5


class HostUnreachable(KdtError):
    exit_code = 3


class HostKeyError(KdtError):
    exit_code = 3


class TransferError(KdtError):
    exit_code = 3


class StepTimeout(KdtError):
    exit_code = 3


class LockTimeout(KdtError):
    exit_code = 3


class BuildFailed(KdtError):
    exit_code = 4


class TestsFailed(KdtError):
    exit_code = 1
    __test__ = False  # not a pytest test class despite the name


class RegressionFound(KdtError):
    exit_code = 2


class Interrupted(KdtError):
    exit_code = 130
