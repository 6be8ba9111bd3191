"""Finding and loading libkdtree.so, its ctypes signatures, and argument marshalling.

Everything that touches ctypes lives here, so that the kernel wrappers (`tree.py`,
`attention.py`, `engine.py`) stay a few lines each:

- `library()` loads the library once: `KDTREE_LIB` (a path to libkdtree.so) if set, else the
  newest `build/*/libkdtree.so` under the repository root; it raises `LibraryNotFound` with the
  build command when there is none. The result has `.path`, `.build_info` (the parsed
  build_info.json beside it, or {}), `.has_cuda`, `.cuda_device_count()`, and `.check()`.
- `Call` collects one call's arguments: every input goes through `Call.input` (dtype, shape,
  contiguity and device checks, one place, errors naming the argument), outputs are allocated
  like the inputs (numpy in -> numpy out, torch in -> torch out on the same device). With
  device="cuda" and numpy inputs, buffers go through the library's device helpers
  (kdt_device_alloc / kdt_memcpy_*), so neither torch nor cudart is needed.
- A nonzero kdt_status becomes `NativeError` carrying the status and `kdt_last_error()`.
"""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_HINT = "bash cuda/build.sh --arch cpu --out build/cpu  (or --arch sm_90 / native for CUDA)"

BACKEND_CPU = 0
BACKEND_CUDA = 1

STATUS_NAMES = {
    0: "KDT_OK",
    1: "KDT_ERR_INVALID_ARGUMENT",
    2: "KDT_ERR_UNSUPPORTED",
    3: "KDT_ERR_CUDA",
    4: "KDT_ERR_IO",
    5: "KDT_ERR_FORMAT",
    6: "KDT_ERR_OUT_OF_MEMORY",
    7: "KDT_ERR_INTERNAL",
}


class NativeError(RuntimeError):
    """A libkdtree entry point returned a nonzero kdt_status; the message is kdt_last_error()."""

    def __init__(self, fn: str, status: int, message: str):
        self.fn = fn
        self.status = status
        name = STATUS_NAMES.get(status, f"status {status}")
        super().__init__(f"{fn}: {name}: {message}")


class LibraryNotFound(FileNotFoundError):
    """No libkdtree.so where KDTREE_LIB or build/*/ point; the message says how to build one."""


# ---------------------------------------------------------------- finding and loading

