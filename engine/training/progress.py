"""Progress of a timed training loop: a rich bar on a terminal, plain lines otherwise.

    with Progress("target", budget_s=120, log=log) as bar:
        bar.update(fraction, step=step, loss=2.31, tok_s=4.1e5)

`fraction` (0..1) is how much of the budget (time or steps, whichever is nearer) is spent. Plain
lines (for logs and pipelines) come at most every `every_s` seconds, plus the last one.
"""

from __future__ import annotations

import sys
import time


def _fmt(fields: dict) -> str:
    parts = []
    for k, v in fields.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:,.0f}" if abs(v) >= 1000 else f"{k} {v:.4f}")
        else:
            parts.append(f"{k} {v}")
    return "  ".join(parts)


class Progress:
    def __init__(self, name: str, budget_s: float, log=None, every_s: float = 10.0,
                 stream=None, rich: bool | None = None):
        self.name, self.budget_s, self.every_s = name, budget_s, every_s
        self.stream = stream or sys.stderr
        self.log = log or (lambda msg: print(msg, file=self.stream, flush=True))
        self.rich = self.stream.isatty() if rich is None else rich
        self._bar = self._task = None
        self._last = None
        self._t0 = time.monotonic()
        self._fields: dict = {}

    def __enter__(self):
        if self.rich:
            from rich.progress import (BarColumn, Progress as RichProgress, TextColumn,
                                       TimeElapsedColumn)

            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                                     TextColumn("{task.fields[info]}"), transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.name, total=1.0, info="")
        return self

    def update(self, fraction: float, **fields) -> None:
        self._fields = fields
        if self._bar is not None:
            self._bar.update(self._task, completed=min(max(fraction, 0.0), 1.0), info=_fmt(fields))
            return
        now = time.monotonic()
        if self._last is None or now - self._last >= self.every_s:
            self._last = now
            self.log(f"{self.name} {100 * min(fraction, 1.0):5.1f}%  "
                     f"{now - self._t0:6.1f} s  {_fmt(fields)}")

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        elif self._fields:
            self.log(f"{self.name} done  {time.monotonic() - self._t0:6.1f} s  {_fmt(self._fields)}")
        return False
