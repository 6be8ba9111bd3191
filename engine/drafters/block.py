"""The block drafter: L draft positions in one pass, from the target's hidden states (DFlash-like).

Input per round: the target's last C hidden states (after its final norm) at the committed
positions, and the root token b. The block is [b, MASK, ..., MASK] (block_size = L + 1 slots);
every slot also carries b's embedding, so that the mask slots need no attention step to learn
the (frequent) mapping from the root to the next tokens.
Each layer lets the block attend, without a causal mask, to the projected context and to
itself; the L mask slots' outputs go through a norm and an LM head: logits [L, V].

    ctx  = rms(ctx_proj(hidden[-C:]) + ctx_pos[-c:], ctx_norm)          [c, d]
    x    = [0, mask_embed x L] + embed[b] + block_pos                    [L+1, d]
    per layer: h = rms(x, attn_norm); k, v from [ctx; h]; q from h;
               x += o_proj(softmax(q k^T / sqrt(hd)) v);  x += swiglu(rms(x, mlp_norm))
    logits = rms(x[1:], norm) lm_head^T                                  [L, V]

The same forward exists twice: numpy float32 (`forward_numpy`, one request, the readable one)
and torch (`DrafterNet`, batched, CPU or CUDA, used for training and on GPUs); tests check that
they agree. Files beside the target's: `drafter_config.json` and `drafter.safetensors`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "drafter.safetensors"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int
    target_hidden_size: int
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    block_size: int = 16  # L + 1: the root slot and L mask slots
    context_size: int = 32  # C: how many of the target's last hidden states are read
    rms_norm_eps: float = 1e-6
    trained_steps: int = 0  # 0 = seeded random weights
    # sha256 of the target weights the drafter was made for (target_sha256()): load() refuses
    # the drafter beside other target weights ("" = unbound: not checked; tests' bare configs).
    target_sha256: str = ""
    # The last training run (engine.training.drafter.train): data source, steps, seed, sequences,
    # held-out top-1 accuracy per depth, seconds. None for seeded random weights.
    training: dict | None = None

    @property
    def depth(self) -> int:
        return self.block_size - 1

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{source}: unknown drafter config keys {unknown}")
        for key in ("vocab_size", "target_hidden_size"):
            if key not in d:
                raise ValueError(f"{source}: drafter config is missing {key!r}")
        cfg = cls(**d)
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"{source}: hidden_size {cfg.hidden_size} is not a multiple of "
                             f"num_heads {cfg.num_heads}")
        if cfg.block_size < 2 or cfg.context_size < 1:
            raise ValueError(f"{source}: need block_size >= 2 and context_size >= 1")
        return cfg


def tensor_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    d, I = cfg.hidden_size, cfg.intermediate_size
    s = {"ctx_proj.weight": (d, cfg.target_hidden_size), "ctx_pos": (cfg.context_size, d),
         "ctx_norm.weight": (d,), "embed.weight": (cfg.vocab_size, d), "mask_embed": (d,),
         "block_pos": (cfg.block_size, d)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        s[p + "attn_norm.weight"] = (d,)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            s[p + name + ".weight"] = (d, d)
        s[p + "mlp_norm.weight"] = (d,)
        s[p + "gate_proj.weight"] = (I, d)
        s[p + "up_proj.weight"] = (I, d)
        s[p + "down_proj.weight"] = (d, I)
    s["norm.weight"] = (d,)
    s["lm_head.weight"] = (cfg.vocab_size, d)
    return s


def init_weights(cfg: DrafterConfig, seed: int) -> dict[str, np.ndarray]:
    """float32: norms 1, embeddings and positions N(0, 1), linear N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = np.ones(shape)
        elif len(shape) == 1 or name in ("embed.weight", "ctx_pos", "block_pos"):
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


