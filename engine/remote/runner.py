"""The host-side runner: executes one run's steps and finalizes its manifest.

    python3 -m engine.remote.runner RUN_DIR        (PYTHONPATH=<remote_dir>/src)

The client (engine/remote/pipeline.py) creates RUN_DIR and puts RUN_DIR/request.json there:

    {"schema": 1, "run_id", "kind": "test"|"bench", "host": {"name", "address"},
     "git": {...the deploying checkout's provenance.git_info...},
     "build_dir": "<remote_dir>/build/<arch>", "arch", "options": {...},
     "steps": [{"name", "argv": [...], "cwd", "env": {...}, "timeout": seconds,
                "junit": "file.xml" or null,           # relative to RUN_DIR; required when set
                "skip_codes": {"5": "no tests were selected"}}],
     "lock": {"path", "token"} or null}               # claimed at start, released after the manifest

Each step runs in its own session (process group) with stdout+stderr in RUN_DIR/logs/<name>.log;
a timeout kills the whole group (TERM, then KILL after KILL_GRACE_S). A step fails when it exits
non-zero, is killed by a signal, or names a JUnit file that is missing or reports failures;
exit codes in skip_codes mark it skipped with that reason. RUN_DIR/status.json shows progress
while running. Last of all, manifest.json (the ARCHITECTURE.md manifest, with every other file's
size and sha256) is written to a temporary name and renamed: a run folder without manifest.json
is incomplete. Exit status: 0 when no step failed, 1 otherwise, 5 for an unusable request.
Standard library only: it runs on bare hosts.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from engine.remote import provenance

SCHEMA = 1
KILL_GRACE_S = 10
MANIFEST = "manifest.json"
POLL_S = 0.2          # how often a running step's log is read for new lines
HEARTBEAT_S = 15.0    # a quiet step still says it is alive this often


def _say(line: str) -> None:
    """A line on the runner's stdout: the client passes these on to the terminal as they come."""
    print(line, flush=True)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def file_list(run_dir: Path) -> list[dict]:
    """Every file under run_dir except the manifest itself: path (posix, relative), size, sha256."""
    out = []
    for p in sorted(run_dir.rglob("*")):
        rel = p.relative_to(run_dir).as_posix()
        if p.is_file() and not rel.startswith(MANIFEST):
            out.append({"path": rel, "size": p.stat().st_size, "sha256": provenance.sha256_file(p)})
    return out


def write_json_atomic(path: Path, obj: dict) -> None:
    # The temporary name is this process's own: another writer of the same file (the client's
    # lock handoff writes owner.json.tmp) can never move it away under us.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def junit_counts(path: Path) -> dict:
    """{"tests", "failures", "errors", "skipped"} summed over a JUnit file's test cases."""
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    if not cases:  # some writers only fill in the suite attributes
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        return {k: sum(int(s.get(k, 0) or 0) for s in suites)
                for k in ("tests", "failures", "errors", "skipped")}
    c = {"tests": len(cases), "failures": 0, "errors": 0, "skipped": 0}
    for case in cases:
        for tag, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                c[key] += 1
    return c


