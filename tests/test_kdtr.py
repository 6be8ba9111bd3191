"""engine.kdtr: round trips of every dtype, strict rejection of corrupted bundles (fuzzed)."""

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kdtr import bundle as kdtr
from engine.kdtr.bundle import KdtrError

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
NUMPY_TAGS = [t for t, (d, _) in kdtr.DTYPES.items() if d is not None]
META = {"kernel": "misc", "case": {"name": "t", "n": 3}}


def _random_array(rng, tag, shape):
    dtype = kdtr.DTYPES[tag][0]
    if tag == "BOOL":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype is None:  # BF16
        return kdtr.to_bf16(rng.standard_normal(shape))
    if np.dtype(dtype).kind == "f":
        return np.asarray(rng.standard_normal(shape)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def _same(a, b):
    if kdtr.is_bf16(a):
        return kdtr.is_bf16(b) and torch.equal(a.view(torch.int16), b.view(torch.int16))
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(sorted(kdtr.DTYPES)),
                          st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=6),
       st.integers(0, 2**32 - 1))
def test_round_trip_every_dtype(tmp_path, specs, seed):
    rng = np.random.default_rng(seed)
    tensors = {f"t{i}.{tag}": _random_array(rng, tag, tuple(shape))
               for i, (tag, shape) in enumerate(specs)}
    path = tmp_path / "rt.kdtr"
    kdtr.save(path, tensors, dict(META, seed=str(seed)))
    got, meta = kdtr.load(path)
    assert sorted(got) == sorted(tensors)
    for name in tensors:
        assert _same(tensors[name], got[name]), f"{name} differs (seed {seed})"
    assert meta == {"format": "kdtr", "version": 1, "kernel": "misc",
                    "case": {"name": "t", "n": 3}, "seed": str(seed)}


def test_bf16_is_stored_as_raw_16_bit_patterns(tmp_path):
    # Round to nearest even: 1 + 2**-9 rounds down, 1 + 3 * 2**-9 up, 1 + 2**-8 (a tie) to even.
    x = np.array([1.0, -2.5, 1 + 2**-9, 1 + 3 * 2**-9, 1 + 2**-8], np.float32)
    rounded = np.array([1.0, -2.5, 1.0, 1 + 2**-7, 1.0], np.float32)  # exact in bf16
    kdtr.save(tmp_path / "b.kdtr", {"x": kdtr.to_bf16(x)}, META)
    blob = (tmp_path / "b.kdtr").read_bytes()
    hlen = int.from_bytes(blob[:8], "little")
    raw = np.frombuffer(blob[8 + hlen:], "<u2")
    assert raw.tolist() == (rounded.view(np.uint32) >> 16).tolist()
    got, _ = kdtr.load(tmp_path / "b.kdtr")
    assert kdtr.bf16_to_f64(got["x"]).tolist() == rounded.astype(np.float64).tolist()


def test_save_validates_meta_and_tensors(tmp_path):
    p = tmp_path / "x.kdtr"
    with pytest.raises(KdtrError, match="meta: missing 'kernel'"):
        kdtr.save(p, {"a": np.zeros(1)}, {"case": {}})
    with pytest.raises(KdtrError, match="meta.case: expected a JSON object"):
        kdtr.save(p, {"a": np.zeros(1)}, {"kernel": "k", "case": [1]})
    with pytest.raises(KdtrError, match="meta.format"):
        kdtr.save(p, {"a": np.zeros(1)}, dict(META, format="other"))
    with pytest.raises(KdtrError, match="tensor 'a': expected a numpy array"):
        kdtr.save(p, {"a": [1, 2]}, META)
    with pytest.raises(KdtrError, match="dtype complex128 has no safetensors tag"):
        kdtr.save(p, {"a": np.zeros(2, complex)}, META)
    with pytest.raises(KdtrError, match="kernel tree_accept: missing tensor 'tokens'"):
        kdtr.save(p, {"a": np.zeros(2)}, {"kernel": "tree_accept", "case": {}})
    assert not p.exists()


# ---------------------------------------------------------------- crafted defects


def _file(header: dict, data: bytes, meta=None, raw_header: bytes = None) -> bytes:
    if meta is not False:
        header = dict(header, __metadata__=meta or {"format": "kdtr", "version": "1",
                                                     "kernel": "misc", "case": "{}"})
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data


def _entry(dtype, shape, a, b):
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}


