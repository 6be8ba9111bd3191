"""Per-host output: every line prefixed with its host; a live status table on a terminal.

    with Progress(["ct200", "h200"]) as p:
        log = p.logger("ct200")          # log("syncing")  ->  "[ct200] syncing"
        p.status("ct200", "building")    # the live table's cell (a plain line when not a tty)
        p.output("ct200")                # an on_output(stream, line) callback for transport.run

On a terminal (and with rich importable) a rich Live table shows each host's current step
below the scrolling lines; otherwise (CI, pipes, --json) plain lines go to the stream. Every
method is thread-safe: hosts run in parallel threads.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO


class Progress:
    def __init__(self, hosts: list[str], *, stream: TextIO | None = None, live: bool | None = None,
                 quiet_output: bool = False):
        """live=None: decide from stream.isatty(). quiet_output drops remote command output lines
        (they still go to the run's logs on the host)."""
        self.stream = stream or sys.stderr
        self.hosts = list(hosts)
        self.state = {h: "waiting" for h in hosts}
        self.quiet_output = quiet_output
        self._lock = threading.Lock()
        self._live = None
        self._console = None
        want_live = self.stream.isatty() if live is None else live
        if want_live:
            try:
                from rich.console import Console
                from rich.live import Live
                self._console = Console(file=self.stream, highlight=False)
                self._live = Live(self._table(), console=self._console, refresh_per_second=4, transient=True)
            except ImportError:
                self._live = None

    def _table(self):
        from rich.table import Table
        from rich.text import Text
        t = Table(show_header=False, box=None, padding=(0, 1))
        for h in self.hosts:  # Text, not markup: host names and states are shown as they are
            t.add_row(Text(h, style="bold"), Text(self.state[h]))
        return t

    def __enter__(self) -> "Progress":
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()

    def ask(self, question: str) -> str:
        """Ask on the terminal (the live table paused meanwhile); "" when there is no answer."""
        with self._lock:
            if self._live is not None:
                self._live.stop()
            try:
                self.stream.write(question)
                self.stream.flush()
                return sys.stdin.readline().strip()
            except (OSError, ValueError, KeyboardInterrupt):
                return ""
            finally:
                if self._live is not None:
                    self._live.start()

    def line(self, host: str, text: str) -> None:
        with self._lock:
            for part in str(text).splitlines() or [""]:
                msg = f"[{host}] {part}"
                if self._console is not None and self._live is not None:
                    from rich.text import Text
                    self._console.print(Text(msg))
                else:
                    print(msg, file=self.stream, flush=True)

    def status(self, host: str, text: str) -> None:
        with self._lock:
            self.state[host] = text
            if self._live is not None:
                self._live.update(self._table())
                return
        self.line(host, f"{time.strftime('%H:%M:%S')} {text}")

    def logger(self, host: str) -> Callable[[str], None]:
        return lambda text: self.line(host, text)

    def output(self, host: str) -> Callable[[str, str], None] | None:
        if self.quiet_output:
            return None
        return lambda _stream, text: self.line(host, f"  {text}")
