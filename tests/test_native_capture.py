"""engine.native.capture.gc_paused: what a CUDA graph capture needs from Python's collector (the
GPU case, an engine left to the collector during a capture, is in test_native_round.py)."""

from __future__ import annotations

import gc

import pytest

from engine.native.capture import gc_paused


class _Finalised:
    """An object in a reference cycle (only the cyclic collector frees it) that records its
    finalisation, as an Engine's close() would free device memory."""

    def __init__(self, log):
        self.log, self.cycle = log, self

    def __del__(self):
        self.log.append("freed")


def test_gc_paused_frees_waiting_garbage_first_then_keeps_the_collector_off():
    log = []
    threshold = gc.get_threshold()
    gc.set_threshold(10**9)  # nothing collects but what the test asks for
    try:
        _Finalised(log)
        assert log == []
        with gc_paused():
            assert log == ["freed"], "the garbage waiting at entry must go before the block"
            assert not gc.isenabled()
            _Finalised(log)
            gc.set_threshold(1)
            [[] for _ in range(1000)]  # allocations: with the collector on, a collection
            assert log == ["freed"], "nothing is collected inside the block"
        assert gc.isenabled()
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    assert log == ["freed", "freed"]


def test_gc_paused_restores_the_collector_after_an_error_and_leaves_it_off_if_it_was():
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