DEFECTS = [
    (b"", "truncated: 0 bytes"),
    (b"\x05\x00", "truncated: 2 bytes"),
    ((1000).to_bytes(8, "little") + b"{}", "header length 1000 does not fit"),
    (_file({}, b"", raw_header=b"{not json"), "header is not valid UTF-8 JSON"),
    (_file({}, b"", raw_header=b"\xff\xfe"), "header is not valid UTF-8 JSON"),
    (_file({}, b"", raw_header=b"[1, 2]"), "header is not a JSON object"),
    (_file({}, b"", raw_header=b'{"a": 1, "a": 2}'), "duplicate key 'a'"),
    (_file({}, b"", meta=False), "__metadata__ is missing"),
    (_file({}, b"", meta={"format": "pt", "version": "1", "kernel": "k", "case": "{}"}),
     "metadata format is 'pt', expected 'kdtr'"),
    (_file({}, b"", meta={"format": "kdtr", "version": "2", "kernel": "k", "case": "{}"}),
     "metadata version '2'"),
    (_file({}, b"", meta={"format": "kdtr", "version": "1", "case": "{}"}), "kernel is missing"),
    (_file({}, b"", meta={"format": "kdtr", "version": "1", "kernel": "k", "case": "[]"}),
     "case is missing or not a JSON object"),
    (_file({"a": _entry("F32", [2], 0, 8)}, b"\0" * 4), "bytes 0..8 out of range"),
    (_file({"a": _entry("F32", [3], 0, 8)}, b"\0" * 8), "8 bytes for shape [3] F32, expected 12"),
    (_file({"a": _entry("Q8", [1], 0, 1)}, b"\0"), "unknown dtype 'Q8'"),
    (_file({"a": _entry("F32", [-1], 0, 0)}, b""), "not a list of non-negative integers"),
    (_file({"a": _entry("F32", [1], 4, 0)}, b"\0" * 4), "is not [begin, end]"),
    (_file({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "exactly dtype, shape"),
    (_file({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 2, 6)}, b"\0" * 6),
     "overlaps the previous tensor"),
    (_file({"a": _entry("F32", [1], 4, 8)}, b"\0" * 8), "leaves a gap"),
    (_file({"a": _entry("F32", [1], 0, 4)}, b"\0" * 9), "5 trailing bytes"),
    (_file({"a": _entry("F32", [1], 0, 4)}, b"\0" * 4,
           meta={"format": "kdtr", "version": "1", "kernel": "tree_accept", "case": "{}"}),
     "kernel tree_accept: missing tensor 'tokens'"),
]


@pytest.mark.parametrize("blob, defect", DEFECTS, ids=[d for _, d in DEFECTS])
def test_crafted_defects_name_file_and_defect(tmp_path, blob, defect):
    path = tmp_path / "bad.kdtr"
    path.write_bytes(blob)
    with pytest.raises(KdtrError, match=re.escape(f"{path}: ") + ".*" + re.escape(defect)):
        kdtr.load(path)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(KdtrError, match=re.escape(str(tmp_path / "nope.kdtr")) + ": cannot read"):
        kdtr.load(tmp_path / "nope.kdtr")


def test_wrong_schema_dtype_rejected(tmp_path):
    from engine.kdtr import cases as kdtr_cases

    rng = np.random.default_rng()
    (_, _, _, tensors), _ = next(kdtr_cases.tree_build_cases(rng, quick=True))
    tensors["top_logp"] = tensors["top_logp"].astype(np.float64)
    with pytest.raises(KdtrError, match="tensor 'top_logp': dtype F64, expected F32"):
        kdtr.save(tmp_path / "w.kdtr", tensors, {"kernel": "tree_build", "case": {}})


# ---------------------------------------------------------------- fuzzing


@pytest.fixture(scope="module")
def valid_blob(tmp_path_factory):
    rng = np.random.default_rng()
    path = tmp_path_factory.mktemp("fuzz") / "ok.kdtr"
    tensors = {"a": rng.standard_normal((3, 4)).astype(np.float32),
               "b": rng.integers(0, 9, 5), "c": kdtr.to_bf16(rng.standard_normal(2)),
               "d": np.zeros((0, 2), np.uint32)}
    kdtr.save(path, tensors, META)
    return path.read_bytes()


def _load_or_kdtr_error(path):
    """Loading a mutated file either succeeds or raises KdtrError naming the file."""
    try:
        kdtr.load(path)
        return True
    except KdtrError as e:
        assert str(e).startswith(f"{path}: "), str(e)
        return False


@SETTINGS
@given(st.data())
def test_fuzzed_bundles_never_escape_as_other_errors(tmp_path, valid_blob, data):
    blob = bytearray(valid_blob)
    hlen = int.from_bytes(blob[:8], "little")
    kind = data.draw(st.sampled_from(["truncate", "flip_header", "flip_len", "insert",
                                      "splice_json"]))
    if kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "flip_header":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(8, 8 + hlen - 1))
            blob[i] = data.draw(st.integers(0, 255))
    elif kind == "flip_len":
        i = data.draw(st.integers(0, 7))
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "insert":
        i = data.draw(st.integers(0, len(blob)))
        blob[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:  # rewrite one number in the header JSON (offsets, shapes)
        header = json.loads(blob[8:8 + hlen])
        name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(["shape", "data_offsets"]))
        if header[name][field]:
            j = data.draw(st.integers(0, len(header[name][field]) - 1))
            header[name][field][j] = data.draw(st.integers(-3, 200))
        h = json.dumps(header).encode()
        blob = bytearray(len(h).to_bytes(8, "little") + h + blob[8 + hlen:])
    path = tmp_path / "fuzz.kdtr"
    path.write_bytes(bytes(blob))
    _load_or_kdtr_error(path)


def test_fuzz_finds_rejections_for_every_truncation(tmp_path, valid_blob):
    # Every proper prefix of a valid bundle is rejected (a truncated file is never accepted).
    path = tmp_path / "t.kdtr"
    for cut in range(0, len(valid_blob)):
        path.write_bytes(valid_blob[:cut])
        assert not _load_or_kdtr_error(path), f"prefix of {cut} bytes was accepted"
