"""Reference DeepSeek-V3-style MLA + MoE decoder in float64 numpy: the golden for the engine.

The math is written down in docs/MODEL.md; this module is its executable form. It holds
seeded random weights with the DeepSeek-V3 Hugging Face tensor names, the safetensors round trip,
and `Model` (its config, DeepSeek-V3 `config.json` keys, is in engine.reference.model_config;
its pieces, rotary / YaRN / router, in engine.reference.model_ops): one forward over n new
tokens against a latent KV cache under an arbitrary visibility mask among the new tokens.
Prefill (causal), an AR step (n = 1) and a DDTree verify (ancestor-only) are all that one
forward. Decoding loops live in `engine.reference.decode`.

    python -m engine.cli.model init [--config FILE] [--seed N] --out DIR
    python -m engine.cli.model check --weights DIR      # logit spread and greedy diversity
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from engine.reference.model_config import TINY_CONFIG, ModelConfig, ModelFormatError, load_config
from engine.reference.model_ops import (apply_rope, rms_norm, rope_cos_sin, route, route_margins, softmax_scale,
                                        swiglu)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(TINY_CONFIG, "TINY_CONFIG")


# ---------------------------------------------------------------- weights

def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name (DeepSeek-V3 HF names) and its shape, [out, in] for linear layers."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    s = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if cfg.q_lora_rank:
            s[a + "q_a_proj.weight"] = (cfg.q_lora_rank, D)
            s[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            s[a + "q_b_proj.weight"] = (H * cfg.qk_head_dim, cfg.q_lora_rank)
        else:
            s[a + "q_proj.weight"] = (H * cfg.qk_head_dim, D)
        s[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
        s[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        s[a + "kv_b_proj.weight"] = (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        s[a + "o_proj.weight"] = (D, H * cfg.v_head_dim)
        s[p + "input_layernorm.weight"] = (D,)
        s[p + "post_attention_layernorm.weight"] = (D,)
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            I = cfg.moe_intermediate_size
            s[m + "gate.weight"] = (cfg.n_routed_experts, D)
            s[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                for name, shape in _mlp_shapes(D, I).items():
                    s[f"{m}experts.{e}.{name}"] = shape
            if cfg.n_shared_experts:
                for name, shape in _mlp_shapes(D, I * cfg.n_shared_experts).items():
                    s[f"{m}shared_experts.{name}"] = shape
        else:
            for name, shape in _mlp_shapes(D, cfg.intermediate_size).items():
                s[m + name] = shape
    s["model.norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, D)
    return s


def _mlp_shapes(D: int, I: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj.weight": (I, D), "up_proj.weight": (I, D), "down_proj.weight": (D, I)}


def init_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random float32 weights.

    Scales (why): embeddings N(0, 1) so a token's own vector is a unit-RMS residual; linear
    layers N(0, 1/fan_in) so activations keep unit scale; output projections (o_proj, down_proj)
    at 0.5/sqrt(fan_in): large enough that the context matters (greedy output is no bigram
    loop: about 54 distinct tokens in 64, no token repeated back to back), small enough that
    the current token often predicts the next (a bigram table from 48 greedy sequences predicts
    38% of held-out tokens; 18% at 0.7, 52% at 0.4 which gave runs of 7 equal tokens), as in
    text, so that a small drafter can learn something; norms 1 + 0.1 N(0, 1) and router biases
    0.3 N(0, 1) so an implementation that drops them disagrees; lm_head at 2.5/sqrt(D) so the
    logits have a spread of a few nats (no near-ties, no one-hot saturation).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name == "model.embed_tokens.weight":
            std = 1.0
        elif name.endswith("layernorm.weight") or name == "model.norm.weight":
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            continue
        elif name.endswith("e_score_correction_bias"):
            out[name] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
            continue
        elif name == "lm_head.weight":
            std = 2.5 / math.sqrt(shape[1])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            std = 0.5 / math.sqrt(shape[1])
        else:
            std = 1.0 / math.sqrt(shape[1])
        out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def save_weights(out_dir: str | Path, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
              str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def read_safetensors(path: Path, names=None) -> dict[str, np.ndarray]:
    """float64 arrays from one safetensors file (F32, BF16 or F16 tensors), via torch for bf16."""
    import torch
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in (f.keys() if names is None else names):
                t = f.get_tensor(name)
                if t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                    raise ModelFormatError(f"{path}: tensor {name} has dtype {t.dtype}; "
                                           "expected float32, bfloat16 or float16")
                out[name] = t.to(torch.float64).numpy()
    except ModelFormatError:
        raise
    except Exception as e:  # safetensors raises several types for a bad header
        raise ModelFormatError(f"{path}: cannot read safetensors: {e}") from e
    return out


def load_weights(weights_dir: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and float64 weights from DIR (config.json + model.safetensors, or a sharded
    checkpoint with model.safetensors.index.json). Missing tensors and shape mismatches are
    errors naming the tensor and file; extra tensors are errors too, except those of layers
    beyond num_hidden_layers (DeepSeek-V3's multi-token-prediction layer)."""
    d = Path(weights_dir)
    cfg = load_config(d / CONFIG_FILE)
    shapes = tensor_shapes(cfg)
    if (d / INDEX_FILE).exists():
        weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    elif (d / WEIGHTS_FILE).exists():
        from safetensors import safe_open
        with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
            weight_map = {k: WEIGHTS_FILE for k in f.keys()}
    else:
        raise ModelFormatError(f"{d}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found "
                               f"(create one with: python -m engine.cli.model init --out {d})")
    missing = [k for k in shapes if k not in weight_map]
    if missing:
        raise ModelFormatError(f"{d}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = [k for k in weight_map if k not in shapes and not _beyond_layers(k, cfg)]
    if extra:
        raise ModelFormatError(f"{d}: unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    by_file: dict[str, list[str]] = {}
    for k in shapes:
        by_file.setdefault(weight_map[k], []).append(k)
    weights = {}
    for fname, names in by_file.items():
        weights.update(read_safetensors(d / fname, names))
    for k, shape in shapes.items():
        if weights[k].shape != shape:
            raise ModelFormatError(f"{d / weight_map[k]}: tensor {k} has shape "
                                   f"{list(weights[k].shape)}, config says {list(shape)}")
    return cfg, weights


def _beyond_layers(name: str, cfg: ModelConfig) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
        and int(parts[2]) >= cfg.num_hidden_layers


# ---------------------------------------------------------------- latent KV cache

class LatentCache:
    """Per layer: c_kv [cap, kv_lora_rank] (after kv_a_layernorm) and k_pe [cap, dr] (rope'd,
    interleaved layout). Rows [0, length) are committed; a forward writes its n rows after them."""

    def __init__(self, cfg: ModelConfig, capacity: int):
        L = cfg.num_hidden_layers
        self.ckv = np.zeros((L, capacity, cfg.kv_lora_rank))
        self.kpe = np.zeros((L, capacity, cfg.qk_rope_head_dim))
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.ckv.shape[1]

    def compact(self, start: int, keep: np.ndarray) -> None:
        """Keeps rows start + keep[k] at start + k (keep ascending: DDTREE.md section 5), sets
        length = start + len(keep). Reads every kept row before writing any: keep[k] >= k, so an
        in-place row-by-row copy could overwrite a row it still has to read."""
        keep = np.asarray(keep, dtype=np.int64)
        rows_ckv = self.ckv[:, start + keep].copy()  # read all ...
        rows_kpe = self.kpe[:, start + keep].copy()
        self.ckv[:, start:start + len(keep)] = rows_ckv  # ... then write
        self.kpe[:, start:start + len(keep)] = rows_kpe
        self.length = start + len(keep)


def pack_visibility(vis: np.ndarray) -> np.ndarray:
    """bool [n, n] -> uint32 [n, ceil(n/32)], bit j % 32 of word j // 32 set iff vis[i, j]."""
    n = vis.shape[0]
    W = (n + 31) // 32
    out = np.zeros((n, W), dtype=np.uint32)
    for j in range(n):
        out[vis[:, j], j // 32] |= np.uint32(1 << (j % 32))
    return out


def _attend_latent(q_lat, q_pe, ckv, kpe, prefix_len, vis, scale):
    """Absorbed attention for n queries over prefix rows [0, P) and the n new rows [P, P+n).

    q_lat [n, H, r], q_pe [n, H, dr], ckv [P+n, r], kpe [P+n, dr], vis bool [n, n] (row i sees
    new row j iff vis[i, j]). Returns the latent output [n, H, r]: softmax-weighted sums of c_kv.
    """
    from engine.reference import mla  # lazily: another area's module (docs/DEVELOPING.md, engine.reference.mla)

    out, _lse = mla.tree_verify_attention(
        q_lat, q_pe, ckv[:prefix_len], kpe[:prefix_len], ckv[prefix_len:], kpe[prefix_len:],
        pack_visibility(vis), scale)
    return out


# ---------------------------------------------------------------- the model

class Model:
    """float64 reference. `forward` runs n new tokens against a LatentCache."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray]):
        self.cfg = cfg
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        self.scale = softmax_scale(cfg)
        H, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        # kv_b_proj [H*(dn+dv), r] viewed [H, dn+dv, r]: W_UK = [:, :dn] [H, dn, r], W_UV = [:, dn:] [H, dv, r]
        self.w_uk, self.w_uv = [], []
        for i in range(cfg.num_hidden_layers):
            kvb = self.w[f"model.layers.{i}.self_attn.kv_b_proj.weight"].reshape(H, dn + dv, r)
            self.w_uk.append(kvb[:, :dn, :])
            self.w_uv.append(kvb[:, dn:, :])

    @classmethod
    def from_dir(cls, weights_dir: str | Path) -> "Model":
        return cls(*load_weights(weights_dir))

    def new_cache(self, capacity: int) -> LatentCache:
        return LatentCache(self.cfg, capacity)

    def forward(self, tokens, positions, cache: LatentCache, vis: np.ndarray | None = None,
                margins: list | None = None):
        """n tokens [n] at positions [n] after the cache's committed rows, seeing each other per
        vis bool [n, n] (default causal). Writes their KV rows at [length, length + n) and sets
        length += n (a tree verify then calls cache.compact). Returns (logits [n, V], hidden [n, D]),
        hidden = the final-norm output that the LM head reads (the drafter's input).
        margins: a list to which each MoE layer appends its router's route_margins [n] (how near
        each row's expert choice is to a tie), for tests that compare a narrower float with this."""
        cfg = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        n = len(tokens)
        if vis is None:
            vis = np.tril(np.ones((n, n), dtype=bool))
        P = cache.length
        if P + n > cache.capacity:
            raise ValueError(f"forward: cache capacity {cache.capacity} < length {P} + {n} tokens")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"forward: token ids outside [0, {cfg.vocab_size}): {tokens}")
        cos, sin = rope_cos_sin(cfg, positions)
        x = self.w["model.embed_tokens.weight"][tokens]  # [n, D]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._attention(i, h, cos, sin, cache, P, vis)
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + (self._moe(i, h, margins) if cfg.is_moe_layer(i) else self._mlp(p + "mlp.", h))
        cache.length = P + n
        hidden = rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps)
        head = self.w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        return hidden @ head.T, hidden

    def _attention(self, i, h, cos, sin, cache, P, vis):
        cfg, w = self.cfg, self.w
        a = f"model.layers.{i}.self_attn."
        n, H = h.shape[0], cfg.num_attention_heads
        dn, dr, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q = rms_norm(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], cfg.rms_norm_eps)
            q = q @ w[a + "q_b_proj.weight"].T
        else:
            q = h @ w[a + "q_proj.weight"].T
        q = q.reshape(n, H, dn + dr)
        q_nope, q_pe = q[..., :dn], apply_rope(q[..., dn:], cos, sin)   # [n, H, dn], [n, H, dr]
        kv = h @ w[a + "kv_a_proj_with_mqa.weight"].T                   # [n, r + dr]
        cache.ckv[i, P:P + n] = rms_norm(kv[:, :r], w[a + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
        cache.kpe[i, P:P + n] = apply_rope(kv[:, r:], cos, sin)
        q_lat = np.einsum("nhd,hdr->nhr", q_nope, self.w_uk[i])        # absorb W_UK: [n, H, r]
        o_lat = _attend_latent(q_lat, q_pe, cache.ckv[i, :P + n], cache.kpe[i, :P + n], P, vis,
                               self.scale)
        o = np.einsum("nhr,hvr->nhv", o_lat, self.w_uv[i])              # apply W_UV: [n, H, dv]
        return o.reshape(n, -1) @ w[a + "o_proj.weight"].T

    def _mlp(self, m, h):
        w = self.w
        return swiglu(h, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])

    def _moe(self, i, h, margins=None):
        cfg, w = self.cfg, self.w
        m = f"model.layers.{i}.mlp."
        if margins is not None:
            margins.append(route_margins(cfg, h, w[m + "gate.weight"], w[m + "gate.e_score_correction_bias"]))
        ids, weights = route(cfg, h, w[m + "gate.weight"], w[m + "gate.e_score_correction_bias"])
        out = np.zeros_like(h)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            out[rows] += weights[rows, slot][:, None] * self._mlp(f"{m}experts.{e}.", h[rows])
        if cfg.n_shared_experts:
            out += self._mlp(m + "shared_experts.", h)
        return out


# ---------------------------------------------------------------- CLI

def limit_blas_threads(n: int = 1) -> bool:
    """Sets numpy's OpenBLAS thread count in this process (returns False if no OpenBLAS found).

    Why: the reference multiplies small matrices, where BLAS threads only spin; on a shared
    2-core machine two spinning threads made a decode 25x slower. The CLIs and our tests call it.
    """
    import ctypes

    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    libs = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line})
    done = False
    for lib in libs:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                    "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(handle, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                done = True
                break
    return done


