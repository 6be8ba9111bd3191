"""KDTR bundles: named tensors plus metadata in one safetensors file (ARCHITECTURE.md).

A bundle checks one kernel on one case. Metadata (all strings in the file): `format` = "kdtr",
`version` = "1", `kernel`, `case` (a JSON object of the case's parameters); other string keys
(e.g. `seed`) are kept. Inputs use the kernel's argument names, expected outputs the prefix
`expected.` (docs/DEVELOPING.md has the table per kernel).

Tensors in Python: numpy arrays for every dtype numpy has (F64 F32 F16 I64 I32 I16 I8 U64 U32
U16 U8 BOOL). BF16 has no numpy dtype, so a BF16 tensor travels as a CPU `torch.bfloat16`
tensor, in `save` and in what `load` returns; `to_bf16` / `bf16_to_f64` convert. On disk BF16
is the raw 16-bit pattern (little endian), which is what the native reader reads.

`load` validates the whole file itself (header length, JSON, metadata, every tensor's dtype,
shape and byte range, contiguity) before the safetensors library sees it, so a corrupted file
raises `KdtrError` naming the file and the defect, never anything else.

CLI: `python -m engine.kdtr generate --out DIR [--quick] [--seed S]` writes the golden cases
(engine/kdtr/cases.py) to DIR/<kernel>/<case>.kdtr and DIR/index.json.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

FORMAT = "kdtr"
VERSION = 1
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

# safetensors dtype tag -> (numpy dtype or None for BF16, bytes per element)
DTYPES = {
    "F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (None, 2),
    "I64": (np.int64, 8), "I32": (np.int32, 4), "I16": (np.int16, 2), "I8": (np.int8, 1),
    "U64": (np.uint64, 8), "U32": (np.uint32, 4), "U16": (np.uint16, 2), "U8": (np.uint8, 1),
    "BOOL": (np.bool_, 1),
}
_TAG_OF = {np.dtype(d): tag for tag, (d, _) in DTYPES.items() if d is not None}

# Known kernels: tensor name -> (allowed dtype tags, rank). A bundle of a known kernel must hold
# exactly these tensors (docs/DEVELOPING.md); other kernels are checked for format only.
_I64_2, _I32_1 = ({"I64"}, 2), ({"I32"}, 1)
SCHEMAS = {
    "tree_build": {
        "top_logp": ({"F32"}, 3), "top_ids": ({"I64"}, 3), "root_ids": ({"I64"}, 1),
        "seq_lens": ({"I64"}, 1), "budget": ({"I64"}, 1),
        "expected.tokens": _I64_2, "expected.parents": ({"I32"}, 2),
        "expected.depths": ({"I32"}, 2), "expected.positions": _I64_2,
        "expected.first_child": _I64_2, "expected.next_sibling": _I64_2,
        "expected.visibility": ({"U32"}, 3), "expected.num_nodes": _I32_1,
        "expected.scores": ({"F64"}, 2),
    },
    "tree_accept": {
        "tokens": _I64_2, "first_child": _I64_2, "next_sibling": _I64_2, "num_nodes": _I32_1,
        "target_argmax": _I64_2, "expected.accept_index": ({"I32"}, 2),
        "expected.accept_len": _I32_1, "expected.bonus": ({"I64"}, 1),
        "expected.status": _I32_1,
    },
    "verify_attention": {
        "q_lat": ({"F32", "BF16"}, 3), "q_pe": ({"F32", "BF16"}, 3),
        "kv_cache": ({"F32", "BF16"}, 2), "q_indptr": _I32_1, "kv_indptr": _I32_1,
        "visibility": ({"U32"}, 2), "softmax_scale": ({"F32"}, 1),
        "expected.out": ({"F64"}, 3), "expected.lse": ({"F64"}, 2),
    },
}


class KdtrError(ValueError):
    """A file is not a valid KDTR bundle, or tensors/meta cannot be saved as one."""


# ---------------------------------------------------------------- bf16 helpers


def to_bf16(x):
    """float array -> CPU torch.bfloat16 tensor (round to nearest even)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)