def target_sha256(weights_dir) -> str:
    """sha256 over the target's files in weights_dir (config.json, model*.safetensors and a
    shard index), each as its name and content digest in name order; the drafter's binding."""
    import hashlib

    d = Path(weights_dir)
    files = sorted(p for p in d.iterdir() if p.is_file() and (
        p.name == "config.json" or (p.name.startswith("model") and ".safetensors" in p.name)))
    if not any(p.name.endswith(".safetensors") for p in files):
        raise FileNotFoundError(f"{d}: no target weights (model*.safetensors) to bind the "
                                "block drafter to")
    h = hashlib.sha256()
    for p in files:
        fh = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                fh.update(chunk)
        h.update(f"{p.name}\0{fh.hexdigest()}\n".encode())
    return h.hexdigest()


def save(weights_dir, cfg: DrafterConfig, weights: dict[str, np.ndarray]) -> tuple[Path, Path]:
    from safetensors.numpy import save_file

    d = Path(weights_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()},
              str(d / WEIGHTS_FILE), metadata={"format": "pt"})
    return d / CONFIG_FILE, d / WEIGHTS_FILE


def load(weights_dir) -> tuple[DrafterConfig, dict[str, np.ndarray]]:
    """Config and float32 weights; an error names the file and the missing or misshapen tensor."""
    from engine.reference.model import read_safetensors

    d = Path(weights_dir)
    if not (d / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{d / CONFIG_FILE}: no block drafter here "
                                f"(create one with: python -m engine.cli.model init --out {d})")
    cfg = DrafterConfig.from_dict(json.loads((d / CONFIG_FILE).read_text()), str(d / CONFIG_FILE))
    weights = {k: v.astype(np.float32) for k, v in read_safetensors(d / WEIGHTS_FILE).items()}
    shapes = tensor_shapes(cfg)
    for name, shape in shapes.items():
        if name not in weights:
            raise ValueError(f"{d / WEIGHTS_FILE}: missing tensor {name}")
        if weights[name].shape != shape:
            raise ValueError(f"{d / WEIGHTS_FILE}: tensor {name} has shape "
                             f"{list(weights[name].shape)}, config says {list(shape)}")
    extra = sorted(set(weights) - set(shapes))
    if extra:
        raise ValueError(f"{d / WEIGHTS_FILE}: unexpected tensors {extra[:5]}")
    if cfg.target_sha256:
        have = target_sha256(d)
        if have != cfg.target_sha256:
            raise ValueError(f"{d / CONFIG_FILE}: this block drafter was made for target weights "
                             f"with sha256 {cfg.target_sha256[:16]}..., but {d} holds target "
                             f"weights with sha256 {have[:16]}...; refusing it (retrain: python -m "
                             f"engine.drafters train --weights {d})")
    return cfg, weights


def init_block_drafter(weights_dir, seed: int = 1) -> tuple[Path, Path]:
    """Seeded drafter sized for the target in weights_dir (width = the target's hidden size).

    As DFlash shares the target's embedding and LM head, the drafter starts from copies of the
    target's `model.embed_tokens`, `lm_head` and `model.norm` weights (stored in its own file, so
    training may move them); everything else is seeded random."""
    from engine.reference.model import load_weights

    tcfg, tw = load_weights(weights_dir)
    D = tcfg.hidden_size
    cfg = DrafterConfig(vocab_size=tcfg.vocab_size, target_hidden_size=D, hidden_size=D,
                        intermediate_size=2 * D, target_sha256=target_sha256(weights_dir))
    w = init_weights(cfg, seed)
    w["embed.weight"] = tw["model.embed_tokens.weight"].astype(np.float32)
    w["lm_head.weight"] = tw["model.embed_tokens.weight" if tcfg.tie_word_embeddings
                             else "lm_head.weight"].astype(np.float32)
    w["norm.weight"] = tw["model.norm.weight"].astype(np.float32)
    return save(weights_dir, cfg, w)


# ---------------------------------------------------------------- numpy forward (one request)

