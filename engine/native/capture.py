"""What a CUDA graph capture needs from Python: no garbage collection inside it.

A collection during a capture can finalise an unreachable Engine or DeviceBuffer (one held in a
reference cycle, which only the cyclic collector frees), and their cudaFree is not permitted
while a stream captures: the capture is invalidated (cudaErrorStreamCaptureInvalidated) and the
next CUDA call in it fails. On the H200 that took down the seventh Engine of one process, on its
first captured round (tests/test_native_round.py with the oracle drafter: 7 runs of the test in
one process, twice). `gc_paused` collects once, then keeps the collector off for the block;
memory freed by reference counting inside it is unaffected.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Collect now, then run the block with automatic collection off (restored after)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
