"""libkdtree's tree-verify attention (CPU and CUDA backends, every CUDA path) against a float64
reference.

Errors are relative to the reference's magnitude: max|out - ref| / max|ref| over a tensor
(the same for lse). Bounds: 1e-5 for float32 caches; 1e-2 for bfloat16 caches (the tensor-core
paths round the softmax weights P to bfloat16 for the P.V product; the reference is computed on
the same bf16-rounded inputs). CUDA paths (KDT_VERIFY_PATH, engine.native.attention.PATHS) are
forced one at a time; the mma path takes bf16 at d_latent 512 / d_rope 64 only.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.native

TOL = {"f32": 1e-5, "bf16": 1e-2}


def tolerance(device, dtype, path):
    """The CPU backend (double) and the SIMT kernels (fp32 on exact bf16 inputs) keep 1e-5 on
    bf16 caches too; the tensor-core paths (auto on bf16, mma, sm90a) get the bf16 bound."""
    return TOL["f32"] if device == "cpu" or path == "simt" else TOL[dtype]


def _attention():
    """engine.native.attention with its library loaded: KDTREE_LIB, else build/cpu (re)built
    when stale (tests/native_helpers.py)."""
    from native_helpers import native

    native()
    from engine.native import attention

    return attention


def reference_f64(q_lat, q_pe, kv, q_indptr, kv_indptr, vis, scale):
    """engine.reference.mla's float64 reference in the kernel layout, on the exact (rounded) inputs."""
    from engine.reference.mla import verify_attention_ragged

    return verify_attention_ragged(q_lat, q_pe, kv, q_indptr, kv_indptr, vis, scale)


def random_tree_visibility(rng, n, words):
    """[n, words] uint32 ancestor-or-self bits of a random tree whose parents precede children."""
    vis = np.zeros((n, words), np.uint32)
    anc = [set() for _ in range(n)]
    for i in range(n):
        if i > 0:
            p = int(rng.integers(0, i))
            anc[i] = anc[p] | {p}
        for j in anc[i] | {i}:
            vis[i, j // 32] |= np.uint32(1 << (j % 32))
    return vis


def random_case(rng, bs, H, dl, dr, prefixes, trees, vis_words=None, scale=None):
    ns = [int(rng.choice(trees)) for _ in range(bs)]
    ps = [int(rng.choice(prefixes)) for _ in range(bs)]
    max_tree = max(ns)
    W = vis_words or (max_tree + 31) // 32
    q_indptr = np.concatenate([[0], np.cumsum(ns)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum([n + p for n, p in zip(ns, ps)])]).astype(np.int32)
    total_q, total_kv = int(q_indptr[-1]), int(kv_indptr[-1])
    vis = np.concatenate([random_tree_visibility(rng, n, W) for n in ns])
    q_lat = rng.standard_normal((total_q, H, dl)).astype(np.float32)
    q_pe = rng.standard_normal((total_q, H, dr)).astype(np.float32)
    kv = rng.standard_normal((total_kv, dl + dr)).astype(np.float32)
    scale = float(scale if scale is not None else 1.0 / np.sqrt(dl + dr))
    return q_lat, q_pe, kv, q_indptr, kv_indptr, vis, scale


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    finite = np.isfinite(ref)
    assert np.array_equal(finite, np.isfinite(out)), "inf/NaN positions differ from the reference"
    if not finite.any():
        return 0.0
    diff = np.abs(out[finite] - ref[finite])
    return float(diff.max() / max(np.abs(ref[finite]).max(), 1e-30))


def check(attention, case, device, dtype, seed, path=None):
    import_torch = dtype == "bf16" or device == "cuda"
    q_lat, q_pe, kv, qi, ki, vis, scale = case
    if import_torch:
        torch = pytest.importorskip("torch")
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        dev = "cuda" if device == "cuda" else "cpu"
        tq, tp, tk = (torch.from_numpy(x).to(tdt).to(dev) for x in (q_lat, q_pe, kv))
        tv, tqi, tki = (torch.from_numpy(x).to(dev) for x in (vis, qi, ki))
        out, lse = attention.verify_attention(tq, tp, tk, tqi, tki, tv, scale, device=device,
                                              path=path)
        out, lse = out.cpu().numpy(), lse.cpu().numpy()
        # the reference sees exactly the rounded inputs the kernel saw
        q_lat, q_pe, kv = (t.float().cpu().numpy() for t in (tq, tp, tk))
    else:
        out, lse = attention.verify_attention(q_lat, q_pe, kv, qi, ki, vis, scale, device=device)
    ref_out, ref_lse = reference_f64(q_lat, q_pe, kv, qi, ki, vis, scale)
    e_out, e_lse = rel_err(out, ref_out), rel_err(lse, ref_lse)
    tol = tolerance(device, dtype, path)
    assert e_out < tol and e_lse < tol, (
        f"{device}/{path or 'auto'}/{dtype}: out rel err {e_out:.3g}, lse rel err {e_lse:.3g} "
        f"(tol {tol}); seed {seed}")
    return e_out, e_lse


GRID = [  # (bs, H, d_latent, d_rope, prefixes, trees)
    (1, 1, 32, 0, [0], [1]),
    (1, 3, 32, 8, [1], [17]),
    (1, 17, 64, 16, [37], [17]),
    (17, 3, 64, 16, [0, 1, 37], [1, 17]),
    (17, 1, 32, 0, [0, 1, 37], [1, 17]),
    (2, 2, 64, 16, [0, 37], [33, 40]),  # two visibility words
]


@pytest.mark.parametrize("bs,H,dl,dr,prefixes,trees", GRID)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cpu_matches_reference(bs, H, dl, dr, prefixes, trees, dtype):
    attention = _attention()
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    check(attention, random_case(rng, bs, H, dl, dr, prefixes, trees), "cpu", dtype, seed)


def test_cpu_peaked_scores_and_wide_visibility():
    """Large scores (softmax dominated by a few keys) and vis_words above the minimum."""
    attention = _attention()
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    case = random_case(rng, 3, 4, 64, 16, [5, 37], [17], vis_words=3, scale=0.9)
    check(attention, case, "cpu", "f32", seed)


def test_cpu_masked_out_row_is_empty_state():
    """A query that sees nothing (no prefix, no visibility bit) gets out 0 and lse -inf."""
    attention = _attention()
    rng = np.random.default_rng()
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 1, 2, 32, 8, [0], [3])
    vis[1] = 0
    out, lse = attention.verify_attention(q_lat, q_pe, kv, qi, ki, vis, scale)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    assert np.all(np.isfinite(lse[[0, 2]]))


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda qi, ki: (qi, ki[:-1]), "kv_indptr has"),
        (lambda qi, ki: (qi, np.array([0, 1, 0], np.int32)), "request 1"),
        (lambda qi, ki: (np.array([0, 3, 4], np.int32), np.array([0, 2, 6], np.int32)), "request 0: kv_len is smaller"),
    ],
)
def test_cpu_rejects_bad_index_pointers(mutate, expect):
    attention = _attention()
    rng = np.random.default_rng()
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 2, 2, 32, 8, [1], [2])
    qi2, ki2 = mutate(qi, ki)
    with pytest.raises((ValueError, RuntimeError), match=expect):
        attention.verify_attention(q_lat, q_pe, kv, qi2, ki2, vis, scale, max_tree=3, max_kv=6)


