"""The target architecture (docs/MODEL.md) in torch, for training only; `export` writes the
engine's format (config.json + model.safetensors, as engine.reference.model.save_weights).

The same function as engine.reference.model.Model over a causal prefill from position 0
(tests/test_training_target.py: FP32 logits within 1e-4 of the float64 reference and of the
native engine), written for training speed:

- MLA in its plain (non-absorbed) form: `k_nope = W_UK c_kv`, `v = W_UV c_kv` per head, the one
  rope key `k_pe` shared by the heads, and one scaled_dot_product_attention (causal, scale
  `softmax_scale(cfg)`). Equal to the absorbed form, `q_nope . (W_UK c) = (q_nope W_UK) . c`.
- Rotary embedding on interleaved pairs with the YaRN ramp and magnitude factor: the cos/sin
  tables are the reference's own (model_ops.rope_cos_sin, float64, rounded once to float32).
- MoE with the reference's router (sigmoid scores, e_score_correction_bias for the choice only,
  group-limited top-k, normalised unbiased weights times routed_scaling_factor) and a shared
  expert. The experts run densely: all E experts' gate and up projections in one matmul, their
  activations multiplied by the routing weight (0 for experts not picked), then one down matmul
  over the concatenation: the sum over picked experts exactly (a zero weight adds zero), with 3
  large matmuls instead of E gathers and scatters. It costs E/k times the sparse FLOPs of the
  experts, which at E = 8 is cheaper than the host synchronisations of a gather per expert.
- The correction bias is not trained by gradient: `balance_router` moves it as DeepSeek-V3's
  auxiliary-loss-free balancing does (bias += u * sign(mean load - load of the expert)).

Norms, the router and the softmax run in float32 under bf16 autocast; parameters are float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.reference.model import ModelConfig, save_weights, tensor_shapes
from engine.reference.model_ops import rope_cos_sin, softmax_scale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        """float32 out (float64 for float64 input: the exactness checks)."""
        x = _wide(x)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(x.dtype)


def _wide(x):
    """x as float32, or float64 when it is float64 (norms, rope and router run wide)."""
    return x if x.dtype == torch.float64 else x.float()


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)  # weight [out, in], y = x W^T (the HF layout)


def apply_rope(x, cos, sin):
    """x [..., T, ..., dr] with pairs (2i, 2i+1) interleaved; cos/sin [T, dr/2] broadcast by the
    caller's view. Returns the rotated pairs, still interleaved."""
    x0, x1 = _wide(x[..., 0::2]), _wide(x[..., 1::2])
    cos, sin = cos.to(x0.dtype), sin.to(x0.dtype)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        if cfg.q_lora_rank:
            self.q_a_proj = _linear(D, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = _linear(cfg.q_lora_rank, H * cfg.qk_head_dim)
        else:
            self.q_proj = _linear(D, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = _linear(H * cfg.v_head_dim, D)
        self.scale = softmax_scale(cfg)

    def forward(self, h, cos, sin):
        """h [B, T, D] at positions 0..T-1, causal; cos/sin [T, dr/2]."""
        cfg = self.cfg
        B, T, _ = h.shape
        H, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))) if cfg.q_lora_rank else self.q_proj(h)
        q = q.view(B, T, H, dn + dr)
        q_pe = apply_rope(q[..., dn:], cos[:, None], sin[:, None])                # [B, T, H, dr]
        kv = self.kv_a_proj_with_mqa(h)                                             # [B, T, r + dr]
        c_kv = self.kv_a_layernorm(kv[..., :r])                                     # the latent cache
        k_pe = apply_rope(kv[..., r:], cos, sin)                                    # [B, T, dr]
        kvb = self.kv_b_proj(c_kv).view(B, T, H, dn + dv)
        k_nope, v = kvb[..., :dn], kvb[..., dn:]
        dt = k_nope.dtype
        qq = torch.cat([q[..., :dn], q_pe.to(dt)], -1).transpose(1, 2)             # [B, H, T, dn+dr]
        kk = torch.cat([k_nope, k_pe.to(dt)[:, :, None].expand(B, T, H, dr)], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qq, kk, v.transpose(1, 2), is_causal=True,
                                           scale=self.scale)                        # [B, H, T, dv]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * dv))


