"""The reference model's config: the DeepSeek-V3 `config.json` keys it reads (docs/MODEL.md).

`ModelConfig.from_dict` reads the keys this model uses (other keys of a real config.json are
ignored) and validates them: the router (sigmoid, noaux_tc, its groups), even rotary dims, YaRN
as the only rope_scaling. `load_config(path)` reads one file; `TINY_CONFIG` is the tiny
default's dict (engine.reference.model.tiny_config). `ModelFormatError` is the error for a
config or weights file that does not fit the format.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# The tiny default (about 3.8 M parameters, 4 layers, the first dense, then MoE with 8 experts in
# 4 groups). YaRN is on (factor 4 over an original window of 128) so the softmax-scale and the
# frequency-ramp corrections are exercised; mscale != mscale_all_dim so the cos/sin scaling is too.
TINY_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.9,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

_REQUIRED_KEYS = [k for k in TINY_CONFIG if k not in ("rope_scaling", "tie_word_embeddings")]
_YARN_KEYS = ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim"]


class ModelFormatError(ValueError):
    """A config or weights file that does not fit the format of docs/MODEL.md."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int | None
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    topk_method: str
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "ModelConfig":
        """Reads the keys this model uses; other keys of a real config.json are ignored."""
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ModelFormatError(f"{source}: config is missing keys {missing}")
        kw = {f.name: d.get(f.name, f.default) for f in dataclasses.fields(cls)}
        kw["rope_scaling"] = d.get("rope_scaling")
        cfg = cls(**kw)
        cfg.validate(source)
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, source: str = "<config>") -> None:
        def bad(field, why):
            raise ModelFormatError(f"{source}: {field} = {getattr(self, field)!r}: {why}")

        if self.scoring_func != "sigmoid":
            bad("scoring_func", "only 'sigmoid' (DeepSeek-V3 / Kimi K2) is implemented")
        if self.topk_method != "noaux_tc":
            bad("topk_method", "only 'noaux_tc' (group-limited top-k with the correction bias) is implemented")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even (rotary pairs)")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                bad("n_group", f"must divide n_routed_experts = {self.n_routed_experts}")
            if self.n_routed_experts // self.n_group < 2 and self.n_group > 1:
                bad("n_group", "each group needs >= 2 experts (the group score is a top-2 sum)")
            if not 1 <= self.topk_group <= self.n_group:
                bad("topk_group", f"must be in [1, n_group = {self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
                bad("num_experts_per_tok", "must be in [1, experts inside the kept groups]")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if rs.get("type", rs.get("rope_type")) != "yarn":
                bad("rope_scaling", "only type 'yarn' is implemented")
            missing = [k for k in _YARN_KEYS if k not in rs]
            if missing:
                bad("rope_scaling", f"yarn needs keys {missing}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace \
            and i % self.moe_layer_freq == 0


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: cannot read config: {e}") from e
    return ModelConfig.from_dict(d, str(path))
