"""The pieces of the reference model (docs/MODEL.md, "The math"), each checked in
tests/test_model.py against a direct formula: rotary embedding on interleaved pairs with the
YaRN frequency ramp and magnitude factor, the softmax scale, RMSNorm, SwiGLU, and the DeepSeek-V3
noaux_tc router. float64 numpy; `cfg` is an engine.reference.model.ModelConfig.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.reference.model import ModelConfig


# ---------------------------------------------------------------- rotary, YaRN, softmax scale

def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [dr/2] float64, with the YaRN ramp between interpolation and extrapolation."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freq_extra = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    rs = cfg.rope_scaling
    if rs is None:
        return freq_extra
    factor = float(rs["factor"])
    freq_inter = freq_extra / factor
    orig = int(rs["original_max_position_embeddings"])
    low = max(math.floor(_yarn_correction_dim(rs["beta_fast"], dim, base, orig)), 0)
    high = min(math.ceil(_yarn_correction_dim(rs["beta_slow"], dim, base, orig)), dim - 1)
    if low == high:
        high += 0.001  # the ramp is a step; avoid 0/0 as the HF code does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extra_weight = 1.0 - ramp  # 1 for the fast (high-frequency) dims: those keep freq_extra
    return freq_inter * (1.0 - extra_weight) + freq_extra * extra_weight


def rope_mscale(cfg: ModelConfig) -> float:
    """YaRN magnitude factor multiplying cos and sin (1 without YaRN)."""
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0
    f = float(rs["factor"])
    return yarn_get_mscale(f, float(rs["mscale"])) / yarn_get_mscale(f, float(rs["mscale_all_dim"]))


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (HF modeling_deepseek)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.get("mscale_all_dim"):
        m = yarn_get_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale *= m * m
    return scale


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, dr/2] float64 for integer positions [n], already times rope_mscale."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * rope_inv_freq(cfg)[None, :]
    m = rope_mscale(cfg)
    return np.cos(angles) * m, np.sin(angles) * m


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotates interleaved pairs (x[..., 2i], x[..., 2i+1]) by angle i; x is [n, ..., dr].

    cos/sin are [n, dr/2]; the result keeps the interleaved layout (the cache stores it so).
    """
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


# ---------------------------------------------------------------- small pieces

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down(silu(gate x) * up x); x [n, D], gate/up [I, D], down [D, I]."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def _route_choice(cfg: ModelConfig, x: np.ndarray, gate_w: np.ndarray, bias: np.ndarray):
    """route's two cuts: (scores [n, E], group scores [n, G], the choice values with the experts
    of groups not kept at -inf [n, E])."""
    n, E = x.shape[0], cfg.n_routed_experts
    scores = 1.0 / (1.0 + np.exp(-(x @ gate_w.T)))  # [n, E]
    choice = scores + bias[None, :]
    per_group = E // cfg.n_group
    grouped = choice.reshape(n, cfg.n_group, per_group)
    group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(-1) if per_group >= 2 \
        else grouped[..., 0]  # [n, G]
    kept_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :cfg.topk_group]
    group_mask = np.zeros((n, cfg.n_group), dtype=bool)
    np.put_along_axis(group_mask, kept_groups, True, axis=-1)
    masked = np.where(np.repeat(group_mask, per_group, axis=-1), choice, -np.inf)
    return scores, group_scores, masked


def route(cfg: ModelConfig, x: np.ndarray, gate_w: np.ndarray, bias: np.ndarray):
    """DeepSeek-V3 noaux_tc router on x [n, D]. Returns (expert ids [n, k] int64, weights [n, k]).

    scores = sigmoid(x W^T); choice = scores + bias; a group's score is the sum of its top-2
    choice values; keep the topk_group best groups; pick the k best choice values among the
    experts of kept groups; weights = the unbiased scores of those, divided by their sum when
    norm_topk_prob, times routed_scaling_factor. Ties go to the lower index (stable sorts).
    """
    scores, _, masked = _route_choice(cfg, x, gate_w, bias)
    ids = np.argsort(-masked, axis=-1, kind="stable")[:, :cfg.num_experts_per_tok]
    w = np.take_along_axis(scores, ids, axis=-1)
    if cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(np.int64), w * cfg.routed_scaling_factor


def route_margins(cfg: ModelConfig, x: np.ndarray, gate_w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Per row of x [n, D], how far route's choice is from flipping: the smaller of the gap between
    the topk_group-th best group score and the next, and the gap between the k-th best choice
    value among kept groups and the next (inf where a cut has no competitor). A row whose margin
    is below the rounding of a narrower float (FP32: ~1e-7 here) may route differently there, and
    its output then differs by a whole expert: a discontinuity, not an error."""
    _, group_scores, masked = _route_choice(cfg, x, gate_w, bias)

    def gap(v, k):  # v [n, m] descending-sorted: v[:, k-1] - v[:, k], inf when there is no k-th
        if k >= v.shape[1]:
            return np.full(v.shape[0], np.inf)
        with np.errstate(invalid="ignore"):
            g = v[:, k - 1] - v[:, k]
        return np.where(np.isfinite(v[:, k]), g, np.inf)

    return np.minimum(gap(-np.sort(-group_scores, axis=-1), cfg.topk_group),
                      gap(-np.sort(-masked, axis=-1), cfg.num_experts_per_tok))