def greedy(model: Model, prompt_ids, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain greedy AR decode (prefill, then one token per forward). Returns (new tokens [T] int64,
    the logits [T, V] that chose them). The decoding loops with stats are in engine.reference.decode."""
    prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
    cache = model.new_cache(len(prompt_ids) + max_new_tokens)
    logits, _ = model.forward(prompt_ids, np.arange(len(prompt_ids)), cache)
    out, out_logits = [], []
    last = logits[-1]
    for t in range(max_new_tokens):
        tok = int(np.argmax(last))
        out.append(tok)
        out_logits.append(last)
        if t + 1 < max_new_tokens:
            pos = cache.length
            last = model.forward([tok], [pos], cache)[0][0]
    return np.array(out, dtype=np.int64), np.array(out_logits)


def check(model: Model, n_prompts: int = 8, new_tokens: int = 48, seed: int = 0) -> dict:
    """Logit spread and greedy diversity on random prompts: the weights must not give near-ties
    everywhere nor a model that repeats one token."""
    rng = np.random.default_rng(seed)
    gaps, stds, distinct, longest_run = [], [], [], []
    for _ in range(n_prompts):
        prompt = rng.integers(0, model.cfg.vocab_size, size=int(rng.integers(4, 24)))
        toks, logits = greedy(model, prompt, new_tokens)
        top2 = -np.sort(-logits, axis=-1)[:, :2]
        gaps.append(top2[:, 0] - top2[:, 1])
        stds.append(logits.std(-1))
        distinct.append(len(set(toks.tolist())))
        run, best = 1, 1
        for a, b in zip(toks[:-1], toks[1:]):
            run = run + 1 if a == b else 1
            best = max(best, run)
        longest_run.append(best)
    gaps = np.concatenate(gaps)
    return {"logit_std_mean": float(np.mean(np.concatenate(stds))),
            "top1_top2_gap_median": float(np.median(gaps)),
            "top1_top2_gap_min": float(gaps.min()),
            "distinct_tokens_per_sequence_min": int(min(distinct)),
            "distinct_tokens_per_sequence_mean": float(np.mean(distinct)),
            "longest_repeat_run_max": int(max(longest_run)),
            "new_tokens": new_tokens}
