"""Timing helpers shared by every suite: samples in seconds, and their summary.

CPU: `time.perf_counter` (monotonic, ns resolution) around each call.
CUDA: a pair of CUDA events around each call, recorded on the current stream; all events are
read after one synchronise at the end, so the host never stalls the device between reps.
Before each rep a buffer of twice the L2 size is overwritten (`flush_l2`), so the timed call
starts with a cold L2, as a kernel inside a decode step does (the layers before it evicted it).

`time_cuda_graph`: the kernel alone, N calls captured in one CUDA graph, replayed, divided by N
(one call between events also carries the launch from Python); the one graph timer of the repo
(the kernels and tree suites use it), with counts that adapt to a time budget.

Device warm-up: the first CUDA-timed call of a process first runs its own work back to back for
DEVICE_WARMUP_S seconds, untimed. The GPU's clocks rise under load: without it the first cases
of the kernels suite on the H200 were timed at idle clocks (runs of 2026-12-01: a step of up to
13% down in the middle of a case's samples, and bs 1 at budget 15 1.5-2.4 us slower than bs 64).

Every helper returns the raw samples; `summarize` turns them into the figures the JSON keeps
beside them (median, min, p10, p90, mean, n).

`cpu_states`: a CPU call's two speeds. On the machines we measure, the same call toggles between
two speeds ~1.8x apart in stretches of hundreds of calls (docs/BENCHMARKS.md), so a sample of a
few hundred calls lands in one state or the other by chance; runs of calls back to back, each
run's median kept, show both. The fast state's figure is the median of the runs within
FAST_STATE_SPAN of the fastest one: the fast state's own median, whatever share of the runs it
holds, rather than the least run median, which is biased low by the noise between runs. A
state can outlast a case's tenth of a second of runs, so the suites take more runs of their
cheap CPU calls between later cases (`CpuStateRounds`).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Sequence

import numpy as np

__all__ = ["summarize", "time_cpu", "cpu_states", "CpuStateRounds", "time_cuda",
           "time_cuda_graph", "l2_flush_bytes", "DEVICE_WARMUP_S", "device_warmup_s", "settle",
           "SETTLE_S"]

DEVICE_WARMUP_S = 1.0  # seconds of untimed device work before the process's first CUDA sample
SETTLE_S = 1.0  # seconds of light device work after a heavy measurement (settle)
FAST_STATE_SPAN = 1.25  # cpu_states: runs this close to the fastest are its state (states ~1.8x)
_warmup_spent: float | None = None  # seconds the process's warm-up took (None: not yet)


def device_warmup_s() -> float | None:
    """Seconds the process's device warm-up took, or None before the first CUDA timing."""
    return _warmup_spent


def _warm_once(step: Callable[[], object], sync: Callable[[], object],
               seconds: float = DEVICE_WARMUP_S) -> float:
    """Runs `step` (it enqueues device work) back to back, synchronising after batches that
    double in size, until `seconds` have passed; the first call in the process only (later
    calls return 0.0). Returns the seconds spent."""
    global _warmup_spent
    if _warmup_spent is not None or seconds <= 0:
        return 0.0
    t0 = time.perf_counter()
    n = 1
    while True:
        for _ in range(n):
            step()
        sync()
        spent = time.perf_counter() - t0
        if spent >= seconds:
            _warmup_spent = spent
            return spent
        n = min(2 * n, 1 << 14)


def settle(seconds: float = SETTLE_S, cycles: int = 2_000_000) -> float:
    """Keeps the CUDA device busy with light work (one spin kernel at a time, torch.cuda._sleep
    of `cycles` clock cycles, about a millisecond) for `seconds`; returns the seconds spent.
    A small kernel timed right after a heavy measurement (the ceilings' full-power matmul) reads
    slow for a while (H200: a bs 1 tree build, one call, 22.7-24.3 us against 15.4 after a
    second of this). Without torch.cuda._sleep (a private torch function) it waits idle for
    `seconds` instead, which measured about the same there (15.3-15.4 us)."""
    import torch

    t0 = time.perf_counter()
    spin = getattr(torch.cuda, "_sleep", None)
    if spin is None:
        time.sleep(seconds)
        return time.perf_counter() - t0
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            spin(cycles)
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def summarize(samples: Sequence[float]) -> dict:
    """{median, min, p10, p90, mean, n} of samples (seconds); percentiles interpolate linearly."""
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"summarize: samples must be a non-empty 1-D sequence, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"summarize: samples contain a non-finite value: {x[~np.isfinite(x)][:3]}")
    p10, med, p90 = np.percentile(x, [10.0, 50.0, 90.0])
    return {
        "median": float(med),
        "min": float(x.min()),
        "p10": float(p10),
        "p90": float(p90),
        "mean": float(x.mean()),
        "n": int(x.size),
    }


