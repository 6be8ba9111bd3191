"""ctypes bindings to cuda/'s libkdtree.so: the CPU and CUDA backends of the DDTree kernels.

- `build_tree(..., device=)`, `accept_greedy(tree, target_argmax, device=)`: `tree.py`.
- `verify_attention(...)`: `attention.py`; `Engine`: `engine.py` (imported on first use).
- `library()`: the loaded library (`.path`, `.build_info`); `NativeError`, `LibraryNotFound`.
See docs/DEVELOPING.md ("The native library", "Python APIs").
"""

from __future__ import annotations

from ._lib import LibraryNotFound, NativeError, library
from .tree import accept_greedy, build_tree

__all__ = ["Engine", "LibraryNotFound", "NativeError", "accept_greedy", "build_tree",
           "library", "verify_attention"]


def __getattr__(name: str):
    # Lazy: these modules belong to other parts of the engine and import heavier things.
    if name == "verify_attention":
        from .attention import verify_attention

        return verify_attention
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module 'engine.native' has no attribute {name!r}")
