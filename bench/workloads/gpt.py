"""The benchmark workload: a small byte-level GPT that trains on a CPU in seconds.

A pre-norm decoder: learned token and position embeddings, ``n_layers`` blocks of
``x + attn(norm(x))`` and ``x + mlp(norm(x))``, a final norm and a linear head over the
256 byte values. Attention is causal multi-head self-attention through
``F.scaled_dot_product_attention``; the MLP is ``d -> mlp_ratio*d -> d`` with GELU.

The head is tied to the token embedding (GPT-2's choice). With a vocabulary of 256 the head
would add only ``256*d`` parameters, so tying changes little in size; it keeps the parameter
layout to one embedding matrix, which lands in the no-decay group of :func:`param_groups`
(the optimizer may keep that group dense). ``GPTConfig(tie_head=False)`` (the
``small-untied`` preset) gives the head its own matrix, a weight matrix like the blocks'
(decayed); the quality research uses it to tell the input embedding from the output head.

Initialisation is deterministic from a seed alone: every parameter is drawn from a private
``torch.Generator`` in ``named_parameters()`` order, so the global RNG state does not matter
and two processes (ranks) building the same config and seed get bit-identical weights.
Weights ~ N(0, 0.02); the output projections of attention and MLP are scaled by
``1/sqrt(2*n_layers)`` (GPT-2), biases and norm shifts are 0, norm scales are 1.

    python -m bench.workloads.gpt            # parameter counts and forward+backward time per preset
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. Validated on construction."""

    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    seq_len: int = 128
    """Maximum context length (size of the learned position table)."""
    mlp_ratio: int = 4
    """MLP hidden width is ``mlp_ratio * d_model``."""
    norm: str = "layernorm"
    """``"layernorm"`` or ``"rmsnorm"``."""
    bias: bool = False
    """Biases in the linear layers and LayerNorm shifts."""
    vocab_size: int = VOCAB_SIZE
    """Tokens in the vocabulary (256: the bytes)."""
    tie_head: bool = True
    """The output head shares the token embedding's matrix; ``False``: its own matrix."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "mlp_ratio", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.n_heads must divide d_model, got n_heads={self.n_heads} "
                             f"and d_model={self.d_model}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"GPTConfig.norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if not isinstance(self.tie_head, bool):
            raise ValueError(f"GPTConfig.tie_head must be a bool, got {self.tie_head!r}")


PRESETS: dict[str, GPTConfig] = {
    # ~0.12M parameters: CI smoke tests.
    "tiny": GPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=64),
    # ~0.84M parameters: the default workload of the benchmarks.
    "small": GPTConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128),
    # The same with an untied head (+32,768 parameters): which end of the model needs bytes.
    "small-untied": GPTConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128, tie_head=False),
    # ~1.33M parameters: the third workload's model (bench.workloads.headers): a learned BPE
    # vocabulary of 2,048 tokens and an untied head, the shape of "small" otherwise.
    "small-bpe": GPTConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128, vocab_size=2048,
                           tie_head=False),
    # ~3.2M parameters: a larger run when time allows.
    "base": GPTConfig(d_model=256, n_layers=4, n_heads=8, seq_len=256),
    # ~114M parameters: GPT-2-small's width and heads with 16 layers (12 give 86M with the byte
    # vocabulary), context 1024: the workload of W ranks on one GPU (python -m bench.gpu).
    "gpu": GPTConfig(d_model=768, n_layers=16, n_heads=12, seq_len=1024),
    # ~303M parameters: GPT-2-medium's (GPT-345M's) shape with the byte vocabulary, for
    # optimizer-step timings on a GPU (bench.step_compute --device cuda); not for CPU training.
    "medium": GPTConfig(d_model=1024, n_layers=24, n_heads=16, seq_len=1024),
}


def get_config(name: str) -> GPTConfig:
    """The preset called ``name`` (one of :data:`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"model preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=1e-6)
    return nn.LayerNorm(config.d_model, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # [b, t, d] -> [b, heads, t, d/heads]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm2 = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Byte-level pre-norm GPT. ``model(idx)`` gives logits ``[B, T, 256]`` (float32 on CPU)."""

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_f = _norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_head:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every parameter from a private generator seeded with ``seed``."""
        gen = torch.Generator().manual_seed(int(seed))
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():  # a tied parameter is listed once
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # norm scales
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.ndim != 2:
            raise ValueError(f"idx must be [batch, time], got shape {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length must be <= seq_len={self.config.seq_len}, got {t}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats per byte) of ``targets`` given ``idx``."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def num_params(model: nn.Module) -> int:
    """Trainable parameters, a tied matrix counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


GROUP_NAMES = ("decay", "no_decay", "embed", "pos", "head")
"""The groups :func:`param_groups` can make (``embed``, ``pos`` and ``head`` only when given
a sparsity)."""


def check_group_sparsity(sparsity: dict[str, float] | None) -> dict[str, float]:
    """A copy of the per-group sparsity of :func:`param_groups`, checked: group names from
    :data:`GROUP_NAMES`, values in [0, 1), ``"pos"`` only beside ``"embed"``."""
    sparsity = dict(sparsity or {})
    for name, sp in sparsity.items():
        if name not in GROUP_NAMES:
            raise ValueError(f"sparsity: unknown group {name!r} (expected one of {GROUP_NAMES})")
        if isinstance(sp, bool) or not isinstance(sp, (int, float)) or not 0.0 <= sp < 1.0:
            raise ValueError(f"sparsity[{name!r}] must be in [0, 1), got {sp!r}")
    if "pos" in sparsity and "embed" not in sparsity:
        raise ValueError("sparsity: 'pos' splits the 'embed' group; name 'embed' as well")
    return sparsity


def param_groups(model: nn.Module, weight_decay: float,
                 sparsity: dict[str, float] | None = None) -> list[dict]:
    """Two optimizer groups: ``decay`` (the weight matrices of attention and MLP, decayed by
    ``weight_decay``) and ``no_decay`` (norm scales and shifts, biases, token and position
    embeddings -- including the tied head -- with weight decay 0).

    Each group carries a ``"name"`` key. The optimizer accepts per-group options, so a caller
    can add e.g. ``sparsity=0.0`` to the ``no_decay`` group to keep it dense.

    ``sparsity``: per-group sparsity by group name, set as each group's ``"sparsity"`` option
    (groups not named keep the optimizer's). Naming ``"embed"`` makes a group ``embed`` (weight
    decay 0) of the embedding matrices (token and position; the tied head), which then leave
    ``no_decay`` to the vectors; naming ``"pos"`` as well takes the position embedding out of
    ``embed`` into a group ``pos``. Naming ``"head"`` takes an untied output head (a model with
    a ``head`` ``nn.Linear`` whose weight is not an embedding's) out of ``decay`` into a group
    ``head``, still decayed. The quality research found the 99%-sparsity gap of this
    workload concentrated in the embedding matrices (docs/research.md, "Where the gap lives").
    """
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a float >= 0, got {weight_decay!r}")
    sparsity = check_group_sparsity(sparsity)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    pos_emb = getattr(model, "pos_emb", None)
    if "pos" in sparsity and not isinstance(pos_emb, nn.Embedding):
        raise ValueError("sparsity: 'pos' needs a model with a learned position embedding "
                         "(a pos_emb nn.Embedding)")
    pos = {id(pos_emb.weight)} if "pos" in sparsity else set()
    head_mod = getattr(model, "head", None)
    if "head" in sparsity and (not isinstance(head_mod, nn.Linear)
                               or id(head_mod.weight) in embeddings):
        raise ValueError("sparsity: 'head' needs a model with an untied output head (a head "
                         "nn.Linear whose weight is not an embedding's; GPTConfig(tie_head="
                         "False))")
    head = {id(head_mod.weight)} if "head" in sparsity else set()
    split = "embed" in sparsity
    decay, no_decay, embed, pos_group, head_group = [], [], [], [], []
    for p in model.parameters():  # a tied parameter is yielded once
        if not p.requires_grad:
            continue
        if id(p) in head:
            head_group.append(p)
        elif p.ndim >= 2 and id(p) not in embeddings:
            decay.append(p)
        elif id(p) in pos:
            pos_group.append(p)
        elif split and id(p) in embeddings:
            embed.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": float(weight_decay)},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if split:
        groups.append({"name": "embed", "params": embed, "weight_decay": 0.0})
    if pos:
        groups.append({"name": "pos", "params": pos_group, "weight_decay": 0.0})
    if head:
        groups.append({"name": "head", "params": head_group, "weight_decay": float(weight_decay)})
    for g in groups:
        if g["name"] in sparsity:
            g["sparsity"] = float(sparsity[g["name"]])
    return groups


def time_fwd_bwd(config: GPTConfig, batch: int = 8, seq: int | None = None, steps: int = 10,
                 warmup: int = 3, threads: int = 1) -> dict[str, float]:
    """Median wall time of one forward+backward on random bytes, on this machine's CPU."""
    seq = seq or config.seq_len
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = GPT(config, seed=0)
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        y = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            model.loss(x, y).backward()
            model.zero_grad(set_to_none=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old_threads)
    times.sort()
    median = times[len(times) // 2]
    return {"median_s": median, "min_s": times[0], "tokens_per_s": batch * seq / median}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    print(f"{'preset':8} {'params':>10} {'batch x seq':>12} {'fwd+bwd ms':>11} {'tokens/s':>9}")
    for name, cfg in PRESETS.items():
        n = num_params(GPT(cfg))
        r = time_fwd_bwd(cfg, batch=args.batch, steps=args.steps, threads=args.threads)
        print(f"{name:8} {n:>10,} {f'{args.batch}x{cfg.seq_len}':>12} "
              f"{r['median_s'] * 1e3:>11.1f} {r['tokens_per_s']:>9.0f}")


if __name__ == "__main__":
    main()
