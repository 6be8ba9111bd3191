"""engine.reference.model and engine.reference.model_ops: rope / YaRN / router pieces against direct formulas, the absorbed forward against
an independent non-absorbed one, cache consistency (prefill = AR = tree verify), compaction, and
the weights format round trip.

Every test draws a fresh seed and prints it (pytest shows it on failure). float64 comparisons use
the relative error |out - ref| / |ref| (norm-wise) under 1e-10: both sides are float64 and differ
only in summation order.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from engine.reference import model as M
from engine.reference import model_ops as O
from model_helpers import rel_err, single_thread_blas  # noqa: F401 (autouse fixture)

REL64 = 1e-10


@pytest.fixture(scope="module")
def tiny():
    seed = int(np.random.SeedSequence().entropy % (2**31))
    print(f"weights seed = {seed}")
    cfg = M.tiny_config()
    return M.Model(cfg, M.init_weights(cfg, seed))


# ---------------------------------------------------------------- rope and YaRN

def test_yarn_pieces_match_hand_derived_values_for_the_tiny_config():
    cfg = M.tiny_config()
    # cdim(b) = 16 ln(128 / (2 pi b)) / (2 ln 10000): cdim(32) = -0.392 -> low 0, cdim(1) = 2.618 -> high 3
    ramp = np.array([0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1])
    extra = np.array([10000.0 ** (-2 * i / 16) for i in range(8)])
    expected = extra * (1 - ramp) + extra / 4.0 * ramp
    assert rel_err(O.rope_inv_freq(cfg), expected) < 1e-14
    g = lambda m: 0.1 * m * math.log(4.0) + 1.0  # noqa: E731
    assert abs(O.rope_mscale(cfg) - g(0.9) / g(1.0)) < 1e-15
    assert abs(O.softmax_scale(cfg) - 48 ** -0.5 * g(1.0) ** 2) < 1e-15


def test_no_rope_scaling_gives_plain_rope_and_plain_scale():
    d = dict(M.TINY_CONFIG, rope_scaling=None)
    cfg = M.ModelConfig.from_dict(d)
    assert rel_err(O.rope_inv_freq(cfg), 10000.0 ** (-np.arange(0, 16, 2) / 16)) < 1e-15
    assert O.rope_mscale(cfg) == 1.0 and O.softmax_scale(cfg) == 48 ** -0.5


def test_rope_is_complex_rotation_of_interleaved_pairs(rng):
    cfg = M.tiny_config()
    n, H, dr = 7, 3, cfg.qk_rope_head_dim
    x = rng.standard_normal((n, H, dr))
    pos = rng.integers(0, 1000, n)
    cos, sin = O.rope_cos_sin(cfg, pos)
    out = O.apply_rope(x, cos, sin)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, None, None] * O.rope_inv_freq(cfg)) \
        * O.rope_mscale(cfg)
    ref = np.empty_like(x)
    ref[..., 0::2], ref[..., 1::2] = z.real, z.imag
    assert rel_err(out, ref) < 1e-13


def test_rope_matches_hf_deinterleave_then_rotate_half_up_to_the_permutation(rng):
    # HF modeling_deepseek: x viewed (d/2, 2) and transposed (evens then odds), then
    # x * cos(cat(f, f)) + rotate_half(x) * sin(cat(f, f)). That is our output, permuted.
    cfg = M.tiny_config()
    n, dr = 5, cfg.qk_rope_head_dim
    x = rng.standard_normal((n, dr))
    pos = rng.integers(0, 500, n)
    f = pos[:, None] * O.rope_inv_freq(cfg)[None, :]
    cos = np.concatenate([np.cos(f), np.cos(f)], 1) * O.rope_mscale(cfg)
    sin = np.concatenate([np.sin(f), np.sin(f)], 1) * O.rope_mscale(cfg)
    xp = np.concatenate([x[:, 0::2], x[:, 1::2]], 1)
    rot = np.concatenate([-xp[:, dr // 2:], xp[:, :dr // 2]], 1)
    hf = xp * cos + rot * sin
    ours = O.apply_rope(x, *O.rope_cos_sin(cfg, pos))
    assert rel_err(np.concatenate([ours[:, 0::2], ours[:, 1::2]], 1), hf) < 1e-13


def test_rope_scores_depend_only_on_the_position_difference(rng):
    cfg = M.tiny_config()
    q, k = rng.standard_normal((1, 16)), rng.standard_normal((1, 16))
    a, b, shift = int(rng.integers(0, 300)), int(rng.integers(0, 300)), int(rng.integers(1, 200))

    def score(pq, pk):
        return float(O.apply_rope(q, *O.rope_cos_sin(cfg, [pq]))[0]
                     @ O.apply_rope(k, *O.rope_cos_sin(cfg, [pk]))[0])
    assert abs(score(a, b) - score(a + shift, b + shift)) < 1e-10 * max(1.0, abs(score(a, b)))


# ---------------------------------------------------------------- router

def _route_direct(cfg, x, gate_w, bias):
    """The noaux_tc router with Python loops and sorted(), one token at a time."""
    E, G = cfg.n_routed_experts, cfg.n_group
    per = E // G
    all_ids, all_w = [], []
    for row in x:
        s = [1 / (1 + math.exp(-float(row @ gate_w[e]))) for e in range(E)]
        c = [s[e] + float(bias[e]) for e in range(E)]
        gscore = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: (-gscore[g], g))[:cfg.topk_group]
        cand = [e for e in range(E) if e // per in groups]
        ids = sorted(cand, key=lambda e: (-c[e], e))[:cfg.num_experts_per_tok]
        w = [s[e] for e in ids]
        if cfg.norm_topk_prob and len(ids) > 1:
            w = [v / (sum(w) + 1e-20) for v in w]
        all_ids.append(ids)
        all_w.append([v * cfg.routed_scaling_factor for v in w])
    return np.array(all_ids), np.array(all_w)


@pytest.mark.parametrize("over", [{}, {"n_group": 1, "topk_group": 1},
                                  {"n_routed_experts": 12, "n_group": 3, "topk_group": 1,
                                   "num_experts_per_tok": 3, "norm_topk_prob": False}])
def test_router_matches_direct_formula(rng, over):
    cfg = M.ModelConfig.from_dict(dict(M.TINY_CONFIG, **over))
    E, D = cfg.n_routed_experts, cfg.hidden_size
    x = rng.standard_normal((33, D))
    gate_w = rng.standard_normal((E, D)) / math.sqrt(D)
    bias = 0.3 * rng.standard_normal(E)
    ids, w = O.route(cfg, x, gate_w, bias)
    ref_ids, ref_w = _route_direct(cfg, x, gate_w, bias)
    assert (ids == ref_ids).all()
    assert rel_err(w, ref_w) < 1e-14


def test_router_picks_by_biased_score_but_weights_by_unbiased_score():
    cfg = M.ModelConfig.from_dict(dict(M.TINY_CONFIG, n_group=1, topk_group=1))
    x = np.zeros((1, cfg.hidden_size))  # every sigmoid score is 0.5
    bias = np.array([0.0, 0.0, 0.0, 0.4, 0.0, 0.0, 0.2, 0.0])
    ids, w = O.route(cfg, x, np.zeros((8, cfg.hidden_size)), bias)
    assert ids.tolist() == [[3, 6]]
    assert np.allclose(w, [[0.5 * cfg.routed_scaling_factor] * 2], rtol=1e-15)


def test_group_limit_excludes_experts_outside_the_kept_groups():
    # Expert 0 has the best single score but its group (0, 1) has the worst top-2 sum.
    cfg = M.tiny_config()  # 8 experts, 4 groups of 2, keep 2 groups, pick 2
    bias = np.array([0.9, -0.9, 0.5, 0.45, 0.3, 0.3, 0.0, 0.0])
    ids, _ = O.route(cfg, np.zeros((1, cfg.hidden_size)), np.zeros((8, cfg.hidden_size)), bias)
    assert ids.tolist() == [[2, 3]]


def test_route_margins_known_cuts():
    """x = 0 makes every score 0.5, so the cuts are the bias gaps: groups (0,1) (2,3) (4,5) (6,7)
    score 1.9, 1.2, 1.15, 1.0; keep 2 groups (gap 1.2 - 1.15 = 0.05); pick 2 among experts 0-3
    (biases 0.5, 0.4 | 0.3: gap 0.1). The margin is the smaller gap; an exact tie at a cut gives 0."""
    cfg = M.tiny_config()
    zx, zw = np.zeros((1, cfg.hidden_size)), np.zeros((8, cfg.hidden_size))
    bias = np.array([0.5, 0.4, 0.3, -0.1, 0.2, -0.05, 0.0, 0.0])
    assert O.route(cfg, zx, zw, bias)[0].tolist() == [[0, 1]]
    assert O.route_margins(cfg, zx, zw, bias) == pytest.approx([0.05], abs=1e-12)
    bias[1] = 0.32  # groups 1.82, 1.2 | 1.15: 0.05 again; experts (biases) 0.5, 0.32 | 0.3: 0.02
    assert O.route_margins(cfg, zx, zw, bias) == pytest.approx([0.02], abs=1e-12)
    bias[1] = 0.3  # experts 1 and 2 tie for the second pick
    assert O.route_margins(cfg, zx, zw, bias).tolist() == [0.0]


@pytest.mark.parametrize("seed", range(5))
def test_route_margins_bound_the_choice(seed):
    """Moving every choice value by less than a quarter of a row's margin (a group score, the sum
    of two, moves by less than half) never changes that row's experts; the smallest margins are
    where the choice can flip."""
    rng = np.random.default_rng(seed)
    cfg = M.tiny_config()
    E, D = cfg.n_routed_experts, cfg.hidden_size
    x = rng.standard_normal((200, D))
    gate_w = rng.standard_normal((E, D)) / math.sqrt(D)
    bias = 0.3 * rng.standard_normal(E)
    ids = np.sort(O.route(cfg, x, gate_w, bias)[0], axis=-1)  # the set of experts (order aside)
    m = O.route_margins(cfg, x, gate_w, bias)
    assert (m >= 0).all() and np.isfinite(m).all()
    for _ in range(20):
        # a per-row shift of the bias: route sees one bias for all rows, so perturb row by row
        delta = rng.uniform(-1, 1, E)
        for r in range(0, 200, 7):
            d = 0.24 * m[r] * delta / np.abs(delta).max()
            assert (np.sort(O.route(cfg, x[r:r + 1], gate_w, bias + d)[0]) == ids[r]).all(), (seed, r, m[r])
    # and a shift just past the smallest margin can flip a row: the margin is tight somewhere
    r = int(np.argmin(m))
    flips = 0
    for _ in range(200):
        d = 2.01 * m[r] * rng.choice([-1.0, 1.0], E)
        flips += not (np.sort(O.route(cfg, x[r:r + 1], gate_w, bias + d)[0]) == ids[r]).all()
    assert flips > 0, (seed, r, m[r])


# ---------------------------------------------------------------- the forward

def _forward_non_absorbed(model: M.Model, tokens: np.ndarray) -> np.ndarray:
    """Independent causal prefill in the HF form: k_nope and v from kv_b_proj per head, full
    [dn+dr] keys with the rope key broadcast over heads, HF rope (rotate-half on the
    de-interleaved layout). Returns logits [n, V]."""
    cfg, w = model.cfg, model.w
    n, H = len(tokens), cfg.num_attention_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    f = np.arange(n)[:, None] * O.rope_inv_freq(cfg)[None, :]
    cos = np.concatenate([np.cos(f), np.cos(f)], 1) * O.rope_mscale(cfg)
    sin = np.concatenate([np.sin(f), np.sin(f)], 1) * O.rope_mscale(cfg)

    def hf_rope(x):  # x [n, ..., dr]
        xp = np.concatenate([x[..., 0::2], x[..., 1::2]], -1)
        rot = np.concatenate([-xp[..., dr // 2:], xp[..., :dr // 2]], -1)
        shape = (n,) + (1,) * (x.ndim - 2) + (dr,)
        return xp * cos.reshape(shape) + rot * sin.reshape(shape)

    def rms(x, wt):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * wt

    x = w["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (rms(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"])
             @ w[a + "q_b_proj.weight"].T).reshape(n, H, dn + dr)
        kv = h @ w[a + "kv_a_proj_with_mqa.weight"].T
        ckv = rms(kv[:, :r], w[a + "kv_a_layernorm.weight"])
        kvb = (ckv @ w[a + "kv_b_proj.weight"].T).reshape(n, H, dn + dv)
        k = np.concatenate([kvb[..., :dn], np.repeat(hf_rope(kv[:, None, r:]), H, 1)], -1)
        qf = np.concatenate([q[..., :dn], hf_rope(q[..., dn:])], -1)
        s = np.einsum("ihd,jhd->hij", qf, k) * O.softmax_scale(cfg)
        s = np.where(causal[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", pr, kvb[..., dn:]).reshape(n, H * dv)
        x = x + o @ w[a + "o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (model._moe(i, h) if cfg.is_moe_layer(i) else model._mlp(p + "mlp.", h))
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_absorbed_forward_equals_non_absorbed_hf_form(tiny, rng):
    tokens = rng.integers(0, tiny.cfg.vocab_size, int(rng.integers(1, 40)))
    logits, hidden = tiny.forward(tokens, np.arange(len(tokens)), tiny.new_cache(len(tokens)))
    assert rel_err(logits, _forward_non_absorbed(tiny, tokens)) < REL64
    assert rel_err(hidden @ tiny.w["lm_head.weight"].T, logits) < 1e-14


def test_prefill_equals_token_by_token_decode(tiny, rng):
    tokens = rng.integers(0, tiny.cfg.vocab_size, int(rng.integers(2, 30)))
    n = len(tokens)
    full, _ = tiny.forward(tokens, np.arange(n), tiny.new_cache(n))
    cache = tiny.new_cache(n)
    split = int(rng.integers(1, n))
    parts = [tiny.forward(tokens[:split], np.arange(split), cache)[0]]
    for t in range(split, n):
        parts.append(tiny.forward(tokens[t:t + 1], [t], cache)[0])
    assert cache.length == n
    assert rel_err(np.concatenate(parts), full) < REL64


def _random_tree(rng, n):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    depths = [0] * n
    vis = np.zeros((n, n), bool)
    for i in range(n):
        if i:
            depths[i] = depths[parents[i]] + 1
            vis[i] = vis[parents[i]]
        vis[i, i] = True
    return parents, np.array(depths), vis


def test_tree_verify_equals_forwarding_each_path_and_compaction_equals_prefill(tiny, rng):
    V = tiny.cfg.vocab_size
    prefix = rng.integers(0, V, int(rng.integers(1, 20)))
    P, n = len(prefix), int(rng.integers(1, 20))
    parents, depths, vis = _random_tree(rng, n)
    tree_tokens = rng.integers(0, V, n)
    cache = tiny.new_cache(P + n)
    tiny.forward(prefix, np.arange(P), cache)
    logits, hidden = tiny.forward(tree_tokens, P + depths, cache, vis)
    paths = [np.flatnonzero(vis[i]) for i in range(n)]  # ancestors in index order = path order
    for i in rng.permutation(n)[:5]:
        seq = np.concatenate([prefix, tree_tokens[paths[i]]])
        ref, ref_h = tiny.forward(seq, np.arange(len(seq)), tiny.new_cache(len(seq)))
        assert rel_err(logits[i], ref[-1]) < REL64, f"node {i}, path {paths[i]}"
        assert rel_err(hidden[i], ref_h[-1]) < REL64
    leaf = int(rng.integers(0, n))
    keep = paths[leaf]
    cache.compact(P, keep)
    assert cache.length == P + len(keep)
    seq = np.concatenate([prefix, tree_tokens[keep]])
    ref_cache = tiny.new_cache(len(seq))
    tiny.forward(seq, np.arange(len(seq)), ref_cache)
    assert rel_err(cache.ckv[:, :len(seq)], ref_cache.ckv) < REL64
    assert rel_err(cache.kpe[:, :len(seq)], ref_cache.kpe) < REL64


def test_compaction_reads_before_it_writes():
    cfg = M.tiny_config()
    cache = M.LatentCache(cfg, 12)
    cache.ckv[:, :, 0] = np.arange(12)
    cache.compact(2, np.array([0, 1, 3, 4, 7]))  # rows 2,3,5,6,9 -> 2..6; row 5 is read after 4 is written
    assert cache.ckv[0, :7, 0].tolist() == [0, 1, 2, 3, 5, 6, 9] and cache.length == 7


def test_forward_rejects_overflow_and_bad_tokens(tiny):
    with pytest.raises(ValueError, match="capacity"):
        tiny.forward([1, 2, 3], [0, 1, 2], tiny.new_cache(2))
    with pytest.raises(ValueError, match="token ids"):
        tiny.forward([tiny.cfg.vocab_size], [0], tiny.new_cache(2))


# ---------------------------------------------------------------- weights format

def test_weights_round_trip_and_tensor_names(tmp_path, rng):
    cfg = M.tiny_config()
    w = M.init_weights(cfg, int(rng.integers(1 << 30)))
    M.save_weights(tmp_path, cfg, w)
    cfg2, w2 = M.load_weights(tmp_path)
    assert cfg2 == cfg
    assert set(w2) == set(w) and all((w2[k] == w[k].astype(np.float64)).all() for k in w)
    assert w["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (64 + 16, 256)
    assert w["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (256, 128)
    assert "model.layers.0.mlp.gate_proj.weight" in w and "model.layers.0.mlp.gate.weight" not in w
    assert w["model.layers.2.mlp.gate.e_score_correction_bias"].shape == (8,)


def test_loader_accepts_bf16_and_sharded_and_ignores_mtp_layers(tmp_path, rng):
    import torch
    from safetensors.torch import save_file

    cfg = M.tiny_config()
    w = M.init_weights(cfg, int(rng.integers(1 << 30)))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    names = sorted(w)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for fname, ns in shards.items():
        tensors = {k: torch.from_numpy(w[k]).to(torch.bfloat16) for k in ns}
        if fname == "b.safetensors":  # an MTP layer beyond num_hidden_layers
            tensors["model.layers.4.eh_proj.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
        save_file(tensors, str(tmp_path / fname))
    weight_map = {k: f for f, ns in shards.items() for k in ns}
    weight_map["model.layers.4.eh_proj.weight"] = "b.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, w2 = M.load_weights(tmp_path)
    for k in names:
        ref = torch.from_numpy(w[k]).to(torch.bfloat16).to(torch.float64).numpy()
        assert (w2[k] == ref).all(), k


def test_loader_errors_name_the_tensor_and_file(tmp_path):
    from safetensors.numpy import save_file

    cfg = M.tiny_config()
    w = M.init_weights(cfg, 0)
    M.save_weights(tmp_path, cfg, w)
    bad = dict(w)
    del bad["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(M.ModelFormatError, match=r"missing tensors.*layers\.2\.self_attn\.kv_b_proj"):
        M.load_weights(tmp_path)
    bad = dict(w, **{"model.norm.weight": np.ones(7, np.float32)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(M.ModelFormatError, match=r"model\.safetensors: tensor model\.norm\.weight has shape \[7\]"):
        M.load_weights(tmp_path)
    bad = dict(w, **{"model.layers.1.extra": np.ones(7, np.float32)})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(M.ModelFormatError, match=r"unexpected tensors.*layers\.1\.extra"):
        M.load_weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(M.ModelFormatError, match="neither model.safetensors"):
        M.load_weights(tmp_path)


def test_config_validation_names_the_field():
    with pytest.raises(M.ModelFormatError, match="missing keys.*kv_lora_rank"):
        M.ModelConfig.from_dict({k: v for k, v in M.TINY_CONFIG.items() if k != "kv_lora_rank"}, "x.json")
    with pytest.raises(M.ModelFormatError, match="x.json: scoring_func = 'softmax'"):
        M.ModelConfig.from_dict(dict(M.TINY_CONFIG, scoring_func="softmax"), "x.json")
    with pytest.raises(M.ModelFormatError, match="n_group"):
        M.ModelConfig.from_dict(dict(M.TINY_CONFIG, n_group=3), "x.json")
    with pytest.raises(M.ModelFormatError, match="yarn needs keys.*beta_fast"):
        rs = {k: v for k, v in M.TINY_CONFIG["rope_scaling"].items() if k != "beta_fast"}
        M.ModelConfig.from_dict(dict(M.TINY_CONFIG, rope_scaling=rs), "x.json")


def test_init_cli_writes_a_model_whose_greedy_output_is_not_degenerate(tmp_path):
    out = tmp_path / "w"
    subprocess.run([sys.executable, "-m", "engine.cli.model", "init", "--out", str(out)], check=True,
                   capture_output=True, text=True)
    for f in ("config.json", "model.safetensors", "drafter_config.json", "drafter.safetensors"):
        assert (out / f).is_file(), f
    stats = M.check(M.Model.from_dir(out), n_prompts=4, new_tokens=32)
    assert stats["logit_std_mean"] > 1.0, stats  # a spread of nats, not near-ties
    assert stats["top1_top2_gap_median"] > 0.1, stats
    assert stats["distinct_tokens_per_sequence_min"] >= 12, stats
    assert stats["longest_repeat_run_max"] <= 3, stats
