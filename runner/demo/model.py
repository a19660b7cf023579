"""A small GPT-style character model (pre-norm transformer decoder).

Token embeddings are a one-hot matrix product rather than an index lookup: on CUDA the backward
of an embedding lookup accumulates with atomics, whose order (and so the rounding) varies from
run to run, while a matrix product's does not. Attention is written out instead of calling a
fused kernel for the same reason: the resume audit needs bit-identical runs on every device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, *, d_model: int, n_heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.mask: torch.Tensor
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, context, context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        head = width // self.n_heads
        q, k, v = (t.view(batch, length, self.n_heads, head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head)
        scores = scores.masked_fill(~self.mask[:, :, :length, :length], float("-inf"))
        weights = self.attn_dropout(F.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).contiguous().view(batch, length, width)
        return self.resid_dropout(self.proj(out))


class Block(nn.Module):
    def __init__(self, *, d_model: int, n_heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(
            d_model=d_model, n_heads=n_heads, context=context, dropout=dropout
        )
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Next-character model: ``forward(idx [B, T]) -> logits [B, T, vocab]``."""

    def __init__(
        self,
        *,
        vocab_size: int,
        context: int = 64,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.vocab_size = vocab_size
        self.context = context
        self.token_embedding = nn.Parameter(torch.randn(vocab_size, d_model) * 0.02)
        self.position_embedding = nn.Parameter(torch.randn(context, d_model) * 0.02)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model=d_model, n_heads=n_heads, context=context, dropout=dropout)
            for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        if length > self.context:
            raise ValueError(f"sequence of {length} exceeds the context of {self.context}")
        one_hot = F.one_hot(idx, self.vocab_size).to(self.token_embedding.dtype)
        x = one_hot @ self.token_embedding + self.position_embedding[:length]
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))