class Runner:
    def __init__(self, run_dir: Path, request: dict):
        self.run_dir = run_dir
        self.req = request
        self.status: dict[str, dict] = {}
        self.current: subprocess.Popen | None = None
        self.terminated: str | None = None
        self._step_no = (1, 1)

    # -- progress ------------------------------------------------------------------------
    def _status_file(self, state: str, step: str | None = None) -> None:
        write_json_atomic(self.run_dir / "status.json", {
            "run_id": self.req["run_id"], "state": state, "step": step, "pid": os.getpid(),
            "updated": utc_now(), "steps": self.status})

    def _on_signal(self, signum, _frame) -> None:
        # A TERM/HUP/INT to the runner ends the current step's group and finalizes the run as
        # interrupted (the client sends TERM on Ctrl-C: engine/remote/pipeline.py).
        self.terminated = signal.Signals(signum).name
        if self.current is not None and self.current.poll() is None:
            _kill_group(self.current)

    # -- one step ------------------------------------------------------------------------
    def run_step(self, step: dict) -> dict:
        name = step["name"]
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({k: str(v) for k, v in (step.get("env") or {}).items()})
        timeout = step.get("timeout")
        t0 = time.monotonic()
        rec = {"status": "failed", "exit_code": None, "signal": None, "seconds": 0.0,
               "log": f"logs/{name}.log", "argv": step["argv"], "started": utc_now()}
        with open(log, "ab") as out:
            out.write(f"$ {' '.join(step['argv'])}\n".encode())
            out.flush()
            try:
                self.current = subprocess.Popen(step["argv"], cwd=step.get("cwd"), env=env,
                                                stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                rec["reason"] = f"could not start {step['argv'][0]}: {e}"
                return self._finish(rec, t0)
            code = self._wait(self.current, log, name, timeout, t0, rec)
        rec["exit_code"] = code if code >= 0 else None
        rec["signal"] = signal.Signals(-code).name if code < 0 else None
        if self.terminated:
            rec["status"] = "interrupted"
            rec.setdefault("reason", f"the runner received {self.terminated}; the step's process group was killed")
            return self._finish(rec, t0)
        elif code < 0:
            rec.setdefault("reason", f"killed by {rec['signal']}")
        elif str(code) in (step.get("skip_codes") or {}):
            rec["status"] = "skipped"
            rec["reason"] = step["skip_codes"][str(code)]
        elif code != 0:
            rec.setdefault("reason", f"exit code {code}")
        elif "reason" not in rec:
            rec["status"] = "ok"
        junit = step.get("junit")
        if junit and rec["status"] != "skipped":
            self._check_junit(rec, self.run_dir / junit)
        return self._finish(rec, t0)

    def _wait(self, proc: subprocess.Popen, log: Path, name: str, timeout: float | None, t0: float,
              rec: dict) -> int:
        """Wait for the step, passing its log's new lines on to this runner's stdout as they come
        (the client shows them live), with a heartbeat line when the step is quiet; a timeout
        kills the step's process group."""
        k, n = self._step_no
        last_say = time.monotonic()
        with open(log, "rb") as tail:
            tail.seek(0, os.SEEK_END)
            pending = b""
            while True:
                code = proc.poll()
                chunk = tail.read()
                if chunk:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        _say(line.decode("utf-8", "replace").rstrip("\r"))
                    last_say = time.monotonic()
                if code is not None:
                    if pending:
                        _say(pending.decode("utf-8", "replace"))
                    return code
                elapsed = time.monotonic() - t0
                if timeout is not None and elapsed > timeout:
                    _kill_group(proc)
                    rec["reason"] = f"timed out after {timeout} s; its process group was killed"
                    return proc.wait()
                if time.monotonic() - last_say >= HEARTBEAT_S:
                    _say(f"progress: step {name} ({k}/{n}), {elapsed:.0f} s elapsed"
                         + (f", timeout in {timeout - elapsed:.0f} s" if timeout else ""))
                    last_say = time.monotonic()
                time.sleep(POLL_S)

    def _check_junit(self, rec: dict, path: Path) -> None:
        rec["junit"] = path.name
        if not path.is_file():
            rec["status"] = "failed"
            rec.setdefault("reason", f"JUnit file {path.name} was not written")
            return
        try:
            counts = junit_counts(path)
        except (ET.ParseError, ValueError) as e:
            rec["status"] = "failed"
            rec.setdefault("reason", f"JUnit file {path.name} is unreadable: {e}")
            return
        rec["tests"] = counts
        if counts["failures"] or counts["errors"]:
            rec["status"] = "failed"
            rec.setdefault("reason", f"{counts['failures']} failures, {counts['errors']} errors")

    def _finish(self, rec: dict, t0: float) -> dict:
        self.current = None
        rec["seconds"] = round(time.monotonic() - t0, 3)
        rec["finished"] = utc_now()
        return rec

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, self._on_signal)
        started = utc_now()
        claim_lock(self.req.get("lock"))
        for name, why in (self.req.get("skipped") or {}).items():  # planned out, e.g. no run_tests.sh yet
            self.status[name] = {"status": "skipped", "reason": why}
        clocks_before = provenance.gpu_clocks()
        steps = self.req["steps"]
        for k, step in enumerate(steps, 1):
            name = step["name"]
            if self.terminated:
                self.status[name] = {"status": "skipped", "reason": f"the runner received {self.terminated}"}
                continue
            self._status_file("running", name)
            self._step_no = (k, len(steps))
            _say(f"runner: step {name} ({k}/{len(steps)}) started")
            self.status[name] = rec = self.run_step(step)
            _say(f"runner: step {name} ({k}/{len(steps)}) {rec['status']} in {rec['seconds']:.0f} s"
                 + (f": {rec['reason']}" if rec.get("reason") else ""))
        self._status_file("finalizing")
        prov = provenance.collect(self.run_dir, self.req.get("build_dir"))
        prov["git"] = self.req.get("git") or prov["git"]
        prov["host_facts"]["gpu_clocks"] = {"before": clocks_before, "after": prov["host_facts"]["gpu_clocks"]}
        failed = [n for n, r in self.status.items() if r["status"] in ("failed", "interrupted")]
        summary = summarize(self.req["kind"], self.status)
        if self.terminated:
            summary = f"INTERRUPTED ({self.terminated}): {summary}"
        manifest = {
            "schema": SCHEMA, "run_id": self.req["run_id"], "kind": self.req["kind"],
            "host": self.req["host"], "started": started, "finished": utc_now(),
            # complete: every step ran to its end (ok or not); interrupted: stopped by a signal
            # (Ctrl-C on the client, or a kill): never a result to compare against
            "state": "interrupted" if self.terminated else "complete",
            "interrupted": {"signal": self.terminated} if self.terminated else None,
            "status": self.status, "steps": [s["name"] for s in self.req["steps"]],
            "ok": not failed and not self.terminated, "summary": summary,
            "options": self.req.get("options", {}), "arch": self.req.get("arch"), **prov,
        }
        self._status_file("finished")
        manifest["files"] = file_list(self.run_dir)  # last: status.json above is final now
        write_json_atomic(self.run_dir / MANIFEST, manifest)
        release_lock(self.req.get("lock"))
        _say(f"runner: {summary}")
        return 130 if self.terminated else 1 if failed else 0