def _check_counts(where: str, warmup: int, reps: int) -> None:
    if warmup < 0:
        raise ValueError(f"{where}: warmup must be >= 0, got {warmup}")
    if reps < 1:
        raise ValueError(f"{where}: reps must be >= 1, got {reps}")


def time_cpu(fn: Callable[[], object], warmup: int = 2, reps: int = 10,
             budget_s: float | None = None, min_reps: int = 3) -> list[float]:
    """Samples (s) of `fn()` timed with the monotonic clock, after `warmup` untimed calls.

    With `budget_s`, stops after the rep that brings the timed total past the budget, but never
    before `min_reps` samples (so slow cases still give the compare step some noise to see).
    """
    _check_counts("time_cpu", warmup, reps)
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    total = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        samples.append(dt)
        total += dt
        if budget_s is not None and total >= budget_s and len(samples) >= min_reps:
            break
    return samples


def cpu_states(fn: Callable[[], object], runs: int = 100, calls: int = 50,
               budget_s: float = 0.1) -> dict:
    """`runs` runs of `calls` calls of `fn()` back to back (the monotonic clock around each call),
    stopping after the run that brings the timed total past `budget_s` (at least one run):
    {"fast": the median of the run medians within FAST_STATE_SPAN of the least, "slow": the
    greatest run median, "calls": calls, "medians": each run's median} in seconds."""
    _check_counts("cpu_states", 0, runs)
    _check_counts("cpu_states", 0, calls)
    medians: list[float] = []
    total = 0.0
    for _ in range(runs):
        s = time_cpu(fn, warmup=0, reps=calls)
        medians.append(float(np.median(s)))
        total += sum(s)
        if total >= budget_s:
            break
    return _states(medians, calls)


def _states(medians: list[float], calls: int, **extra) -> dict:
    """cpu_states' record from its run medians (and any extra fields)."""
    fast = [m for m in medians if m <= FAST_STATE_SPAN * min(medians)]
    return {"fast": float(np.median(fast)), "slow": max(medians), "calls": calls,
            "medians": medians, **extra}


class CpuStateRounds:
    """A suite's CPU calls measured again between its later cases, so that each call's runs
    (cpu_states) spread over the suite's minutes instead of a tenth of a second.

    The host's state holds for seconds: on the H100 machine's host, bs 1 tree builds timed for
    20 s in runs of 50 calls stayed in one state for up to ~900 runs (~5 s); any 100 consecutive
    runs missed its fast state (read a fast figure over 1.25x the whole series') 35-36% of the
    time, any 400 runs 16-20% (budget 15: 3.5 us fast, up to 6.0 us read; budget 63: 5.2, up to
    10.4). `track` takes a record whose cpu_states a case has just measured, when one run of its
    calls is cheap (<= max_run_s); `round` adds up to `runs` runs, within `budget_s`, to every
    tracked record (its cpu_states recomputed over all its runs, with `rounds` and `span_s`, the
    seconds from its first run to its last) and returns how many records it measured."""

    def __init__(self, runs: int = 10, budget_s: float = 0.02, max_run_s: float = 0.005):
        _check_counts("CpuStateRounds", 0, runs)
        self.runs = runs
        self.budget_s = budget_s
        self.max_run_s = max_run_s
        self._tracked: list[tuple[Callable[[], object], dict, Callable, object, float]] = []

    def track(self, fn: Callable[[], object], rec: dict,
              context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
              keep: object = None) -> bool:
        """Tracks rec (its cpu_states just measured of fn) when a run is cheap; `context()` is
        entered around each later round's runs (the algorithm's environment, say), and `keep`
        (what fn's call needs alive: a bench.native_calls.Prepared, whose run holds raw
        pointers to its buffers) is held as long as the rounds."""
        st = rec.get("cpu_states")
        if not st or st["calls"] * min(st["medians"]) > self.max_run_s:
            return False
        self._tracked.append((fn, rec, context, keep, time.monotonic()))
        return True

    def round(self) -> int:
        for fn, rec, context, _, t0 in self._tracked:
            old = rec["cpu_states"]
            with context():
                more = cpu_states(fn, runs=self.runs, calls=old["calls"], budget_s=self.budget_s)
            rec["cpu_states"] = _states(old["medians"] + more["medians"], old["calls"],
                                        rounds=old.get("rounds", 1) + 1,
                                        span_s=time.monotonic() - t0)
        return len(self._tracked)


def l2_flush_bytes(device=None) -> int:
    """Bytes of the L2-flush buffer for a CUDA device: twice its L2 (at least 64 MiB)."""
    import torch

    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    return max(2 * l2, 64 << 20)


