"""A second benchmark model of another family: a small byte-level Llama-style decoder.

What differs from :mod:`bench.workloads.gpt` (a GPT-2-style model with learned positions, LayerNorm,
a GELU MLP and a tied head):

- **RMSNorm** (no mean subtraction, no shift) before attention, before the MLP and at the end;
- **rotary position embeddings** (RoPE, base 10,000, the "rotate half" form of GPT-NeoX and
  Hugging Face's Llama) on queries and keys: no position table, attention scores depend on
  positions only through their difference;
- a **SwiGLU MLP**, ``w2(silu(w1 x) * w3 x)`` with hidden width ``hidden``;
- separate ``wq``, ``wk``, ``wv``, ``wo`` projections, **no biases** anywhere;
- an **untied head**: ``head`` is its own ``[256, d_model]`` matrix, not the token embedding.

Initialisation is deterministic from the seed alone (a private ``torch.Generator`` in
``named_parameters()`` order, as in :mod:`bench.workloads.gpt`): matrices ~ N(0, 0.02), the output
projections ``wo`` and ``w2`` scaled by ``1/sqrt(2*n_layers)``, norm scales 1.

Presets (:data:`PRESETS`; ``RunConfig.model`` takes their names beside :mod:`bench.workloads.gpt`'s,
:func:`make_model` builds either family): ``llama-tiny`` (CI smokes) and ``llama-small``
(1,252,992 parameters: 6 layers of width 128, 4 heads, SwiGLU width 344, context 128 bytes;
deeper and narrower-per-parameter than ``small``'s 4 layers), the second workload of
``python -m bench.lr_sweep`` over the prose of :mod:`bench.workloads.prose`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.workloads.gpt import GPT, VOCAB_SIZE, get_config


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model. Validated on construction."""

    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 4
    """Attention heads; must divide ``d_model`` into an even head width (rotary pairs)."""
    seq_len: int = 128
    """Longest context (the rotary tables' length)."""
    hidden: int = 344
    """SwiGLU hidden width (about ``8/3 * d_model``, rounded up to a multiple of 8)."""
    rope_base: float = 10000.0
    vocab_size: int = VOCAB_SIZE
    tie_head: bool = False
    """Always False: the head is untied (the field exists for ``RunConfig``'s checks)."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "hidden", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig: d_model / n_heads must be an even int, got "
                             f"d_model={self.d_model}, n_heads={self.n_heads}")
        if self.tie_head:
            raise ValueError("LlamaConfig.tie_head must be False (the head is untied)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(d_model=64, n_layers=2, n_heads=2, seq_len=64, hidden=176),
    "llama-small": LlamaConfig(d_model=128, n_layers=6, n_heads=4, seq_len=128, hidden=344),
}


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[seq_len, head_dim]``: position ``t`` turns pair ``i`` (the
    coordinates ``i`` and ``i + head_dim/2``) by the angle ``t * base**(-2i/head_dim)``."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., T, head_dim]``) by the first ``T`` rows of the tables."""
    t, half = x.shape[-2], x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:t] + rotated * sin[:t]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.hidden, bias=False)
        self.w3 = nn.Linear(config.d_model, config.hidden, bias=False)
        self.w2 = nn.Linear(config.hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Byte-level Llama-style decoder. ``model(idx)`` gives logits ``[B, T, 256]``."""

    def __init__(self, config: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_f = nn.RMSNorm(config.d_model, eps=1e-6)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.seq_len, config.head_dim, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every parameter from a private generator seeded with ``seed``."""
        gen = torch.Generator().manual_seed(int(seed))
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:  # RMSNorm scales
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.ndim != 2:
            raise ValueError(f"idx must be [batch, time], got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence length must be <= seq_len={self.config.seq_len}, "
                             f"got {idx.shape[1]}")
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats per byte) of ``targets`` given ``idx``."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_model(name: str, seed: int = 0) -> nn.Module:
    """The model of preset ``name``: a :class:`Llama` for :data:`PRESETS`, else a
    :class:`bench.workloads.gpt.GPT` of :func:`bench.workloads.gpt.get_config`."""
    if name in PRESETS:
        return Llama(PRESETS[name], seed=seed)
    return GPT(get_config(name), seed=seed)
