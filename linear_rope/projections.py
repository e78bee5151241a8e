"""HeadProjections: the projections every attention layer of the package shares.

x `[B, N, dim]` -> q, k, v of H heads of d dims through one bias-free ``to_qkv`` (keys and values
from ``context`` for cross-attention), an optional ``QKNorm`` on q and k, and the heads back to
``dim`` through ``to_out`` and dropout. ``RotaryLinearAttention`` and ``SoftmaxAttention``
differ only in what happens between the two.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .qk_norm import QKNorm

__all__ = ["HeadProjections", "check_sizes"]


def check_sizes(**sizes) -> None:
    """ValueError unless every size given is a positive int (a bool is not one)."""
    for name, val in sizes.items():
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")


class HeadProjections(nn.Module):
    """Base class; a subclass calls ``_init_projections`` where its weights are to be created
    (the order of creation is the order of the random initialisation)."""

    def _init_projections(self, dim: int, heads: int, dim_head: int, dropout: float, qk_norm: bool) -> None:
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.to_out = nn.Linear(inner, dim)
        self.dropout = nn.Dropout(dropout)
        self.qk_norm = QKNorm(heads, dim_head) if qk_norm else None

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, N, _ = t.shape
        return t.view(B, N, self.heads, self.dim_head).transpose(1, 2)  # (B, H, N, d)

    def _qkv(self, x: torch.Tensor, context: torch.Tensor | None = None):
        """q, k, v `[B, H, N, d]` (k and v of ``context`` when given), q and k normed if asked."""
        if context is None:
            q, k, v = (self._heads(t) for t in self.to_qkv(x).chunk(3, dim=-1))
        else:
            inner = self.heads * self.dim_head
            w = self.to_qkv.weight
            q = self._heads(F.linear(x, w[:inner]))
            k, v = (self._heads(t) for t in F.linear(context, w[inner:]).chunk(2, dim=-1))
        if self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        return q, k, v

    def _project_out(self, out: torch.Tensor, x: torch.Tensor, *, wide: bool = False) -> torch.Tensor:
        """`[B, H, N, d]` -> `[B, N, dim]` in x's dtype.

        ``wide``: ``out`` may hold values beyond float16's range (under float16 autocast), so the
        projection runs in float32 with autocast off instead of on ``out`` cast to float16
        (which would turn them into inf, and the projection's output into NaN)."""
        B, H, N, d = out.shape
        out = out.transpose(1, 2).reshape(B, N, H * d)
        if wide:
            with torch.autocast(out.device.type, enabled=False):
                w, b = self.to_out.weight, self.to_out.bias
                y = F.linear(out.float(), w.float(), None if b is None else b.float())
            return self.dropout(y.to(torch.promote_types(x.dtype, torch.float32)))
        return self.dropout(self.to_out(out.to(x.dtype)))
