"""The bundle generator: every case is written, listed, loadable and agrees with the reference."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.kdtr import bundle as kdtr
from engine.reference import ddtree, mla
from engine.kdtr.cases import all_cases, generate

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles")
    index = generate(out, quick=True)
    return out, index


def test_index_lists_every_written_bundle(bundles):
    out, index = bundles
    on_disk = sorted(str(p.relative_to(out)) for p in out.rglob("*.kdtr"))
    assert sorted(c["path"] for c in index["cases"]) == on_disk
    assert json.loads((out / "index.json").read_text()) == index
    assert {c["kernel"] for c in index["cases"]} == {"tree_build", "tree_accept",
                                                      "verify_attention"}


def test_issue_cases_are_present(bundles):
    names = {(c["kernel"], c["case"]) for c in bundles[1]["cases"]}
    for kernel, name in [("tree_build", "worked_example"), ("tree_build", "exact_ties_bs17"),
                         ("tree_build", "l1"), ("tree_build", "k1"), ("tree_build", "budget1"),
                         ("tree_build", "budget_over_space"), ("tree_build", "bs17_b16"),
                         ("tree_accept", "k1_all_accept"), ("tree_accept", "bs17_b16_all_reject"),
                         ("tree_accept", "malformed_bs17"),
                         ("verify_attention", "empty_prefix_bf16"),
                         ("verify_attention", "kimi_shape_f32")]:
        assert (kernel, name) in names, f"{kernel}/{name} missing"


def test_bundles_agree_with_the_reference(bundles):
    out, index = bundles
    seed = index["seed"]
    for case in index["cases"]:
        t, meta = kdtr.load(out / case["path"])
        where = f"{case['path']} (seed {seed})"
        assert meta["kernel"] == case["kernel"] and meta["case"] == case["params"], where
        if case["kernel"] == "tree_build":
            tree = ddtree.build_tree(t["top_logp"], t["top_ids"], int(t["budget"][0]),
                                     t["root_ids"], t["seq_lens"])
            got = {k: getattr(tree, k) for k in tree.__dataclass_fields__}
        elif case["kernel"] == "tree_accept":
            class Tree:
                tokens, first_child, next_sibling = (t["tokens"], t["first_child"],
                                                     t["next_sibling"])
                num_nodes = t["num_nodes"]
            acc = ddtree.accept_greedy(Tree, t["target_argmax"])
            got = {k: getattr(acc, k) for k in acc.__dataclass_fields__}
        else:
            o, lse = mla.verify_attention_ragged(t["q_lat"], t["q_pe"], t["kv_cache"],
                                                 t["q_indptr"], t["kv_indptr"],
                                                 t["visibility"], float(t["softmax_scale"][0]))
            got = {"out": o, "lse": lse}
        for name, value in got.items():
            ref = t["expected." + name]
            assert ref.dtype == value.dtype and np.array_equal(ref, value), f"{where}: {name}"


def test_malformed_case_covers_every_status(bundles):
    t, _ = kdtr.load(bundles[0] / "tree_accept" / "malformed_bs17.kdtr")
    assert set(t["expected.status"].tolist()) == {0, 1, 2, 3}


def test_cli_generate_and_show(tmp_path):
    run = subprocess.run([sys.executable, "-m", "engine.kdtr", "generate", "--out",
                          str(tmp_path), "--quick", "--seed", "12345"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "(seed 12345)" in run.stdout
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["seed"] == 12345 and "--seed 12345 --quick" in index["regenerate"]
    show = subprocess.run([sys.executable, "-m", "engine.kdtr", "show",
                           str(tmp_path / "tree_build" / "worked_example.kdtr")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and "expected.visibility: uint32 [1, 7, 1]" in show.stdout
    bad = tmp_path / "bad.kdtr"
    bad.write_bytes(b"\0" * 3)
    fail = subprocess.run([sys.executable, "-m", "engine.kdtr", "show", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert fail.returncode == 5 and f"error: {bad}: truncated" in fail.stderr


def test_same_seed_regenerates_identical_cases():
    # Compared in memory: safetensors writes the metadata map in no fixed order, so the bytes
    # of two files with equal contents may differ.
    a = list(all_cases(np.random.default_rng(7), quick=True))
    b = list(all_cases(np.random.default_rng(7), quick=True))
    assert [c[:3] for c in a] == [c[:3] for c in b]
    for (kernel, name, _, ta), (_, _, _, tb) in zip(a, b):
        assert sorted(ta) == sorted(tb)
        for key in ta:
            x, y = ta[key], tb[key]
            if kdtr.is_bf16(x):
                x, y = kdtr.bf16_to_f64(x), kdtr.bf16_to_f64(y)
            assert np.array_equal(x, y), f"{kernel}/{name}: {key}"
