"""Native tree build vs the reference (engine.reference.ddtree), CPU backend and (with a GPU) CUDA.

Fresh random inputs every run; every failure message carries the seed. Exact ties are forced
by drawing log-probs from a few repeated values. Integers and float64 scores must match bit
for bit (both sides run the same float64 operations in the same order: DDTREE.md section 2).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from engine.reference import ddtree

from native_helpers import (  # noqa: F401 (fixtures)
    DEVICES, FIELDS_TREE, assert_same, cuda_ready, native, random_build_inputs,
    skip_cuda_without_gpu)

pytestmark = pytest.mark.native


def test_worked_example_cpu():
    # DDTREE.md section 2: L = 3, K = 3, B = 6.
    p = np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]], np.float32))
    ids = np.array([[11, 12, 13], [21, 22, 23], [31, 32, 33]], np.int64)
    t = native().build_tree(p[None], ids[None], 6, np.array([7]), np.array([100]))
    assert t.tokens.tolist() == [[7, 11, 21, 12, 31, 22, 31]]
    assert t.depths.tolist() == [[0, 1, 2, 1, 3, 2, 3]]
    assert t.parents.tolist() == [[-1, 0, 1, 0, 2, 1, 5]]
    assert t.positions.tolist() == [[100, 101, 102, 101, 103, 102, 103]]
    # SGLang's lists for this tree (ddtree_spec.md section 2): newest child first.
    assert t.first_child.tolist() == [[3, 5, 4, -1, -1, 6, -1]]
    assert t.next_sibling.tolist() == [[-1, -1, -1, 1, -1, 2, -1]]
    assert t.num_nodes.tolist() == [7]


# (bs, L, K, budget, ties): degenerate and awkward sizes, the paper's sweet spot, the largest.
GRID = [
    (1, 1, 1, 1, False),      # budget 1, L = 1, K = 1
    (3, 1, 1, 5, True),       # candidate space (1) smaller than the budget
    (2, 1, 7, 16, True),      # L = 1: the tree is the K depth-1 nodes
    (5, 4, 1, 9, False),      # K = 1: a chain of L nodes
    (12, 15, 8, 64, True),
    (17, 15, 16, 37, True),
    (4, 32, 3, 100, True),    # L = 32, the deepest
    (2, 15, 255, 255, True),
    (1, 15, 1024, 1024, True),  # B = 1024 with K = 1024
    (2, 16, 1024, 1024, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs,L,K,budget,ties", GRID)
def test_build_matches_reference(device, bs, L, K, budget, ties):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    args = random_build_inputs(rng, bs, L, K, ties)
    ref = ddtree.build_tree(*args[:2], budget, *args[2:])
    got = native().build_tree(*args[:2], budget, *args[2:], device=device)
    assert_same(got, ref, FIELDS_TREE, f"seed={seed} device={device} bs={bs} L={L} K={K} "
                                       f"budget={budget}")


@pytest.mark.parametrize("device", DEVICES)
def test_build_random_shapes(device):
    # Many small random shapes with heavy ties, including K > budget (sliced by the wrapper).
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for trial in range(60):
        bs, L = int(rng.integers(1, 5)), int(rng.integers(1, 10))
        budget, K = int(rng.integers(1, 80)), int(rng.integers(1, 90))
        args = random_build_inputs(rng, bs, L, K, ties=bool(rng.integers(0, 2)))
        ref = ddtree.build_tree(*args[:2], budget, *args[2:])
        got = native().build_tree(*args[:2], budget, *args[2:], device=device)
        assert_same(got, ref, FIELDS_TREE, f"seed={seed} trial={trial} device={device} bs={bs} "
                                           f"L={L} K={K} budget={budget}")


def test_build_torch_cpu_tensors():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    args = random_build_inputs(rng, 3, 6, 12, ties=True)
    ref = ddtree.build_tree(*args[:2], 40, *args[2:])
    targs = [torch.from_numpy(a) for a in args]
    got = native().build_tree(*targs[:2], 40, *targs[2:])
    assert isinstance(got.tokens, torch.Tensor) and got.tokens.device.type == "cpu"
    as_np = ddtree.Tree(**{f: getattr(got, f).numpy() for f in FIELDS_TREE})
    assert_same(as_np, ref, FIELDS_TREE, f"seed={seed} torch cpu")


@pytest.mark.cuda
def test_build_torch_cuda_tensors(cuda_ready):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    args = random_build_inputs(rng, 9, 15, 32, ties=True)
    ref = ddtree.build_tree(*args[:2], 200, *args[2:])
    targs = [torch.from_numpy(a).cuda() for a in args]
    got = native().build_tree(*targs[:2], 200, *targs[2:], device="cuda")
    assert got.tokens.device.type == "cuda"
    as_np = ddtree.Tree(**{f: getattr(got, f).cpu().numpy() for f in FIELDS_TREE})
    assert_same(as_np, ref, FIELDS_TREE, f"seed={seed} torch cuda")


def test_build_rejects_bad_arguments():
    nat = native()
    rng = np.random.default_rng(secrets.randbits(32))
    lp, ids, root, sl = random_build_inputs(rng, 2, 3, 4, ties=False)
    cases = [
        (dict(budget=0), "budget"),
        (dict(budget=1025), "budget"),
        (dict(top_logp=lp.astype(np.float64)), "top_logp: dtype"),
        (dict(top_ids=ids.astype(np.int32)), "top_ids: dtype"),
        (dict(root_ids=root[:1]), "root_ids: shape"),
        (dict(seq_lens=np.array([1, -1], np.int64)), "seq_lens"),
        (dict(top_logp=np.where(lp == lp[0, 0, 0], np.nan, lp).astype(np.float32)), "non-finite"),
        (dict(top_logp=lp[:, :, ::-1].copy()), "not sorted"),
        (dict(top_logp=np.zeros((2, 33, 4), np.float32), top_ids=np.zeros((2, 33, 4), np.int64)),
         "L=33"),
        (dict(device="tpu"), "device"),
    ]
    for change, needle in cases:
        kw = dict(top_logp=lp, top_ids=ids, budget=8, root_ids=root, seq_lens=sl, device="cpu")
        kw.update(change)
        with pytest.raises(Exception) as e:
            nat.build_tree(**kw)
        assert needle in str(e.value), f"{change.keys()}: message {e.value!r} lacks {needle!r}"


def test_build_noncontiguous_rejected():
    rng = np.random.default_rng(secrets.randbits(32))
    lp, ids, root, sl = random_build_inputs(rng, 4, 3, 4, ties=False)
    with pytest.raises(ValueError, match="root_ids: not C-contiguous"):
        native().build_tree(lp, ids, 8, np.repeat(root, 2)[::2], sl)


def test_build_bs_zero():
    t = native().build_tree(np.zeros((0, 3, 4), np.float32), np.zeros((0, 3, 4), np.int64), 8,
                            np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert t.tokens.shape == (0, 9) and t.visibility.shape == (0, 9, 1)


def test_library_reports_build_info():
    lib = native().library()
    assert lib.path.is_file(), lib.path
    assert lib.build_info.get("commands"), f"{lib.path.parent}/build_info.json has no commands"
    assert lib.version.count(".") == 2, lib.version


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [15, 128])  # the warp build, the parallel build
def test_build_and_accept_under_cuda_graph_capture(cuda_ready, budget):
    # The CUDA entry points must not synchronise or allocate: capture both in one graph, replay
    # on new inputs copied into the captured buffers, compare with the reference. The kernels
    # are launched with PDL (cuda/src/pdl.cuh), so the capture links them by a programmatic
    # edge: the accept reads the tree the build wrote.
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    bs, L, K = 8, 15, min(32, budget)
    first = [torch.from_numpy(a).cuda() for a in random_build_inputs(rng, bs, L, K, ties=True)]
    target = torch.zeros((bs, budget + 1), dtype=torch.int64, device="cuda")
    nat = native()
    nat.build_tree(*first[:2], budget, *first[2:], device="cuda")  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree = nat.build_tree(*first[:2], budget, *first[2:], device="cuda")
        acc = nat.accept_greedy(tree, target, device="cuda")
    for trial in range(3):
        args = random_build_inputs(rng, bs, L, K, ties=True)
        for dst, src in zip(first, args):
            dst.copy_(torch.from_numpy(src))
        ref = ddtree.build_tree(*args[:2], budget, *args[2:])
        tgt = rng.choice(ref.tokens.reshape(-1), size=(bs, budget + 1)).astype(np.int64)
        target.copy_(torch.from_numpy(tgt))
        graph.replay()
        torch.cuda.synchronize()
        as_np = ddtree.Tree(**{f: getattr(tree, f).cpu().numpy() for f in FIELDS_TREE})
        assert_same(as_np, ref, FIELDS_TREE, f"seed={seed} graph replay {trial}")
        ref_acc = ddtree.accept_greedy(ref, tgt)
        got_acc = ddtree.Accept(**{f: getattr(acc, f).cpu().numpy()
                                   for f in ("accept_index", "accept_len", "bonus", "status")})
        assert_same(got_acc, ref_acc, ["accept_index", "accept_len", "bonus", "status"],
                     f"seed={seed} graph replay {trial} accept")


_PDL_CHILD = """
import sys
import numpy as np
import torch
from engine.reference import ddtree
from native_helpers import FIELDS_TREE, native, random_build_inputs
rng = np.random.default_rng(int(sys.argv[1]))
nat = native()
for budget in (15, 63, 255):
    args = random_build_inputs(rng, 4, 15, min(64, budget), ties=True)
    dev = [torch.from_numpy(a).cuda() for a in args]
    ref = ddtree.build_tree(*args[:2], budget, *args[2:])
    tgt = rng.choice(ref.tokens.reshape(-1), size=(4, budget + 1)).astype(np.int64)
    target = torch.from_numpy(tgt).cuda()
    def check(tree, acc, how):
        for f in FIELDS_TREE:
            if not np.array_equal(getattr(tree, f).cpu().numpy(), getattr(ref, f)):
                sys.exit(f"budget {budget}, {how}: tree field {f} differs from the reference")
        ref_acc = ddtree.accept_greedy(ref, tgt)
        for f in ("accept_index", "accept_len", "bonus", "status"):
            if not np.array_equal(getattr(acc, f).cpu().numpy(), getattr(ref_acc, f)):
                sys.exit(f"budget {budget}, {how}: accept field {f} differs from the reference")
    tree = nat.build_tree(*dev[:2], budget, *dev[2:], device="cuda")  # eager, back to back
    acc = nat.accept_greedy(tree, target, device="cuda")
    torch.cuda.synchronize()
    check(tree, acc, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree = nat.build_tree(*dev[:2], budget, *dev[2:], device="cuda")
        acc = nat.accept_greedy(tree, target, device="cuda")
    graph.replay()
    torch.cuda.synchronize()
    check(tree, acc, "graph replay")
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_build_and_accept_with_and_without_pdl(cuda_ready, pdl):
    # KDT_PDL is read once per process, so each setting runs in a child process: eager, and
    # captured and replayed, plain launches (0) and programmatic dependent launches (1) give the
    # reference's trees and walks.
    pytest.importorskip("torch", reason="torch is not installed")
    seed = secrets.randbits(32)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = {**os.environ, "KDT_PDL": pdl,
           "PYTHONPATH": os.pathsep.join([here, root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _PDL_CHILD, str(seed)], env=env, cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (
        f"KDT_PDL={pdl} seed={seed}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