def summarize(kind: str, status: dict[str, dict]) -> str:
    """One line: each step's outcome and, for JUnit steps, passed / failed counts."""
    parts = []
    for name, r in status.items():
        t = r.get("tests")
        if t:
            bad = t["failures"] + t["errors"]
            parts.append(f"{name} {t['tests'] - bad - t['skipped']} passed, {bad} failed, {t['skipped']} skipped")
        else:
            parts.append(f"{name} {r['status']}" + (f" ({r['reason']})" if r.get("reason") else ""))
    return f"{kind}: " + "; ".join(parts) if parts else f"{kind}: no steps"


def _kill_group(proc: subprocess.Popen) -> None:
    """TERM the step's process group, KILL it after KILL_GRACE_S."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def claim_lock(lock: dict | None) -> None:
    """Write this runner's pid into <remote_dir>/.lock when it still carries this run's token.

    The lock then stays live for as long as the run does: a client killed while it waits for an
    attached runner (a timeout, a dropped link) leaves the runner going, and without its pid the
    lock would look stale and a second run could start beside this one, skewing both.
    """
    if not lock:
        return
    path = Path(lock["path"]) / "owner.json"
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if owner.get("token") == lock["token"]:
        owner["host_pid"] = os.getpid()
        try:
            write_json_atomic(path, owner)
        except OSError:  # the client released or handed the lock over meanwhile: nothing to claim
            return


def release_lock(lock: dict | None) -> None:
    """Remove <remote_dir>/.lock when it still carries this run's token (detached runs hold it)."""
    if not lock:
        return
    path = Path(lock["path"])
    try:
        owner = json.loads((path / "owner.json").read_text())
    except (OSError, ValueError):
        return
    if owner.get("token") == lock["token"]:
        gone = path.with_name(f"{path.name}.released.{os.getpid()}")
        os.rename(path, gone)
        for p in sorted(gone.rglob("*"), reverse=True):
            p.unlink()
        gone.rmdir()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m engine.remote.runner RUN_DIR", file=sys.stderr)
        return 5
    run_dir = Path(argv[0]).resolve()
    req_path = run_dir / "request.json"
    try:
        request = json.loads(req_path.read_text())
        for key in ("run_id", "kind", "host", "steps"):
            if key not in request:
                raise ValueError(f"field '{key}' is missing")
    except (OSError, ValueError) as e:
        print(f"error: runner: {req_path}: {e}", file=sys.stderr)
        return 5
    if (run_dir / MANIFEST).exists():
        print(f"error: runner: {run_dir / MANIFEST} exists: this run is already final", file=sys.stderr)
        return 5
    return Runner(run_dir, request).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