def bf16_to_f64(t) -> np.ndarray:
    """torch.bfloat16 tensor -> float64 numpy array (exact)."""
    import torch

    return t.to(torch.float64).numpy()


def is_bf16(t) -> bool:
    return type(t).__module__.startswith("torch") and str(t.dtype) == "torch.bfloat16"


# ---------------------------------------------------------------- save


def _meta_strings(path, meta: dict) -> dict:
    if not isinstance(meta, dict):
        raise KdtrError(f"{path}: meta: expected a dict, got {type(meta).__name__}")
    out = {}
    for key, value in meta.items():
        if not isinstance(key, str):
            raise KdtrError(f"{path}: meta: key {key!r} is not a string")
        if key == "case":
            case = json.loads(value) if isinstance(value, str) else value
            if not isinstance(case, dict):
                raise KdtrError(f"{path}: meta.case: expected a JSON object, got {value!r}")
            out[key] = json.dumps(case, sort_keys=True)
        elif key == "version":
            if str(value) != str(VERSION):
                raise KdtrError(f"{path}: meta.version: {value!r}, this writer writes {VERSION}")
        elif key == "format":
            if value != FORMAT:
                raise KdtrError(f"{path}: meta.format: {value!r}, expected {FORMAT!r}")
        elif isinstance(value, str):
            out[key] = value
        else:
            raise KdtrError(f"{path}: meta.{key}: expected a string, got {type(value).__name__}")
    for key in ("kernel", "case"):
        if key not in out:
            raise KdtrError(f"{path}: meta: missing {key!r}")
    if not out["kernel"]:
        raise KdtrError(f"{path}: meta.kernel: empty")
    out["format"], out["version"] = FORMAT, str(VERSION)
    return out