class MLP(nn.Module):
    def __init__(self, D: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(D, inter), _linear(D, inter), _linear(inter, D)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """The router's parameters under their HF names: weight [E, D] (trained) and
    e_score_correction_bias [E] (a buffer, moved by balance_router)."""

    def __init__(self, E: int, D: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, D))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate = Gate(E, D)
        # Experts stacked: gate/up [E, I, D], down [E, D, I] (per expert the HF shapes).
        self.experts_gate = nn.Parameter(torch.empty(E, I, D))
        self.experts_up = nn.Parameter(torch.empty(E, I, D))
        self.experts_down = nn.Parameter(torch.empty(E, D, I))
        self.shared_experts = MLP(D, I * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.register_buffer("load", torch.zeros(E), persistent=False)  # tokens per expert, last forward

    def route(self, x):
        """x [N, D] -> routing weights [N, E] (0 for experts not picked), as model_ops.route."""
        cfg = self.cfg
        N, E, G = x.shape[0], cfg.n_routed_experts, cfg.n_group
        with torch.autocast(x.device.type, enabled=False):  # the router in float32 (or 64)
            xw = _wide(x)
            scores = torch.sigmoid(xw @ self.gate.weight.to(xw.dtype).T)            # [N, E]
        choice = scores + self.gate.e_score_correction_bias.to(scores.dtype)
        per_group = E // G
        grouped = choice.view(N, G, per_group)
        group_scores = grouped.topk(2, -1).values.sum(-1) if per_group >= 2 else grouped[..., 0]
        kept = group_scores.topk(cfg.topk_group, -1).indices                        # [N, topk_group]
        group_mask = torch.zeros(N, G, dtype=torch.bool, device=x.device).scatter_(1, kept, True)
        masked = choice.masked_fill(~group_mask.repeat_interleave(per_group, 1), float("-inf"))
        ids = masked.topk(cfg.num_experts_per_tok, -1).indices                      # [N, k]
        w = scores.gather(1, ids)
        if cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        if self.training:
            self.load = torch.bincount(ids.flatten(), minlength=E).to(self.load.dtype)
        return torch.zeros_like(scores).scatter_(1, ids, w)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        E, I, D = self.experts_gate.shape
        weights = self.route(x)                                                     # [N, E]
        g = x @ self.experts_gate.reshape(E * I, D).T                               # [N, E*I]
        u = x @ self.experts_up.reshape(E * I, D).T
        a = (F.silu(g) * u).view(-1, E, I) * weights.to(g.dtype)[..., None]
        out = a.reshape(-1, E * I) @ self.experts_down.permute(0, 2, 1).reshape(E * I, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetNet(nn.Module):
    """The target for training. forward(tokens [B, T]) -> (logits [B, T, V], hidden [B, T, D]),
    positions 0..T-1, causal; hidden is the final-norm output (what the drafters read)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
            raise ValueError("TargetNet: only the sigmoid / noaux_tc router (the reference's)")
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size)
        cos, sin = rope_cos_sin(cfg, np.arange(cfg.max_position_embeddings))
        self.register_buffer("rope_cos", torch.tensor(cos, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.tensor(sin, dtype=torch.float32), persistent=False)
        self._cos64, self._sin64 = cos, sin

    def forward(self, tokens):
        T = tokens.shape[1]
        if T > self.cfg.max_position_embeddings:
            raise ValueError(f"TargetNet: {T} tokens > max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        x = self.model.embed_tokens(tokens)
        if x.dtype == torch.float64:  # exactness checks: the reference's float64 tables
            cos = torch.tensor(self._cos64[:T], device=x.device)
            sin = torch.tensor(self._sin64[:T], device=x.device)
        else:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        hidden = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ head.T, hidden

    def moe_layers(self) -> list[MoE]:
        return [l.mlp for l in self.model.layers if isinstance(l.mlp, MoE)]

    @torch.no_grad()
    def balance_router(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each MoE layer's
        correction bias rises for experts that got fewer tokens than the mean in the last
        forward, and falls for those that got more."""
        for moe in self.moe_layers():  # no load yet (no training forward): sign(0) = 0
            moe.gate.e_score_correction_bias += rate * torch.sign(moe.load.mean() - moe.load)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_parameters(self) -> int:
        """Parameters one token's forward multiplies by (the embedding lookup excluded): the k
        picked experts of each MoE layer instead of all E."""
        cfg = self.cfg
        n = sum(p.numel() for name, p in self.named_parameters()
                if not name.startswith("model.embed_tokens") or self.lm_head is None)
        for moe in self.moe_layers():
            per = moe.experts_gate[0].numel() * 3
            n -= per * (cfg.n_routed_experts - cfg.num_experts_per_tok)
        return n


# ---------------------------------------------------------------- initialisation, import, export

@torch.no_grad()
def init_parameters(net: TargetNet, seed: int) -> None:
    """GPT-2-style: linear and embedding N(0, 0.02^2), output projections (o_proj, down_proj,
    experts' down) N(0, (0.02 / sqrt(2 layers))^2), norms 1, correction bias 0."""
    gen = torch.Generator().manual_seed(seed)
    out_std = 0.02 / math.sqrt(2 * net.cfg.num_hidden_layers)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        std = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts_down")) else 0.02
        p.copy_(torch.randn(p.shape, generator=gen) * std)
    for moe in net.moe_layers():
        moe.gate.e_score_correction_bias.zero_()


def _engine_names(net: TargetNet) -> dict[str, torch.Tensor]:
    """{engine tensor name: tensor} (experts split out of their stacks; the bias included)."""
    out = {}
    for name, t in net.state_dict().items():
        if name.endswith(("experts_gate", "experts_up", "experts_down")):
            base, kind = name.rsplit(".", 1)
            proj = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}[kind]
            for e in range(t.shape[0]):
                out[f"{base}.experts.{e}.{proj}.weight"] = t[e]
        else:
            out[name] = t
    return out


def engine_weights(net: TargetNet) -> dict[str, np.ndarray]:
    """The weights as the engine's format names them, float32 numpy; checked against
    engine.reference.model.tensor_shapes (every name, every shape, nothing extra)."""
    w = {k: v.detach().float().cpu().numpy() for k, v in _engine_names(net).items()}
    shapes = tensor_shapes(net.cfg)
    if set(w) != set(shapes):
        raise AssertionError(f"export: names differ from the format: missing "
                             f"{sorted(set(shapes) - set(w))[:5]}, extra {sorted(set(w) - set(shapes))[:5]}")
    for k, shape in shapes.items():
        if tuple(w[k].shape) != shape:
            raise AssertionError(f"export: {k} has shape {list(w[k].shape)}, the format says {list(shape)}")
    return w


def export(net: TargetNet, out_dir: str | Path) -> Path:
    """Writes out_dir/config.json and out_dir/model.safetensors (float32), the engine's format."""
    save_weights(out_dir, net.cfg, engine_weights(net))
    return Path(out_dir)


@torch.no_grad()
def from_engine_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> TargetNet:
    """A TargetNet holding weights in the engine's format (engine.reference.model.load_weights)."""
    net = TargetNet(cfg)
    names = _engine_names(net)
    missing = sorted(set(names) - set(weights))
    if missing:
        raise ValueError(f"from_engine_weights: missing tensors {missing[:5]}")
    for k, t in names.items():
        t.copy_(torch.as_tensor(np.asarray(weights[k]), dtype=t.dtype))  # views of the stacks
    return net
