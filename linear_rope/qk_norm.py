"""QKNorm: queries and keys of bounded norm before the feature map (the ablation's stable recipe).

Each head's q and k are scaled to unit L2 norm and then by a learned scale per head,
``q <- s_h q / |q|``. The logit a query and a key reach is ``s_h^2 cos / sqrt(d)``, bounded by the
scale rather than by how far the projections have grown. FAVOR+'s error grows with
``exp(|q'|^2 + |k'|^2)`` (``x' = x d^(-1/4)``) and its key features underflow when ``|k'|`` is
large, so an unbounded key norm is what made Eq. 19 and ``none`` unstable at lr 2e-3 in the
cpu20m ablation (key norms 223-337 against 21-52 in rope_norm, ``results/cpu20m/key_norms.txt``).

The scale starts at ``d^(1/4)``: ``|x'| = 1`` and the softmax logits start within [-1, 1].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["QKNorm"]


class QKNorm(nn.Module):
    """x `[B, H, N, d]` (or `[B, H, d]`) -> the same shape, each vector scaled to norm ``scale[h]``."""

    def __init__(self, heads: int, dim_head: int):
        super().__init__()
        # 1-D, so the trainer's optimizer groups leave it out of weight decay like other gains.
        self.scale = nn.Parameter(torch.full((heads,), float(dim_head) ** 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)  # the head axis is dim 1
        return F.normalize(x, dim=-1) * self.scale.view(shape).to(x.dtype)