def _rms_np(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def forward_numpy(cfg: DrafterConfig, w: dict, hidden: np.ndarray, root: int) -> np.ndarray:
    """hidden [P, Dt] (P >= 0; the last C rows are read), root int -> logits [L, V] float32."""
    f32 = np.float32
    ctx_h = np.asarray(hidden, f32)[-cfg.context_size:] if len(hidden) else \
        np.zeros((0, cfg.target_hidden_size), f32)
    c = len(ctx_h)
    eps, nh = f32(cfg.rms_norm_eps), cfg.num_heads
    hd = cfg.hidden_size // nh
    ctx = _rms_np(ctx_h @ w["ctx_proj.weight"].T + w["ctx_pos"][cfg.context_size - c:],
                  w["ctx_norm.weight"], eps)                                    # [c, d]
    x = np.concatenate([np.zeros((1, cfg.hidden_size), f32),
                        np.repeat(w["mask_embed"][None], cfg.depth, 0)]) \
        + w["embed.weight"][root] + w["block_pos"]                              # [S, d]
    S = cfg.block_size
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = _rms_np(x, w[p + "attn_norm.weight"], eps)
        kv_in = np.concatenate([ctx, h])                                        # [c+S, d]
        q = (h @ w[p + "q_proj.weight"].T).reshape(S, nh, hd).transpose(1, 0, 2)   # [nh, S, hd]
        k = (kv_in @ w[p + "k_proj.weight"].T).reshape(c + S, nh, hd).transpose(1, 0, 2)
        v = (kv_in @ w[p + "v_proj.weight"].T).reshape(c + S, nh, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / f32(math.sqrt(hd))                      # [nh, S, c+S]
        e = np.exp(s - s.max(-1, keepdims=True))
        o = (e / e.sum(-1, keepdims=True)) @ v                                   # [nh, S, hd]
        x = x + o.transpose(1, 0, 2).reshape(S, -1) @ w[p + "o_proj.weight"].T
        h = _rms_np(x, w[p + "mlp_norm.weight"], eps)
        g = h @ w[p + "gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T
    return (_rms_np(x[1:], w["norm.weight"], eps) @ w["lm_head.weight"].T).astype(f32)


# ---------------------------------------------------------------- torch forward (batched)

def make_net(cfg: DrafterConfig, weights: dict, device="cpu"):
    """A torch.nn.Module holding the weights as float32 parameters (names as in the file)."""
    import torch

    class DrafterNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = cfg
            self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(
                torch.tensor(np.asarray(v, np.float32))) for k, v in weights.items()})

        def w(self, name):
            return self.p[name.replace(".", "__")]

        def state_numpy(self) -> dict:
            return {k.replace("__", "."): v.detach().cpu().numpy() for k, v in self.p.items()}

        def forward(self, ctx_hidden, ctx_valid, root):
            """ctx_hidden [B, C, Dt] (left-padded), ctx_valid [B, C] bool, root [B] int64
            -> logits [B, L, V]."""
            F = torch.nn.functional
            w, eps = self.w, cfg.rms_norm_eps
            B, C, S, nh = ctx_hidden.shape[0], ctx_hidden.shape[1], cfg.block_size, cfg.num_heads
            hd = cfg.hidden_size // nh

            def rms(x, wt):
                return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * wt

            ctx = rms(ctx_hidden @ w("ctx_proj.weight").T + w("ctx_pos")[cfg.context_size - C:],
                      w("ctx_norm.weight"))
            slots = torch.cat([torch.zeros_like(w("mask_embed"))[None],
                               w("mask_embed").expand(cfg.depth, -1)], 0)      # [S, d]
            x = slots[None] + w("embed.weight")[root][:, None] + w("block_pos")
            key_ok = torch.cat([ctx_valid, torch.ones(B, S, dtype=torch.bool,
                                                      device=ctx_valid.device)], 1)
            for i in range(cfg.num_layers):
                p = f"layers.{i}."
                h = rms(x, w(p + "attn_norm.weight"))
                kv_in = torch.cat([ctx, h], 1)
                q = (h @ w(p + "q_proj.weight").T).view(B, S, nh, hd).transpose(1, 2)
                k = (kv_in @ w(p + "k_proj.weight").T).view(B, C + S, nh, hd).transpose(1, 2)
                v = (kv_in @ w(p + "v_proj.weight").T).view(B, C + S, nh, hd).transpose(1, 2)
                s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
                s = s.masked_fill(~key_ok[:, None, None, :], float("-inf"))
                o = torch.softmax(s, -1) @ v
                x = x + o.transpose(1, 2).reshape(B, S, -1) @ w(p + "o_proj.weight").T
                h = rms(x, w(p + "mlp_norm.weight"))
                x = x + (F.silu(h @ w(p + "gate_proj.weight").T) * (h @ w(p + "up_proj.weight").T)) \
                    @ w(p + "down_proj.weight").T
            return rms(x[:, 1:], w("norm.weight")) @ w("lm_head.weight").T

    return DrafterNet().to(device)


class _FastForward:
    """DrafterNet's forward for drafting rounds, with fewer kernels (a CUDA graph replays each
    one): q, k, v in one matmul over [ctx; block], gate and up in one, residual adds fused into
    the output matmuls (addmm), the attention one scaled_dot_product_attention, the norms
    F.rms_norm. Same function as DrafterNet.forward up to float rounding (tests: 1e-5)."""

    def __init__(self, cfg: DrafterConfig, net):
        import torch

        self.cfg = cfg
        w = {k.replace("__", "."): v.detach() for k, v in net.p.items()}
        self.w = w
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            self.layers.append({
                "attn_norm": w[p + "attn_norm.weight"], "mlp_norm": w[p + "mlp_norm.weight"],
                "qkv": torch.cat([w[p + "q_proj.weight"], w[p + "k_proj.weight"],
                                  w[p + "v_proj.weight"]]).T.contiguous(),
                "o": w[p + "o_proj.weight"].T.contiguous(),
                "gate_up": torch.cat([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]).T.contiguous(),
                "down": w[p + "down_proj.weight"].T.contiguous()})
        self.ctx_proj = w["ctx_proj.weight"].T.contiguous()
        self.lm_head = w["lm_head.weight"].T.contiguous()
        slots = torch.cat([torch.zeros_like(w["mask_embed"])[None],
                           w["mask_embed"].expand(cfg.depth, -1)], 0)             # [S, d]
        self.block_base = (slots + w["block_pos"]).contiguous()

    def __call__(self, ctx_hidden, ctx_valid, root):
        import torch
        import torch.nn.functional as F

        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        B, C, S, nh = ctx_hidden.shape[0], ctx_hidden.shape[1], cfg.block_size, cfg.num_heads
        d = cfg.hidden_size
        hd = d // nh
        ctx = F.rms_norm(torch.baddbmm(w["ctx_pos"][cfg.context_size - C:],
                                       ctx_hidden, self.ctx_proj.expand(B, -1, -1)),
                         (d,), w["ctx_norm.weight"], eps)                        # [B, C, d]
        x = self.block_base[None] + w["embed.weight"][root][:, None]            # [B, S, d]
        key_ok = torch.cat([ctx_valid, torch.ones(B, S, dtype=torch.bool,
                                                  device=ctx_valid.device)], 1)
        mask = key_ok[:, None, None, :]                                          # [B, 1, 1, C+S]
        for L in self.layers:
            h = F.rms_norm(x, (d,), L["attn_norm"], eps)
            qkv = torch.cat([ctx, h], 1) @ L["qkv"]                              # [B, C+S, 3d]
            q = qkv[:, C:, :d].reshape(B, S, nh, hd).transpose(1, 2)
            k = qkv[:, :, d:2 * d].reshape(B, C + S, nh, hd).transpose(1, 2)
            v = qkv[:, :, 2 * d:].reshape(B, C + S, nh, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)          # [B, nh, S, hd]
            x = torch.baddbmm(x, o.transpose(1, 2).reshape(B, S, d), L["o"].expand(B, -1, -1))
            h = F.rms_norm(x, (d,), L["mlp_norm"], eps)
            g, u = (h @ L["gate_up"]).chunk(2, -1)
            x = torch.baddbmm(x, F.silu(g) * u, L["down"].expand(B, -1, -1))
        return F.rms_norm(x[:, 1:], (d,), w["norm.weight"], eps) @ self.lm_head


class BlockDrafter:
    """The drafter interface (engine.drafters) over the block drafter.

    backend "numpy" (float32 on the CPU) or "torch" (on `device`: "cpu" or "cuda[:i]")."""

    def __init__(self, cfg: DrafterConfig, weights: dict, backend: str = "torch", device="cpu"):
        if backend not in ("numpy", "torch"):
            raise ValueError(f"BlockDrafter: backend = {backend!r}, expected 'numpy' or 'torch'")
        self.cfg, self.weights, self.backend, self.device = cfg, weights, backend, device
        self.depth = cfg.depth
        self.net = make_net(cfg, weights, device) if backend == "torch" else None
        self._fast = None  # draft_batch's fused-weight forward, built on first use

    @classmethod
    def from_dir(cls, weights_dir, backend: str = "torch", device="cpu") -> "BlockDrafter":
        cfg, weights = load(weights_dir)
        return cls(cfg, weights, backend, device)

    def logits(self, hidden, root: int):
        """hidden [P, Dt] (numpy or torch) -> logits [L, V] (numpy, or torch on the device)."""
        if self.backend == "numpy":
            if type(hidden).__module__.startswith("torch"):
                hidden = hidden.detach().cpu().numpy()
            return forward_numpy(self.cfg, self.weights, hidden, int(root))
        import torch

        h = torch.as_tensor(hidden[-self.cfg.context_size:] if len(hidden) else hidden)
        h = h.to(self.device, torch.float32).reshape(-1, self.cfg.target_hidden_size)
        valid = torch.ones(1, h.shape[0], dtype=torch.bool, device=self.device)
        root_t = torch.tensor([int(root)], dtype=torch.int64, device=self.device)
        with torch.no_grad():
            return self.net(h[None], valid, root_t)[0]

    def draft_batch(self, inp, k):
        """The round's interface (engine/native/round.py): every row's last context_size hidden
        states gathered from inp.hidden (left-padded where P < C), one batched forward, top-K
        of the log-softmax. Torch backend only; no host synchronisation."""
        import torch

        if self.backend != "torch":
            raise ValueError("BlockDrafter.draft_batch needs the torch backend")
        C, D = self.cfg.context_size, inp.hidden.shape[-1]
        pos = inp.lengths[:, None] - C + torch.arange(C, device=inp.lengths.device)[None, :]
        valid = pos >= 0                                                        # [B, C]
        flat = inp.rows[:, None] * inp.hidden.shape[1] + pos.clamp(min=0)
        ctx = inp.hidden.view(-1, D)[flat.reshape(-1)].view(-1, C, D)          # [B, C, D]
        if self._fast is None:
            self._fast = _FastForward(self.cfg, self.net)
        logits = self._fast(ctx, valid, inp.roots)                              # [B, L, V]
        top = torch.topk(torch.log_softmax(logits, -1), min(int(k), logits.shape[-1]), dim=-1)
        return top.values.contiguous(), top.indices.contiguous()

    def draft(self, committed, root, hidden, k):
        from engine.drafters.topk import topk_from_logits

        logits = self.logits(hidden, root)
        if self.backend == "numpy":
            return topk_from_logits(logits, k)
        import torch

        logp = torch.log_softmax(logits.double(), -1)
        top = torch.topk(logp, min(int(k), logp.shape[-1]), dim=-1)
        return top.values.float().cpu().numpy(), top.indices.cpu().numpy().astype(np.int64)
