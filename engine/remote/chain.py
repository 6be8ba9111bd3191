"""Options shared by a chain of pipeline tasks on one command line.

Invoke gives each flag to the task it follows, so in

    invoke deploy test-remote bench fetch-results --host h200

only `fetch-results` would see `--host h200`, and the first three tasks would quietly run on
the default host. For the pipeline that is never what the user means: the host (and whether to
only plan, print JSON or accept a new host key) is a property of the whole chain. This module
reads those shared flags from the command line once, wherever they stand, so that every task
of the chain uses them unless it was given its own value. Two different values for one flag
are a usage error, never a silent choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.remote.errors import UsageError

VALUE_FLAGS = ("--host",)
BOOL_FLAGS = ("--dry-run", "--json", "--accept-new-host-key")


@dataclass(frozen=True)
class ChainOptions:
    host: str | None = None
    dry_run: bool = False
    json: bool = False
    accept_new_host_key: bool = False


def invoked_by_invoke(argv: list[str]) -> bool:
    """True when `argv` is Invoke's command line (`invoke`, `inv` or `python -m invoke`)."""
    prog = Path(argv[0]) if argv else Path()
    return prog.name in ("invoke", "inv") or prog.parent.name == "invoke"


def parse_chain(argv: list[str]) -> ChainOptions:
    """The shared flags found anywhere in `argv` (the invoke command line, program name first);
    none when `argv` is not Invoke's (a test calling a task function directly, say)."""
    if not invoked_by_invoke(argv):
        return ChainOptions()
    host: str | None = None
    found: dict[str, bool] = {}
    args = argv[1:]
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise UsageError(f"{name} needs a value", step="command line", hint="e.g. --host h200")
                value = args[i + 1]
                i += 1
            if host is not None and value != host:
                raise UsageError(f"--host given twice with different values ({host!r}, {value!r})",
                                 step="command line", hint="a chain of tasks runs on one --host; give it once")
            host = value
        elif a in BOOL_FLAGS:
            found[a] = True
        i += 1
    return ChainOptions(host=host, dry_run=found.get("--dry-run", False), json=found.get("--json", False),
                        accept_new_host_key=found.get("--accept-new-host-key", False))
