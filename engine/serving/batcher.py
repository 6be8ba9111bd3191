"""Continuous batching over the native engine's step API, in one worker thread.

    b = Batcher(engine, mode="ddtree", budget=63, max_batch=32, max_queue=64)
    b.start()
    job = b.submit(prompt_ids, max_tokens, loop)   # from the event loop; may raise Overloaded
    while (item := await job.queue.get())[0] == "tokens": ...   # ("tokens", [ids])
    # then ("done", "length") or ("error", message)
    b.cancel(job)                                   # a client went away: its slot is freed
    b.pause(); b.resume()                           # tests: hold / release the decode steps
    b.stop()

Why a thread: an engine step is a long blocking native call (ctypes releases the GIL), so the
HTTP event loop stays responsive while the worker runs the engine. Only the worker touches the
engine; the event loop and the worker share only `_pending`, `_cancelled`, `_stopping`, `_paused`
and `_in_flight`, under `_cond`. Tokens go back to the event loop through `loop.call_soon_threadsafe`.

One worker iteration (a "step boundary"):
  1. free the slots of cancelled jobs (engine.release);
  2. admit queued jobs while slots are free: engine.add prefills each prompt; its first token
     (the prefill's argmax) is sent at once, so the time to first token is one prefill;
  3. one engine.step(mode, budget): every active slot advances by one AR step or one DDTree
     round in one batched target forward; new tokens are sent, trimmed to max_tokens; a job
     that has max_tokens tokens is done and its slot released.
Capacity: max_batch slots in the engine plus max_queue waiting jobs. The admission decision is
made synchronously in submit, under the lock, from one count: jobs accepted and not yet finished
(queued, being prefilled, or active). A job therefore never escapes the count between the queue
and its slot, and submit raises Overloaded (HTTP 429) exactly when max_batch + max_queue jobs are
in flight. After stop(), or if the worker died, submit raises Unavailable (503).

pause() holds the decode steps at the next step boundary (a step already running finishes);
cancellations and admissions (prefill, first token) still happen, so a test can fill the slots
and the queue and know that nothing finishes until resume(). Tests use it (through the server's
--debug-hooks) to make overload and disconnect behaviour independent of machine speed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time


class Overloaded(RuntimeError):
    """Every slot is busy and the wait queue is full (HTTP 429)."""


class Unavailable(RuntimeError):
    """The batcher is stopping or its worker died (HTTP 503)."""


@dataclasses.dataclass
class Job:
    prompt: list                 # token ids
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue         # ("tokens", [ids]) ... then ("done", reason) or ("error", msg)
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    slot: int | None = None      # engine slot while active (worker only)
    sent: int = 0                # tokens sent so far (worker only)
    finished: bool = False       # done, failed or cancelled (set by the worker)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Batcher:
    def __init__(self, engine, mode: str, budget: int = 63, max_batch: int = 32,
                 max_queue: int = 64, drafter=None, round_tokens: int = 0):
        if mode not in ("ar", "ddtree"):
            raise ValueError(f"Batcher: mode={mode!r} must be 'ar' or 'ddtree'")
        if not 1 <= max_batch <= engine.max_slots:
            raise ValueError(f"Batcher: max_batch = {max_batch} must be in [1, engine.max_slots "
                             f"= {engine.max_slots}]")
        if max_queue < 0:
            raise ValueError(f"Batcher: max_queue = {max_queue} must be >= 0")
        if round_tokens < 0:
            raise ValueError(f"Batcher: round_tokens = {round_tokens} must be >= 0 (0: off)")
        self.engine, self.mode, self.budget = engine, mode, int(budget)
        self.round_tokens = int(round_tokens)
        self.max_batch, self.max_queue, self.drafter = int(max_batch), int(max_queue), drafter
        # Tree width a round appends to the cache before compaction (the root alone for AR).
        self.width = 1 if mode == "ar" else self.budget + 1
        self._cond = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._cancelled: list = []
        self._active: dict = {}  # slot -> Job (worker only; len() read by stats)
        self._stopping = False
        self._paused = False
        self._in_flight = 0  # accepted jobs not finished: queued + being admitted + active
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why the worker died, if it did
        self.counters = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0,
                         "rejected": 0, "steps": 0, "slot_steps": 0, "tokens": 0, "step_tokens": 0,
                         "step_seconds": 0.0, "prefill_seconds": 0.0}

    # ---------------------------------------------------------------- event-loop side

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kdtree-batcher", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def max_prompt_tokens(self, max_tokens: int) -> int:
        """Longest prompt that fits a slot with max_tokens new tokens (prompt + generated +
        tree width must stay within the engine's max_seq)."""
        return self.engine.max_seq - max_tokens - self.width

    def submit(self, prompt, max_tokens: int, loop: asyncio.AbstractEventLoop) -> Job:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt is empty (need at least one token)")
        if max_tokens < 1:
            raise ValueError(f"max_tokens = {max_tokens}, need >= 1")
        if len(prompt) > self.max_prompt_tokens(max_tokens):
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) + tree "
                             f"width ({self.width}) exceeds the context of {self.engine.max_seq} "
                             "tokens")
        job = Job(prompt, int(max_tokens), loop, asyncio.Queue())
        with self._cond:
            if not self.alive():
                raise Unavailable(self.error or "the server is shutting down")
            if self._in_flight >= self.max_batch + self.max_queue:
                self.counters["rejected"] += 1
                raise Overloaded(f"{self._in_flight} requests in flight: {self.max_batch} slots "
                                 f"and a queue of {self.max_queue} are full ({len(self._active)} "
                                 f"active, {len(self._pending)} queued)")
            self._pending.append(job)
            self._in_flight += 1
            self.counters["requests"] += 1
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client is gone (or the handler finished): free the job's slot at the next step
        boundary. Harmless for a job that already finished."""
        with self._cond:
            if job.finished:
                return
            try:
                self._pending.remove(job)
                job.finished = True
                self._in_flight -= 1
                self.counters["cancelled"] += 1
                return
            except ValueError:
                pass
            self._cancelled.append(job)
            self._cond.notify()

    def pause(self) -> None:
        """Run no engine.step from the next step boundary on (cancellations and admissions
        go on) until resume(). For tests: nothing in flight can finish while paused."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def paused(self) -> bool:
        return self._paused

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict:
        with self._cond:
            c = dict(self.counters)
            c.update(active=len(self._active), queued=len(self._pending),
                     in_flight=self._in_flight, paused=self._paused)
        # Tokens a slot gains per step (trimmed to max_tokens): 1 for AR, the accept length for
        # DDTree.
        c["tokens_per_slot_step"] = c["step_tokens"] / c["slot_steps"] if c["slot_steps"] else 0.0
        return c

    # ---------------------------------------------------------------- worker side

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._has_work():
                        self._cond.wait()
                    if self._stopping:
                        break
                    cancelled, self._cancelled = self._cancelled, []
                    admit = []
                    while self._pending and len(self._active) + len(admit) < self.max_batch:
                        admit.append(self._pending.popleft())
                    step = not self._paused
                for job in cancelled:
                    self._finish(job, None, "cancelled")
                for job in admit:
                    self._admit(job)
                if self._active and step:
                    self._step()
        except BaseException as e:  # a bug: record it, fail everyone, let /health say so
            self.error = f"batcher worker died: {type(e).__name__}: {e}"
            raise
        finally:
            with self._cond:
                self._stopping = True
                pending, self._pending = list(self._pending), collections.deque()
            why = self.error or "the server is shutting down"
            for job in pending + list(self._active.values()):
                self._finish(job, ("error", why), "failed")

    def _has_work(self) -> bool:
        """Under _cond: something for the worker to do (waiting otherwise; a paused worker with
        full slots must sleep, not spin)."""
        return bool(self._stopping or self._cancelled
                    or (self._pending and len(self._active) < self.max_batch)
                    or (self._active and not self._paused))

    def _finish(self, job: Job, item, counter: str) -> None:
        if job.finished:
            return
        if job.slot is not None and self._active.get(job.slot) is job:
            del self._active[job.slot]
            try:
                self.engine.release(job.slot)
            except Exception:  # the slot is gone already (engine failure): nothing to free
                pass
        with self._cond:
            job.finished = True
            self._in_flight -= 1
            self.counters[counter] += 1
        if item is not None:
            job._put(item)

    def _admit(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            job.slot = self.engine.add(job.prompt)
        except Exception as e:
            self._finish(job, ("error", f"prefill failed: {type(e).__name__}: {e}"), "failed")
            return
        self.counters["prefill_seconds"] += time.perf_counter() - t0
        self._active[job.slot] = job
        self._deliver(job, self.engine.tokens(job.slot))

    MIN_ROUND_BUDGET = 3  # smaller trees accept too little to pay for drafting

    def step_budget(self, active: int) -> int:
        """The tree budget of a round with `active` requests: `budget`, halved along 2^k - 1
        (63, 31, 15, 7, 3) while active x (budget + 1) exceeds round_tokens, so a round's verify
        stays near the size that pays; 0 (an AR step: speculation off under load) once even
        budget 3 exceeds it. round_tokens 0 keeps `budget` always."""
        b = self.budget
        if self.round_tokens:
            while b > 0 and active * (b + 1) > self.round_tokens:
                b = (b + 1) // 2 - 1 if b > self.MIN_ROUND_BUDGET else 0
        return b

    def _step(self) -> None:
        t0 = time.perf_counter()
        jobs = list(self._active.values())
        try:
            budget = self.step_budget(len(jobs)) if self.mode == "ddtree" else 0
            self.engine.step(self.mode if budget else "ar", budget, self.drafter)
        except Exception as e:  # fail this batch, keep serving
            for job in jobs:
                self._finish(job, ("error", f"decode step failed: {type(e).__name__}: {e}"),
                             "failed")
            return
        self.counters["step_seconds"] += time.perf_counter() - t0
        self.counters["steps"] += 1
        self.counters["slot_steps"] += len(jobs)
        for job in jobs:
            self.counters["step_tokens"] += self._deliver(job, self.engine.tokens(job.slot))

    def _deliver(self, job: Job, tokens: list) -> int:
        """Send tokens[job.sent:] (trimmed to max_tokens); finish the job when it is complete.
        Returns how many tokens were sent."""
        new = tokens[job.sent:job.max_tokens]
        if new:
            job.sent += len(new)
            self.counters["tokens"] += len(new)
            job._put(("tokens", new))
        if job.sent >= job.max_tokens:
            self._finish(job, ("done", "length"), "completed")
        return len(new)
