"""Bundles whose tensors disagree with each other or with their case metadata must fail their case
in the native test programs with a clear message, before any kernel reads them (the programs
used to trust them: a top_ids of another batch size than root_ids overflowed a heap buffer).

Each mutant is a copy of a freshly generated golden bundle with one defect, written with the
safetensors library; the unmodified copy must still pass (the control)."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from native_helpers import native

pytestmark = pytest.mark.native

REPO = Path(__file__).resolve().parents[1]


def _load(path: Path):
    with safe_open(str(path), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _drop_last(a, axis=0):
    return np.ascontiguousarray(np.take(a, range(a.shape[axis] - 1), axis=axis))


def _extend(a, axis=0):
    return np.ascontiguousarray(np.concatenate([a, np.take(a, [0], axis=axis)], axis=axis))


def _case(meta, **changes):
    case = json.loads(meta["case"])
    for k, v in changes.items():
        if v is None:
            case.pop(k)
        else:
            case[k] = v
    return {**meta, "case": json.dumps(case)}


def _indptr_bump(t):  # q_indptr that ends past total_q
    t = dict(t)
    q = t["q_indptr"].copy()
    q[-1] += 5
    t["q_indptr"] = q
    return t


def _indptr_decrease(t):
    t = dict(t)
    k = t["kv_indptr"].copy()
    k[1] = k[-1] + 1 if len(k) > 2 else -1
    t["kv_indptr"] = k
    return t


def _set(t, **kw):
    return {**t, **kw}


# (kernel, golden case, mutant name, mutate(tensors, meta) -> (tensors, meta), message needle)
MUTANTS = [
    ("tree_build", "bs12_b37", "top_ids_batch", lambda t, m: (_set(t, top_ids=_drop_last(t["top_ids"])), m),
     "tensor top_ids [11, 15, 37]"),
    ("tree_build", "bs12_b37", "root_ids_longer", lambda t, m: (_set(t, root_ids=_extend(t["root_ids"])), m),
     "root_ids"),
    ("tree_build", "bs12_b37", "seq_lens_shorter", lambda t, m: (_set(t, seq_lens=_drop_last(t["seq_lens"])), m),
     "seq_lens"),
    ("tree_build", "bs12_b37", "k_vs_case", lambda t, m: (
        _set(t, top_logp=_extend(t["top_logp"], 2), top_ids=_extend(t["top_ids"], 2)), m), "K = 38"),
    ("tree_build", "bs12_b37", "case_bs", lambda t, m: (t, _case(m, bs=13)), "bs = 12 from tensor top_logp"),
    ("tree_build", "bs12_b37", "case_missing_L", lambda t, m: (t, _case(m, L=None)), 'no key "L"'),
    ("tree_build", "bs12_b37", "budget_value", lambda t, m: (_set(t, budget=np.array([36], np.int64)), m),
     "tensor budget holds 36"),
    ("tree_build", "bs12_b37", "visibility_width", lambda t, m: (
        _set(t, **{"expected.visibility": _drop_last(t["expected.visibility"], 2)}), m), "expected.visibility"),
    ("tree_build", "bs12_b37", "top_ids_dtype", lambda t, m: (
        _set(t, top_ids=t["top_ids"].astype(np.int32)), m), "top_ids has dtype I32"),
    ("tree_accept", "malformed_bs17", "first_child_n", lambda t, m: (
        _set(t, first_child=_drop_last(t["first_child"], 1)), m), "first_child"),
    ("tree_accept", "malformed_bs17", "target_batch", lambda t, m: (
        _set(t, target_argmax=_extend(t["target_argmax"])), m), "target_argmax"),
    ("tree_accept", "malformed_bs17", "num_nodes_shorter", lambda t, m: (
        _set(t, num_nodes=_drop_last(t["num_nodes"])), m), "num_nodes"),
    ("tree_accept", "malformed_bs17", "case_n", lambda t, m: (t, _case(m, n=9)), "n = 7 from tensor tokens"),
    ("verify_attention", "ragged_bs17_h3_f32", "q_indptr_end", lambda t, m: (_indptr_bump(t), m), "q_indptr ends at"),
    ("verify_attention", "ragged_bs17_h3_f32", "kv_indptr_decreasing", lambda t, m: (_indptr_decrease(t), m),
     "kv_indptr decreases"),
    ("verify_attention", "ragged_bs17_h3_f32", "q_pe_heads", lambda t, m: (
        _set(t, q_pe=_drop_last(t["q_pe"], 1)), m), "q_pe"),
    ("verify_attention", "ragged_bs17_h3_f32", "kv_width", lambda t, m: (
        _set(t, kv_cache=_drop_last(t["kv_cache"], 1)), m), "kv_cache"),
    ("verify_attention", "ragged_bs17_h3_f32", "visibility_rows", lambda t, m: (
        _set(t, visibility=_drop_last(t["visibility"])), m), "visibility"),
    ("verify_attention", "ragged_bs17_h3_f32", "case_max_tree", lambda t, m: (
        t, _case(m, max_tree=json.loads(m["case"])["max_tree"] + 1)), "max_tree"),
    ("verify_attention", "ragged_bs17_h3_f32", "indptr_length", lambda t, m: (
        _set(t, kv_indptr=_drop_last(t["kv_indptr"])), m), "kv_indptr"),
]

PROGRAMS = {"tree_build": "test_tree_build", "tree_accept": "test_tree_accept",
            "verify_attention": "test_attention"}


def _case_name(kernel: str, stem: str) -> str:
    return f"{stem}/load" if kernel == "verify_attention" else f"bundle/{stem}/cpu"


def test_inconsistent_bundles_fail_cleanly(tmp_path):
    build = native().library().path.parent
    for prog in PROGRAMS.values():
        if not os.access(build / prog, os.X_OK):
            pytest.skip(f"{build} has no {prog} (KDTREE_LIB points at a library built without tests)")
    seed = secrets.randbits(31)
    golden = tmp_path / "golden"
    gen = subprocess.run([sys.executable, "-m", "engine.kdtr", "generate", "--out", str(golden),
                          "--quick", "--seed", str(seed)], cwd=REPO, capture_output=True, text=True)
    assert gen.returncode == 0, f"seed={seed}: bundle generation failed:\n{gen.stderr[-2000:]}"
    out = tmp_path / "mutants"
    for kernel, case, name, mutate, _ in MUTANTS:
        tensors, meta = _load(golden / kernel / f"{case}.kdtr")
        (out / kernel).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / kernel / f"control_{case}.kdtr"), metadata=meta)
        t2, m2 = mutate(tensors, meta)
        save_file(t2, str(out / kernel / f"{name}.kdtr"), metadata=m2)

    for kernel, prog in PROGRAMS.items():
        r = subprocess.run([str(build / prog), "--bundles", str(out)], capture_output=True, text=True,
                           timeout=300)
        cases = {}
        for line in r.stdout.splitlines():
            parts = line.split("\t")
            if parts[0] == "KDT_CASE" and len(parts) >= 5:
                cases[parts[1]] = (parts[2], parts[4])
        assert "KDT_RESULT" in r.stdout and r.returncode in (0, 1), (
            f"seed={seed}: {prog} died (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        for k, case, name, _, needle in MUTANTS:
            if k != kernel:
                continue
            control = cases.get(_case_name(kernel, f"control_{case}"))
            if kernel == "verify_attention":  # a loaded attention case reports <stem>/cpu
                control = cases.get(f"control_{case}/cpu")
            assert control and control[0] == "PASS", f"seed={seed}: {prog} control {case}: {control}"
            verdict, msg = cases.get(_case_name(kernel, name), ("missing", ""))
            assert verdict == "FAIL", f"seed={seed}: {prog} {name}: {verdict} {msg}"
            assert "inconsistent bundle" in msg or "no key" in msg, f"{prog} {name}: {msg}"
            assert needle in msg and f"{name}.kdtr" in msg, f"{prog} {name}: '{needle}' not in: {msg}"
            print(f"{prog} {name}: {re.sub(r' [(]seed .*', '', msg)}")
