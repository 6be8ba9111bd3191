"""bench.timing: summaries against numpy, call counts and budgets of the timers (no timed
assertions: the clock's values are not checked, only how the helpers use it)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import timing


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=1e-9, max_value=10.0, allow_nan=False), min_size=1, max_size=60))
def test_summarize_matches_numpy(samples):
    s = timing.summarize(samples)
    x = np.asarray(samples)
    assert s["n"] == len(samples)
    assert s["min"] == x.min()
    assert s["median"] == pytest.approx(np.median(x), rel=1e-12)
    assert s["p10"] == pytest.approx(np.percentile(x, 10), rel=1e-12)
    assert s["p90"] == pytest.approx(np.percentile(x, 90), rel=1e-12)
    assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= x.max()


@pytest.mark.parametrize("bad", [[], [float("nan")], [1.0, float("inf")]])
def test_summarize_rejects_bad_samples(bad):
    with pytest.raises(ValueError, match="summarize"):
        timing.summarize(bad)


def test_time_cpu_calls_warmup_plus_reps():
    calls = []
    s = timing.time_cpu(lambda: calls.append(1), warmup=3, reps=7)
    assert len(calls) == 10 and len(s) == 7
    assert all(v >= 0 for v in s)


def test_device_warmup_runs_doubling_batches_until_the_time_is_spent_once(monkeypatch):
    monkeypatch.setattr(timing, "_warmup_spent", None)
    t = iter([0.0, 0.3, 0.6, 0.9, 1.2])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(t))
    steps, syncs = [], []
    spent = timing._warm_once(lambda: steps.append(1), lambda: syncs.append(1), seconds=1.0)
    # batches of 1, 2, 4, 8 calls, a sync after each, until the clock passes 1 s
    assert (len(steps), len(syncs), spent) == (15, 4, 1.2)
    assert timing.device_warmup_s() == 1.2
    # once per process: a second call does nothing (the clock iterator is spent: not read)
    assert timing._warm_once(lambda: steps.append(1), lambda: syncs.append(1)) == 0.0
    assert (len(steps), len(syncs)) == (15, 4)


def test_device_warmup_zero_seconds_is_off(monkeypatch):
    monkeypatch.setattr(timing, "_warmup_spent", None)
    calls = []
    assert timing._warm_once(lambda: calls.append(1), lambda: calls.append(2), seconds=0.0) == 0.0
    assert calls == [] and timing.device_warmup_s() is None


def test_time_cpu_budget_stops_early_but_keeps_min_reps(monkeypatch):
    # A fake clock that advances 1 s per reading: every call "takes" 1 s.
    t = iter(range(10_000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(t)))
    s = timing.time_cpu(lambda: None, warmup=0, reps=100, budget_s=2.5, min_reps=5)
    assert s == [1.0] * 5  # the budget passed after 3, min_reps holds it to 5
    s = timing.time_cpu(lambda: None, warmup=0, reps=100, budget_s=2.5, min_reps=1)
    assert len(s) == 3


def _fake_call_clock(monkeypatch, durations):
    """perf_counter readings in pairs around each call: each call takes the next duration (s)."""
    it = iter(durations)
    clock = {"t": 0.0, "open": False}

    def perf_counter():
        if clock["open"]:
            clock["t"] += next(it)
        clock["open"] = not clock["open"]
        return clock["t"]

    monkeypatch.setattr(timing.time, "perf_counter", perf_counter)


def test_cpu_states_gives_each_runs_median_and_the_fast_states(monkeypatch):
    # A fake clock: runs of four calls; the second is a slow stretch (5 s a call, as the host's
    # state gives), the others fast, at 3 or 3.5 s: the fast state is their median.
    _fake_call_clock(monkeypatch, [3, 3, 3, 3, 5, 5, 3, 5, 3.5, 3.5, 3.5, 3.5, 3, 3.5, 3.5, 3.5])
    st = timing.cpu_states(lambda: None, runs=4, calls=4, budget_s=1e9)
    assert st == {"fast": 3.5, "slow": 5.0, "calls": 4, "medians": [3.0, 5.0, 3.5, 3.5]}


def test_cpu_states_stops_at_the_budget_after_a_whole_run(monkeypatch):
    t = iter(range(10_000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(t)))  # 1 s a call
    st = timing.cpu_states(lambda: None, runs=40, calls=3, budget_s=5.0)
    assert st["medians"] == [1.0, 1.0]  # 3 s, then 6 s: past the budget after the second run
    with pytest.raises(ValueError, match="cpu_states"):
        timing.cpu_states(lambda: None, runs=0)


def test_cpu_state_rounds_find_the_fast_state_a_case_missed(monkeypatch):
    # The case's own runs all fall in a slow stretch (5 s a call); a later round finds the fast
    # state (3 s): the record's fast figure becomes 3, over every run, inside the context.
    _fake_call_clock(monkeypatch, [5, 5, 5, 5] + [3, 3, 3, 3])
    mono = iter([10.0, 17.5])
    monkeypatch.setattr(timing.time, "monotonic", lambda: next(mono))
    inside = []

    @contextlib.contextmanager
    def context():
        inside.append(True)
        yield
        inside.append(False)

    calls = []
    fn = lambda: calls.append(bool(inside) and inside[-1])  # noqa: E731
    rec = {"cpu_states": timing.cpu_states(fn, runs=2, calls=2, budget_s=1e9)}
    assert rec["cpu_states"]["fast"] == 5.0
    rounds = timing.CpuStateRounds(runs=2, budget_s=1e9, max_run_s=100.0)
    assert rounds.track(fn, rec, context)
    assert rounds.round() == 1
    assert rec["cpu_states"] == {"fast": 3.0, "slow": 5.0, "calls": 2,
                                 "medians": [5.0, 5.0, 3.0, 3.0], "rounds": 2, "span_s": 7.5}
    assert calls == [False] * 4 + [True] * 4  # the round's calls ran inside the context
    assert inside[-1] is False


def test_cpu_state_rounds_leave_expensive_or_stateless_records_alone(monkeypatch):
    _fake_call_clock(monkeypatch, [2.0] * 4)
    rec = {"cpu_states": timing.cpu_states(lambda: None, runs=2, calls=2, budget_s=1e9)}
    rounds = timing.CpuStateRounds(runs=2, budget_s=1e9, max_run_s=3.0)  # a run takes 4 s
    assert not rounds.track(lambda: None, rec)
    assert not rounds.track(lambda: None, {"summary": {}})  # no cpu_states: a CUDA record
    before = dict(rec["cpu_states"])
    assert rounds.round() == 0
    assert rec["cpu_states"] == before
    with pytest.raises(ValueError, match="CpuStateRounds"):
        timing.CpuStateRounds(runs=0)


@pytest.mark.parametrize("warmup,reps", [(-1, 3), (0, 0)])
def test_time_cpu_rejects_bad_counts(warmup, reps):
    with pytest.raises(ValueError, match="time_cpu"):
        timing.time_cpu(lambda: None, warmup=warmup, reps=reps)


def test_time_cuda_without_gpu_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the no-GPU error path cannot be exercised")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        timing.time_cuda(lambda: None, warmup=0, reps=1)


@pytest.mark.cuda
def test_time_cuda_samples_on_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    x = torch.ones(1 << 20, device="cuda")
    s = timing.time_cuda(lambda: x.mul_(1.0), warmup=2, reps=9, flush_l2=True)
    assert len(s) == 9 and all(v > 0 for v in s)


def test_time_cuda_graph_rejects_bad_budget():
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        timing.time_cuda_graph(lambda: None, budget_s=0.0)


@pytest.mark.cuda
def test_time_cuda_graph_adapts_counts_to_the_budget():
    """A fast call keeps the full counts; a call that alone fills the budget gets one call per
    graph and the minimum of replays; the samples are per call either way."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    x = torch.ones(1 << 20, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        fast, slow = {}, {}
        s = timing.time_cuda_graph(lambda: x.mul_(1.0), calls=20, reps=5, budget_s=1.0,
                                   call_s=1e-6, stats=fast)
        assert fast == {"calls": 20, "reps": 5} and len(s) == 5 and min(s) > 0
        s = timing.time_cuda_graph(lambda: x.mul_(1.0), calls=20, reps=5, budget_s=1e-3,
                                   call_s=1e-3, min_reps=3, stats=slow)
        assert slow == {"calls": 1, "reps": 3} and len(s) == 3 and min(s) > 0


def test_settle_spins_the_device_in_batches_until_the_time_is_spent(monkeypatch):
    torch = pytest.importorskip("torch")
    t = iter([0.0, 0.0, 0.4, 0.8, 1.2, 1.3])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(t))
    spins, syncs = [], []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: spins.append(cycles), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    spent = timing.settle(seconds=1.0, cycles=123)
    # a batch of 20 spins and a sync per loop while the clock reads < 1 s: three batches
    assert (len(spins), len(syncs), spent) == (60, 3, 1.3)
    assert set(spins) == {123}


def test_settle_without_a_spin_kernel_waits_idle(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delattr(torch.cuda, "_sleep", raising=False)
    slept = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: slept.append(s))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: pytest.fail("no device work to wait on"))
    timing.settle(seconds=0.25)
    assert slept == [0.25]