def time_cuda(fn: Callable[[], object], warmup: int = 5, reps: int = 50, flush_l2: bool = True,
              budget_s: float | None = None, min_reps: int = 3) -> list[float]:
    """Samples (s) of `fn()` between two CUDA events on the current stream.

    `fn` must only enqueue work (no host synchronisation inside, or the sample includes it, which
    is right for paths that sync by design). With `flush_l2`, a buffer of 2x L2 is zero-filled
    before each rep, outside the events. The reps are enqueued back to back without host syncs
    (so a small kernel's launch overhead hides behind the flush or the previous rep); with
    `budget_s`, their number is cut to fit the budget, estimated from the first warm-up call,
    and a call slower than half the budget gets no further warm-up.
    """
    import torch

    _check_counts("time_cuda", warmup, reps)
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda: torch reports no CUDA device (use time_cpu on this machine)")
    flush = None
    if flush_l2:
        flush = torch.empty(l2_flush_bytes() // 4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    _warm_once(fn, torch.cuda.synchronize)
    for i in range(warmup):
        if flush is not None:
            flush.zero_()
        t0 = time.perf_counter()
        fn()
        if i == 0 and budget_s is not None:
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            reps = max(min(reps, min_reps), min(reps, int(budget_s / max(first, 1e-7))))
            if first > budget_s / 2:
                break
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e-3 for s, e in pairs]  # elapsed_time is in ms
    if not all(math.isfinite(v) and v >= 0 for v in samples):
        raise RuntimeError(f"time_cuda: events returned invalid times {samples[:4]}")
    return samples


def time_cuda_graph(fn: Callable[[], object], calls: int = 20, reps: int = 20,
                    warmup: int = 2, budget_s: float | None = None, call_s: float | None = None,
                    min_reps: int = 3, stats: dict | None = None) -> list[float]:
    """Samples (s per call) of `fn()` as the kernel alone: `calls` calls captured in one CUDA
    graph (torch.cuda.CUDAGraph, on torch's current stream), replayed `reps` times between CUDA
    events, each sample the replay's time divided by `calls`. No L2 flush (the calls run back to
    back, as a step's kernels do). `fn` must launch its work on torch's current stream (set it
    with `torch.cuda.stream(...)` before preparing the call: capture refuses the legacy stream),
    with no host synchronisation and no allocation inside.

    With `budget_s` the counts adapt to the call's time (`call_s`, else the first call's,
    synchronised): `calls` shrinks so that the warm-up and timed replays fit the budget (at
    least 1), then `reps` too (at least `min_reps`), so a slow call costs about `budget_s` and
    a fast one keeps the full counts. `stats`, when given, receives {"calls", "reps"}.
    """
    import torch

    _check_counts("time_cuda_graph", warmup, reps)
    if calls < 1:
        raise ValueError(f"time_cuda_graph: calls must be >= 1, got {calls}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"time_cuda_graph: budget_s must be > 0, got {budget_s}")
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda_graph: torch reports no CUDA device")
    if torch.cuda.current_stream() == torch.cuda.default_stream():
        raise RuntimeError("time_cuda_graph: capture needs a side stream: prepare and time the "
                           "call inside `with torch.cuda.stream(torch.cuda.Stream()):`")
    t0 = time.perf_counter()
    fn()  # first-call setup (function attributes, workspaces) outside the capture
    torch.cuda.current_stream().synchronize()
    first = time.perf_counter() - t0
    torch.cuda.empty_cache()  # its cached temporaries would sit beside the graph's private pool
    if budget_s is not None:
        c = max(call_s if call_s is not None else first, 1e-7)
        calls = max(1, min(calls, int(budget_s / ((reps + warmup) * c))))
        reps = max(min(reps, min_reps), min(reps, int(budget_s / (calls * c)) - warmup))
    from engine.native.capture import gc_paused

    graph = torch.cuda.CUDAGraph()
    with gc_paused():  # no finaliser's cudaFree inside the capture
        graph.capture_begin()
        try:
            for _ in range(calls):
                fn()
        finally:
            graph.capture_end()
    _warm_once(graph.replay, torch.cuda.current_stream().synchronize)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.current_stream().synchronize()
    pairs = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        pairs.append((start, end))
    torch.cuda.current_stream().synchronize()
    samples = [s.elapsed_time(e) * 1e-3 / calls for s, e in pairs]
    if not all(math.isfinite(v) and v >= 0 for v in samples):
        raise RuntimeError(f"time_cuda_graph: events returned invalid times {samples[:4]}")
    del graph
    if stats is not None:
        stats.update(calls=calls, reps=reps)
    return samples
