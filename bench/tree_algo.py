"""Which tree-build algorithm the library runs (KDT_TREE_BUILD, read per call), and the side
stream the kernel-alone timing needs (graph capture refuses the legacy default stream).

CUDA: "auto" (the default: the one-warp build up to budget 255, the block-parallel one above),
"parallel" (the block-parallel build at every budget) and "serial" (the earlier kernel, kept as the
reference path); "warp" (the one-warp build at budgets up to 1023) equals "auto" up to 255 and
is timed above that by bench/tree_goals.py only. CPU: "serial" (the backend's binary heap; the parallel algorithm's CPU emulation is a
test path, not a fast one).
"""

from __future__ import annotations

import contextlib
import os

ALGOS = {"cuda": ("auto", "parallel", "serial"), "cpu": ("serial",)}


@contextlib.contextmanager
def tree_algo(mode: str):
    """KDT_TREE_BUILD=mode inside the block, the previous value (or none) after it."""
    old = os.environ.get("KDT_TREE_BUILD")
    os.environ["KDT_TREE_BUILD"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KDT_TREE_BUILD", None)
        else:
            os.environ["KDT_TREE_BUILD"] = old


def side_stream(device: str):
    """A context that makes a fresh CUDA stream torch's current one (CUDA), or does nothing."""
    if device != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.Stream())