def test_c_entry_point_checks_index_pointers():
    """The C entry point's own checks (the CPU backend reads the pointers on the host), reached
    directly: the Python wrapper checks first, so this is the only way to exercise them."""
    import ctypes

    attention = _attention()
    lib = attention._lib()
    rng = np.random.default_rng()
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 2, 2, 32, 8, [1], [2])
    out = np.empty_like(q_lat)
    lse = np.empty(q_lat.shape[:2], np.float32)
    p = lambda a: a.ctypes.data  # noqa: E731
    for bad_ki, expect in ((np.array([0, 3, 4], np.int32), b"request 1: kv_len 1 is smaller"),
                           (np.array([0, 3, 7], np.int32), b"kv_indptr[bs] = 7 but total_kv = 6"),
                           (np.array([0, 3, 9], np.int32), b"kv_len 6 exceeds max_kv = 5")):
        st = lib.cdll.kdt_verify_attention(0, None, 0, 2, 2, 32, 8, 4, 6, 2, 5, p(qi), p(bad_ki),
                                           p(q_lat), p(q_pe), p(kv), p(vis), 1, scale, p(out),
                                           p(lse), None, 0)
        assert st == 1 and expect in lib.cdll.kdt_last_error(), lib.cdll.kdt_last_error()
    st = lib.cdll.kdt_verify_attention(0, None, 0, 2, 2, 32, 8, 4, 6, 40, 5, p(qi), p(ki), p(q_lat),
                                       p(q_pe), p(kv), p(vis), 1, scale, p(out), p(lse), None, 0)
    assert st == 1 and b"vis_words = 1 is below ceil(max_tree / 32) = 2" in lib.cdll.kdt_last_error()
    st = lib.cdll.kdt_verify_attention(0, None, 0, 2, 2, 32, 8, 4, 6, 2, 5, p(qi), p(ki), None,
                                       p(q_pe), p(kv), p(vis), 1, scale, p(out), p(lse), None, 0)
    assert st == 1 and b"q_lat is NULL" in lib.cdll.kdt_last_error()