def save(path, tensors: dict, meta: dict) -> None:
    """Write a bundle atomically. tensors: name -> numpy array or torch.bfloat16 tensor;
    meta: `kernel` (str), `case` (dict or JSON object string), optional other string keys."""
    import torch
    from safetensors.torch import save as st_save

    path = Path(path)
    strings = _meta_strings(path, meta)
    out = {}
    for name, a in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise KdtrError(f"{path}: tensor name {name!r} is not allowed")
        if is_bf16(a):
            out[name] = a.detach().to("cpu").contiguous()
            continue
        if not isinstance(a, np.ndarray):
            raise KdtrError(f"{path}: tensor {name!r}: expected a numpy array or a "
                            f"torch.bfloat16 tensor, got {type(a).__name__}")
        native = a.dtype.newbyteorder("=")
        if native not in _TAG_OF:
            raise KdtrError(f"{path}: tensor {name!r}: dtype {a.dtype} has no safetensors tag")
        out[name] = torch.from_numpy(np.array(a, dtype=native, order="C", copy=True))
    if strings["kernel"] in SCHEMAS:
        _check_schema(path, strings["kernel"],
                      {k: ("BF16" if is_bf16(v) else _TAG_OF[v.numpy().dtype], v.dim())
                       for k, v in out.items()})
    data = st_save(out, metadata=strings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------- load


def _check_schema(path, kernel: str, found: dict) -> None:
    """found: name -> (dtype tag, rank). Raises on a missing, extra or mistyped tensor."""
    schema = SCHEMAS[kernel]
    for name, (tags, rank) in schema.items():
        if name not in found:
            raise KdtrError(f"{path}: kernel {kernel}: missing tensor {name!r}")
        tag, got_rank = found[name]
        if tag not in tags:
            raise KdtrError(f"{path}: tensor {name!r}: dtype {tag}, expected "
                            f"{' or '.join(sorted(tags))}")
        if got_rank != rank:
            raise KdtrError(f"{path}: tensor {name!r}: rank {got_rank}, expected {rank}")
    extra = sorted(set(found) - set(schema))
    if extra:
        raise KdtrError(f"{path}: kernel {kernel}: unexpected tensor {extra[0]!r}")


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise KdtrError(f"duplicate key {sorted(dup)[0]!r}")
    return dict(pairs)


def _parse_header(path, blob: bytes):
    """Validate the safetensors framing and KDTR metadata. Returns (meta, entries)."""
    if len(blob) < 8:
        raise KdtrError(f"{path}: truncated: {len(blob)} bytes, shorter than the 8-byte "
                        "header length")
    hlen = int.from_bytes(blob[:8], "little")
    if hlen == 0 or hlen > MAX_HEADER_BYTES or 8 + hlen > len(blob):
        raise KdtrError(f"{path}: header length {hlen} does not fit the file of {len(blob)} "
                        "bytes (truncated or not a safetensors file)")
    try:
        header = json.loads(blob[8:8 + hlen].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except KdtrError as e:
        raise KdtrError(f"{path}: header: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise KdtrError(f"{path}: header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise KdtrError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise KdtrError(f"{path}: __metadata__ is missing or not a map of strings "
                        "(not a KDTR bundle)")
    if meta.get("format") != FORMAT:
        raise KdtrError(f"{path}: metadata format is {meta.get('format')!r}, expected "
                        f"{FORMAT!r} (not a KDTR bundle)")
    if meta.get("version") != str(VERSION):
        raise KdtrError(f"{path}: metadata version {meta.get('version')!r}, this reader "
                        f"reads {VERSION} (regenerate: python -m engine.kdtr generate)")
    if not meta.get("kernel"):
        raise KdtrError(f"{path}: metadata kernel is missing or empty")
    try:
        case = json.loads(meta.get("case", ""))
    except ValueError:
        case = None
    if not isinstance(case, dict):
        raise KdtrError(f"{path}: metadata case is missing or not a JSON object")
    data_len = len(blob) - 8 - hlen
    spans = []
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not name:
            raise KdtrError(f"{path}: a tensor has an empty name")
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise KdtrError(f"{where}: entry must have exactly dtype, shape, data_offsets")
        if e["dtype"] not in DTYPES:
            raise KdtrError(f"{where}: unknown dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or not all(
                type(s) is int and s >= 0 for s in shape):
            raise KdtrError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int for o in offs) or not 0 <= offs[0] <= offs[1]):
            raise KdtrError(f"{where}: data_offsets {offs!r} is not [begin, end] with "
                            "0 <= begin <= end")
        if offs[1] > data_len:
            raise KdtrError(f"{where}: bytes {offs[0]}..{offs[1]} out of range: the data "
                            f"section has {data_len} bytes (truncated file?)")
        want = math.prod(shape) * DTYPES[e["dtype"]][1]
        if offs[1] - offs[0] != want:
            raise KdtrError(f"{where}: {offs[1] - offs[0]} bytes for shape {shape} "
                            f"{e['dtype']}, expected {want}")
        spans.append((offs[0], offs[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            kind = "overlaps the previous tensor" if begin < end else "leaves a gap"
            raise KdtrError(f"{path}: tensor {name!r}: data at byte {begin} {kind} "
                            f"(previous data ends at {end})")
        end = stop
    if end != data_len:
        raise KdtrError(f"{path}: {data_len - end} trailing bytes after the last tensor")
    if meta["kernel"] in SCHEMAS:
        _check_schema(path, meta["kernel"],
                      {k: (e["dtype"], len(e["shape"])) for k, e in header.items()})
    out_meta = dict(meta)
    out_meta["version"], out_meta["case"] = VERSION, case
    return out_meta, header


def load(path):
    """Read and validate a bundle. Returns (tensors, meta): tensors name -> numpy array (or a
    torch.bfloat16 tensor for BF16); meta with `version` an int and `case` a dict."""
    from safetensors.torch import load as st_load

    try:
        blob = Path(path).read_bytes()
    except OSError as e:
        raise KdtrError(f"{path}: cannot read: {e.strerror or e}") from None
    meta, _ = _parse_header(path, blob)
    try:
        loaded = st_load(blob)
    except BaseException as e:
        # The framing was validated above, so this is a library refusal we did not foresee.
        # A Rust panic surfaces as pyo3's PanicException, a BaseException: catch it too.
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        raise KdtrError(f"{path}: safetensors refused the file: {e}") from None
    tensors = {k: (v if is_bf16(v) else v.numpy()) for k, v in loaded.items()}
    return tensors, meta