_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_SIG = {
    # name: (restype, argtypes); pointers are passed as c_void_p (plain integers).
    "kdt_last_error": (ctypes.c_char_p, []),
    "kdt_version": (ctypes.c_char_p, []),
    "kdt_has_cuda": (ctypes.c_int, []),
    "kdt_sync_count": (ctypes.c_uint64, []),
    "kdt_cuda_device_count": (ctypes.c_int, []),
    "kdt_device_alloc": (ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
    "kdt_device_free": (ctypes.c_int, [_P]),
    "kdt_memcpy_htod": (ctypes.c_int, [_P, _P, ctypes.c_size_t]),
    "kdt_memcpy_dtoh": (ctypes.c_int, [_P, _P, ctypes.c_size_t]),
    "kdt_device_synchronize": (ctypes.c_int, []),
    # (backend, stream, bs, L, K, budget, top_logp, top_ids, root_ids, seq_lens, tokens,
    #  parents, depths, positions, first_child, next_sibling, visibility, num_nodes, scores)
    "kdt_tree_build": (ctypes.c_int, [ctypes.c_int, _P, _I32, _I32, _I32, _I32] + [_P] * 13),
    # (backend, stream, bs, n, tokens, first_child, next_sibling, num_nodes, target_argmax,
    #  accept_index, accept_len, bonus, status)
    "kdt_tree_accept": (ctypes.c_int, [ctypes.c_int, _P, _I32, _I32] + [_P] * 9),
    # (backend, stream, bs, L, K, V, quality, q_mid, log_p0, rest_c, spread, table, table_rows,
    #  cols, seeds, rows, lengths, top_logp, top_ids)
    # (backend, stream, bs, n, D, max_seq, scratch_slot, rows, prefix, tokens, num_nodes,
    #  accept_index, accept_len, bonus, hidden, hidden_ctx, next_root, result)
    "kdt_round_finish": (ctypes.c_int, [ctypes.c_int, _P] + [_I32] * 5 + [_P] * 11),
    "kdt_oracle_draft": (ctypes.c_int, [ctypes.c_int, _P, _I32, _I32, _I32, _I32]
                         + [ctypes.c_double] * 5 + [_P, _I32, _I32] + [_P] * 5),
}


def find_library_path() -> Path:
    env = os.environ.get("KDTREE_LIB")
    if env:
        p = Path(env)
        if not p.is_file():
            raise LibraryNotFound(f"KDTREE_LIB={env}: no such file (build it with: {BUILD_HINT})")
        return p
    found = sorted(REPO_ROOT.glob("build/*/libkdtree.so"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise LibraryNotFound(
            f"no libkdtree.so under {REPO_ROOT / 'build'} and KDTREE_LIB is not set; "
            f"build it with: {BUILD_HINT}"
        )
    return found[-1]


@dataclass
class Library:
    path: Path
    cdll: ctypes.CDLL
    build_info: dict = field(default_factory=dict)

    @property
    def has_cuda(self) -> bool:
        return bool(self.cdll.kdt_has_cuda())

    @property
    def version(self) -> str:
        return self.cdll.kdt_version().decode()

    def sync_count(self) -> int:
        """How many times the library has waited for the device so far (kdt_sync_count)."""
        return int(self.cdll.kdt_sync_count())

    def cuda_device_count(self) -> int:
        return int(self.cdll.kdt_cuda_device_count())

    def last_error(self) -> str:
        return self.cdll.kdt_last_error().decode(errors="replace")

    def check(self, fn: str, status: int) -> None:
        if status != 0:
            raise NativeError(fn, status, self.last_error())

    def call(self, fn: str, *args) -> None:
        self.check(fn, getattr(self.cdll, fn)(*args))


_LIBRARY: Library | None = None


def load(path: Path) -> Library:
    cdll = ctypes.CDLL(str(path))
    for name, (res, argtypes) in _SIG.items():
        f = getattr(cdll, name, None)
        if f is None:
            continue  # an older library without this entry point; calling it raises below
        f.restype = res
        f.argtypes = argtypes
    info_path = path.parent / "build_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    return Library(path=path, cdll=cdll, build_info=info)


def library() -> Library:
    """The loaded libkdtree (loaded once per process)."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = load(find_library_path())
    return _LIBRARY


# ---------------------------------------------------------------- argument marshalling


def _torch():
    import torch  # lazy: numpy-only callers never import torch

    return torch


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


class DeviceBuffer:
    """Device memory from kdt_device_alloc, freed by close() (or when collected)."""

    def __init__(self, lib: Library, nbytes: int):
        self.lib = lib
        self.nbytes = nbytes
        ptr = ctypes.c_void_p()
        lib.call("kdt_device_alloc", ctypes.byref(ptr), nbytes)
        self.ptr = ptr.value or 0

    def close(self) -> None:
        if self.ptr:
            self.lib.cdll.kdt_device_free(self.ptr)
            self.ptr = 0

    def __del__(self):
        self.close()


class Call:
    """One native call's arguments: checked inputs, outputs allocated like the inputs.

    device: "cpu" or "cuda". Inputs are all numpy arrays or all torch tensors (one kind per
    call). numpy with "cuda" copies through DeviceBuffer; torch CUDA tensors are used in place
    on torch's current stream.
    """

    def __init__(self, lib: Library, fn: str, device: str):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{fn}: device={device!r} must be 'cpu' or 'cuda'")
        if device == "cuda" and not lib.has_cuda:
            raise NativeError(fn, 2, f"device='cuda' but {lib.path} is a CPU-only build "
                                     "(rebuild with cuda/build.sh --arch sm_90 or native)")
        self.lib, self.fn, self.device = lib, fn, device
        self.kind: str | None = None  # "numpy" | "torch"
        self.torch_device = None
        self._keep: list = []  # arrays and buffers that must outlive the call
        self._outputs: dict = {}  # name -> (host array or tensor, DeviceBuffer or None)

    @property
    def backend(self) -> int:
        return BACKEND_CUDA if self.device == "cuda" else BACKEND_CPU

    @property
    def stream(self):
        if self.device == "cuda" and self.kind == "torch":
            return _torch().cuda.current_stream(self.torch_device).cuda_stream
        return None  # the legacy default stream (ordered with kdt_memcpy_*)

    def _set_kind(self, name: str, x) -> None:
        kind = "torch" if _is_torch(x) else "numpy" if isinstance(x, np.ndarray) else None
        if kind is None:
            raise TypeError(f"{self.fn}: {name}: expected a numpy array or a torch tensor, "
                            f"got {type(x).__name__}")
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            raise TypeError(f"{self.fn}: {name} is a {kind} input but earlier inputs are "
                            f"{self.kind}: pass all numpy arrays or all torch tensors")
        if kind == "torch":
            dev = x.device
            if self.device == "cpu" and dev.type != "cpu":
                raise ValueError(f"{self.fn}: {name} is on {dev} but device='cpu'")
            if self.device == "cuda" and dev.type != "cuda":
                raise ValueError(f"{self.fn}: {name} is on {dev} but device='cuda' takes CUDA "
                                 "tensors or numpy arrays")
            if self.torch_device is None:
                self.torch_device = dev
            elif dev != self.torch_device:
                raise ValueError(f"{self.fn}: {name} is on {dev}, earlier inputs on "
                                 f"{self.torch_device}")

    def input(self, name: str, x, dtype, shape: tuple) -> int:
        """Check x (dtype, shape, C-contiguous, device) and return its data pointer."""
        self._set_kind(name, x)
        dtype = np.dtype(dtype)
        if self.kind == "numpy":
            if x.dtype != dtype:
                raise ValueError(f"{self.fn}: {name}: dtype {x.dtype}, expected {dtype}")
        else:
            want = _torch_dtype(dtype)
            if x.dtype != want:
                raise ValueError(f"{self.fn}: {name}: dtype {x.dtype}, expected {want}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{self.fn}: {name}: shape {tuple(x.shape)}, expected {tuple(shape)}")
        contiguous = x.flags["C_CONTIGUOUS"] if self.kind == "numpy" else x.is_contiguous()
        if not contiguous:
            raise ValueError(f"{self.fn}: {name}: not C-contiguous (use np.ascontiguousarray "
                             "or .contiguous())")
        if self.kind == "numpy" and self.device == "cuda":
            buf = DeviceBuffer(self.lib, x.nbytes)
            self.lib.call("kdt_memcpy_htod", buf.ptr, x.ctypes.data, x.nbytes)
            self._keep.append(buf)
            return buf.ptr
        self._keep.append(x)
        return x.ctypes.data if self.kind == "numpy" else x.data_ptr()

    def output(self, name: str, dtype, shape: tuple) -> int:
        """Allocate an output like the inputs and return its pointer (uninitialised memory:
        the kernels write every element)."""
        dtype = np.dtype(dtype)
        if self.kind == "torch":
            t = _torch().empty(shape, dtype=_torch_dtype(dtype), device=self.torch_device)
            self._outputs[name] = (t, None)
            return t.data_ptr()
        a = np.empty(shape, dtype)
        if self.device == "cuda":
            buf = DeviceBuffer(self.lib, a.nbytes)
            self._outputs[name] = (a, buf)
            return buf.ptr
        self._outputs[name] = (a, None)
        return a.ctypes.data

    def run(self, *args) -> dict:
        """Call self.fn with args, then return {name: output} (copied home for numpy+cuda)."""
        self.lib.call(self.fn, *args)
        out = {}
        for name, (a, buf) in self._outputs.items():
            if buf is not None:
                self.lib.call("kdt_memcpy_dtoh", a.ctypes.data, buf.ptr, a.nbytes)
                buf.close()
            out[name] = a
        for k in self._keep:
            if isinstance(k, DeviceBuffer):
                k.close()
        self._keep.clear()
        return out


def _torch_dtype(dtype: np.dtype):
    torch = _torch()
    table = {
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float64): torch.float64,
        np.dtype(np.int32): torch.int32,
        np.dtype(np.int64): torch.int64,
        np.dtype(np.uint32): torch.uint32,
        np.dtype(np.uint8): torch.uint8,
    }
    if dtype not in table:
        raise TypeError(f"no torch dtype for numpy dtype {dtype}")
    return table[dtype]


# ---------------------------------------------------------------- building (tests, tools)


def build_if_stale(arch: str = "cpu", out: Path | None = None) -> Path:
    """Run cuda/build.sh --arch ARCH --out OUT when OUT/libkdtree.so is missing or older than
    any file under cuda/src or cuda/include; return the library path. A file lock keeps
    concurrent test sessions from building into the same folder at once. Raises RuntimeError
    with the build's output tail when the build fails."""
    import fcntl
    import subprocess

    out = out or REPO_ROOT / "build" / arch
    out.mkdir(parents=True, exist_ok=True)
    lib = out / "libkdtree.so"
    with open(out / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sources = [p for d in ("cuda/src", "cuda/include", "cuda/tests", "cuda/bench")
                   for p in (REPO_ROOT / d).rglob("*") if p.is_file()]
        newest = max((p.stat().st_mtime for p in sources), default=0.0)
        if lib.is_file() and lib.stat().st_mtime >= newest:
            return lib
        cmd = ["bash", str(REPO_ROOT / "cuda" / "build.sh"), "--arch", arch, "--out", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stdout + r.stderr)[-3000:]
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {r.returncode}:\n{tail}")
    return lib