def test_cpu_rejects_tree_above_max_tree():
    attention = _attention()
    rng = np.random.default_rng()
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 1, 1, 32, 0, [4], [17])
    with pytest.raises(ValueError, match="max_tree"):
        attention.verify_attention(q_lat, q_pe, kv, qi, ki, vis, scale, max_tree=16)


def _cuda_or_skip(attention):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    from engine.native._lib import library

    if not library().has_cuda:
        pytest.skip("libkdtree.so was built without CUDA (cuda/build.sh --arch cpu)")


KIMI_GRID = [  # the mma path's shape (d_latent 512, d_rope 64): tiles of 16 or 32 cache rows
    (2, 64, 512, 64, [300, 1000], [17, 64]),     # Kimi heads, ragged, several splits
    (1, 16, 512, 64, [5000], [65]),              # many prefix splits, tree past a 64-row tile
    (3, 3, 512, 64, [0, 37, 16], [1, 5, 33]),    # prefix 0 / 16 / 37, rows not a multiple of 16
    (5, 64, 512, 64, [0, 37, 100], [1, 17, 64]), # bs x row tiles fills the GPU: one chunk, no merge
    (4, 64, 512, 64, [4000, 1], [1]),            # the AR step: tree 1, one request = 64 rows
]
CUDA_GRID = GRID + KIMI_GRID
# (path, dtype) pairs run on every grid case they can take; auto is what callers get.
# mma16 / mma-small / mma-smallq: the mma path with KDT_MMA_TILE=16 / small / smallq (the
# previous 16-row tile configuration and the two sm_120 ones, forced where they fit).
MMA_VARIANTS = {"mma16": "16", "mma-small": "small", "mma-smallq": "smallq"}
CUDA_PATHS = [("auto", "f32"), ("simt", "f32"), ("auto", "bf16"), ("simt", "bf16"), ("mma", "bf16"),
              *((v, "bf16") for v in MMA_VARIANTS), ("sm90a", "bf16")]
TC_ONLY = ("mma", *MMA_VARIANTS, "sm90a")  # paths that take bf16 at d_latent 512 / d_rope 64 only


def _library_path(path, monkeypatch):
    """The library's path name for a test path; an mma variant sets KDT_MMA_TILE (read per
    call)."""
    if path in MMA_VARIANTS:
        monkeypatch.setenv("KDT_MMA_TILE", MMA_VARIANTS[path])
        return "mma"
    monkeypatch.delenv("KDT_MMA_TILE", raising=False)
    return path


def _path_or_skip(attention, path):
    """Skips when this build or device cannot run `path` at all (sm90a: not built, not sm_90),
    with the library's reason; refusals of particular calls are tested elsewhere."""
    if path != "sm90a":
        return
    import torch

    from engine.native._lib import NativeError

    rng = np.random.default_rng(0)
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 1, 1, 512, 64, [16], [1])
    t = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    bf = lambda x: t(x).to(torch.bfloat16)  # noqa: E731
    try:
        attention.verify_attention(bf(q_lat), bf(q_pe), bf(kv), t(qi), t(ki), t(vis), scale,
                                   device="cuda", path=path)
    except NativeError as e:
        if e.status == 2:  # KDT_ERR_UNSUPPORTED
            pytest.skip(f"path {path} unavailable here: {e}")
        raise


