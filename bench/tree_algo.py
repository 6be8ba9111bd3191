"""Which tree-build algorithm the library runs (KDT_TREE_BUILD, read per call), and the side
stream the kernel-alone timing needs (graph capture refuses the legacy default stream).

CUDA: "auto" (the default: the one-warp build up to budget 31, the block-parallel one above),
"parallel" (the block-parallel build at every budget) and "serial" (the earlier kernel, kept as the
reference path); "warp" (the one-warp build at budgets up to 1023) equals "auto" up to 31 and
is timed above that by bench/tree_goals.py only. CPU: "serial" (the backend's binary heap; the
parallel algorithm's CPU emulation is a test path, not a fast one).
"""

from __future__ import annotations

import contextlib
import os

ALGOS = {"cuda": ("auto", "parallel", "serial"), "cpu": ("serial",)}


@contextlib.contextmanager
def env(name: str, value: str):
    """os.environ[name] = value inside the block, the previous value (or none) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def tree_algo(mode: str):
    """KDT_TREE_BUILD=mode inside the block (see env)."""
    return env("KDT_TREE_BUILD", mode)


def side_stream(device: str):
    """A context that makes a fresh CUDA stream torch's current one (CUDA), or does nothing."""
    if device != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(torch.cuda.Stream())