@pytest.mark.cuda
@pytest.mark.parametrize("bs,H,dl,dr,prefixes,trees", CUDA_GRID)
@pytest.mark.parametrize("path,dtype", CUDA_PATHS)
def test_cuda_matches_reference(bs, H, dl, dr, prefixes, trees, path, dtype, monkeypatch):
    attention = _attention()
    _cuda_or_skip(attention)
    if path in TC_ONLY and (dl, dr) != (512, 64):
        pytest.skip(f"the {path} path takes d_latent 512 / d_rope 64 only (refusal of mma: "
                    "test_cuda_forced_path_errors)")
    path = _library_path(path, monkeypatch)
    _path_or_skip(attention, path)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    check(attention, random_case(rng, bs, H, dl, dr, prefixes, trees), "cuda", dtype, seed, path)


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["simt", "mma", *MMA_VARIANTS, "sm90a"])
def test_cuda_masked_out_row_is_empty_state(path, monkeypatch):
    """A query that sees nothing (prefix 0, no visibility bit) gets out 0 and lse -inf on every
    CUDA path, and its neighbours are unaffected."""
    attention = _attention()
    _cuda_or_skip(attention)
    path = _library_path(path, monkeypatch)
    _path_or_skip(attention, path)
    import torch

    rng = np.random.default_rng()
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 1, 4, 512, 64, [0], [3])
    vis[1] = 0
    t = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    bf = lambda x: t(x).to(torch.bfloat16)  # noqa: E731
    out, lse = attention.verify_attention(bf(q_lat), bf(q_pe), bf(kv), t(qi), t(ki), t(vis), scale,
                                          device="cuda", path=path)
    out, lse = out.cpu().numpy(), lse.cpu().numpy()
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    assert np.all(np.isfinite(lse[[0, 2]]))


@pytest.mark.cuda
def test_cuda_forced_path_errors():
    """Forcing a path that cannot take the call fails with the library's reason."""
    from engine.native._lib import NativeError

    attention = _attention()
    _cuda_or_skip(attention)
    import torch

    rng = np.random.default_rng()
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 1, 2, 64, 16, [5], [3])
    t = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    args = [t(x) for x in (q_lat, q_pe, kv, qi, ki, vis)] + [scale]
    with pytest.raises(NativeError, match="needs a bfloat16 cache"):
        attention.verify_attention(*args, device="cuda", path="mma")
    bf = [a.to(torch.bfloat16) for a in args[:3]] + args[3:]
    with pytest.raises(NativeError, match="d_latent 512 and d_rope 64"):
        attention.verify_attention(*bf, device="cuda", path="mma")
    with pytest.raises(NativeError, match="KDT_VERIFY_PATH=cpu but the backend is KDT_BACKEND_CUDA"):
        attention.verify_attention(*args, device="cuda", path="cpu")


def test_cpu_forced_path_errors(monkeypatch):
    """A CUDA path forced on the CPU backend, an unknown path name (Python) and an unknown
    KDT_VERIFY_PATH value (the library, read per call) are clear errors; 'cpu' and 'auto' run."""
    from engine.native._lib import NativeError

    attention = _attention()
    rng = np.random.default_rng()
    case = random_case(rng, 1, 2, 32, 8, [3], [2])
    for path in ("simt", "mma", "sm90a"):
        with pytest.raises(NativeError, match="forces a CUDA path"):
            attention.verify_attention(*case, path=path)
    with pytest.raises(ValueError, match="path = 'fast' is not one of"):
        attention.verify_attention(*case, path="fast")
    monkeypatch.setenv("KDT_VERIFY_PATH", "fast")
    with pytest.raises(NativeError, match="KDT_VERIFY_PATH = 'fast' is not one of"):
        attention.verify_attention(*case)
    monkeypatch.delenv("KDT_VERIFY_PATH")
    a, _ = attention.verify_attention(*case, path="cpu")
    b, _ = attention.verify_attention(*case, path="auto")
    assert np.array_equal(a, b)


def test_cpu_numpy_bf16_bits_equal_torch_bf16():
    """numpy uint16 (raw bfloat16 bits) and torch.bfloat16 inputs are the same call: identical
    results, bit for bit."""
    torch = pytest.importorskip("torch")
    attention = _attention()
    rng = np.random.default_rng()
    q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, 3, 3, 64, 16, [0, 37], [1, 17])
    tq, tp, tk = (torch.from_numpy(x).to(torch.bfloat16) for x in (q_lat, q_pe, kv))
    out_t, lse_t = attention.verify_attention(tq, tp, tk, torch.from_numpy(qi), torch.from_numpy(ki),
                                              torch.from_numpy(vis), scale)
    bits = [t.view(torch.int16).numpy().view(np.uint16) for t in (tq, tp, tk)]
    out_n, lse_n = attention.verify_attention(*bits, qi, ki, vis, scale)
    assert np.array_equal(out_t.numpy(), out_n) and np.array_equal(lse_t.numpy(), lse_n)


def _dense_f64_cuda(q_lat, q_pe, kv, qi, ki, vis, scale):
    """Dense float64 softmax per request on the GPU, for sizes where engine.reference.mla's numpy path
    would take minutes (P = 32k, 64 heads); an independent path (no splits, no online merge)."""
    import torch

    q = torch.cat([q_lat, q_pe], 2).double()
    kv64, dl = kv.double(), q_lat.shape[2]
    out = torch.zeros(q_lat.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q_lat.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    vis_t = torch.from_numpy(vis.astype(np.int64)).to(q.device)
    for b in range(len(qi) - 1):
        q0, q1, k0, k1 = int(qi[b]), int(qi[b + 1]), int(ki[b]), int(ki[b + 1])
        n, P = q1 - q0, (k1 - k0) - (q1 - q0)
        s = torch.einsum("nhd,md->nhm", q[q0:q1], kv64[k0:k1]) * scale
        j = torch.arange(n, device=q.device)
        bits = ((vis_t[q0:q1][:, j // 32] >> (j % 32)) & 1).bool()
        mask = torch.cat([torch.ones(n, P, dtype=torch.bool, device=q.device), bits], 1)
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        lse[q0:q1] = torch.logsumexp(s, 2)
        out[q0:q1] = torch.einsum("nhm,md->nhd", torch.exp(s - lse[q0:q1, :, None]), kv64[k0:k1, :dl])
    return out.cpu().numpy(), lse.cpu().numpy()


@pytest.mark.cuda
@pytest.mark.parametrize("path,dtype", CUDA_PATHS)
def test_cuda_kimi_shape_long_prefix(path, dtype, monkeypatch):
    """Kimi K2 attention (64 heads, 512 + 64) with a 32k prefix and a 64-node tree: long
    chunks per prefix split, where accumulation bias would show (a fp32-bound tensor-core
    version once drifted to 2.7e-5 here on the H200), per path."""
    attention = _attention()
    _cuda_or_skip(attention)
    path = _library_path(path, monkeypatch)
    _path_or_skip(attention, path)
    import torch

    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, P, H, dl, dr = 64, 32768, 64, 512, 64
    vis = random_tree_visibility(rng, n, 2)
    qi, ki = np.array([0, n], np.int32), np.array([0, n + P], np.int32)
    cast = (lambda t: t.to(torch.bfloat16)) if dtype == "bf16" else (lambda t: t)
    q_lat = cast(torch.randn(n, H, dl, generator=g, device="cuda"))
    q_pe = cast(torch.randn(n, H, dr, generator=g, device="cuda"))
    kv = cast(torch.randn(n + P, dl + dr, generator=g, device="cuda"))
    scale = 1.8 / np.sqrt(dl + dr)
    dev = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    out, lse = attention.verify_attention(q_lat, q_pe, kv, dev(qi), dev(ki), dev(vis), scale,
                                          device="cuda", max_tree=n, max_kv=n + P, path=path)
    ref_out, ref_lse = _dense_f64_cuda(q_lat.float(), q_pe.float(), kv.float(), qi, ki, vis, scale)
    e_out, e_lse = rel_err(out.cpu().numpy(), ref_out), rel_err(lse.cpu().numpy(), ref_lse)
    tol = tolerance("cuda", dtype, path)
    assert e_out < tol and e_lse < tol, f"{path}/{dtype}: out {e_out:.3g}, lse {e_lse:.3g}; seed {seed}"


def test_cpu_batched_equals_one_request_at_a_time():
    """Hypothesis: a ragged batch gives, bit for bit, what each request gives alone (the index
    pointers are honoured exactly; no state leaks between requests)."""
    from hypothesis import given, settings, strategies as st

    attention = _attention()

    @settings(max_examples=40, deadline=None)
    @given(bs=st.integers(1, 5), H=st.integers(1, 4), dl=st.sampled_from([8, 32, 40]),
           dr=st.sampled_from([0, 8, 16]), seed=st.integers(0, 2**32 - 1))
    def prop(bs, H, dl, dr, seed):
        rng = np.random.default_rng(seed)
        q_lat, q_pe, kv, qi, ki, vis, scale = random_case(rng, bs, H, dl, dr, [0, 1, 5, 40], [1, 3, 33])
        out, lse = attention.verify_attention(q_lat, q_pe, kv, qi, ki, vis, scale)
        for b in range(bs):
            q0, q1, k0, k1 = qi[b], qi[b + 1], ki[b], ki[b + 1]
            o1, l1 = attention.verify_attention(
                q_lat[q0:q1], q_pe[q0:q1], kv[k0:k1], np.array([0, q1 - q0], np.int32),
                np.array([0, k1 - k0], np.int32), np.ascontiguousarray(vis[q0:q1]), scale)
            assert np.array_equal(o1, out[q0:q1]) and np.array_equal(l1, lse[q0:q1]), f"request {b}, seed {seed}"

    prop()
