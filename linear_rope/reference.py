"""Readable references for the tests, beside Eq. 19's own (``linear_rope.ops.naive``): RoPE,
the unstabilised feature maps, exact softmax attention, and the layer written out from its
weights. Written for clarity, not speed; run them in float64.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .attention import ROW_SUM_FLOOR
from .ops.naive import eq19_weights, naive_rotary_linear_attention, rotate_naive

__all__ = [
    "apply_rotary_ref",
    "favor_features_ref",
    "elu_features_ref",
    "relu_features_ref",
    "softmax_attention_ref",
    "layer_ref",
    "softmax_layer_ref",
]


def apply_rotary_ref(x: torch.Tensor, *, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """RoPE, Eq. 34, through complex numbers. x: `[..., N, D]` at positions offset .. offset+N-1."""
    return rotate_naive(x, torch.arange(offset, offset + x.shape[-2]), base)


def favor_features_ref(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """FAVOR+ positive random features, unstabilised (Performer Lemma 1).

    phi(x)_j = exp(w_j . x' - |x'|^2/2) / sqrt(m) with x' = x d^(-1/4), so that
    E[phi(q) . phi(k)] = exp(q . k / sqrt(d)). x: `[..., N, d]`, projection: `[m, d]`.
    """
    d, m = x.shape[-1], projection.shape[0]
    xs = x * d**-0.25
    return torch.exp(xs @ projection.t().to(x) - 0.5 * (xs * xs).sum(-1, keepdim=True)) / math.sqrt(m)


def elu_features_ref(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 (Katharopoulos et al., the map cited for Eq. 18)."""
    return F.elu(x) + 1.0


def relu_features_ref(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def softmax_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """Exact softmax attention, softmax(q k^T / sqrt(d)) v, for comparing FAVOR+ against."""
    a = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        a = a.masked_fill(~keep, float("-inf"))
    return a.softmax(-1) @ v


def layer_ref(layer, x: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
    """``RotaryLinearAttention`` forward, written out naively from the layer's weights.

    x: `[B, N, dim]` -> `[B, N, dim]` (dropout is taken as off).
    """
    B, N, _ = x.shape
    H, D = layer.heads, layer.dim_head
    qkv = x @ layer.to_qkv.weight.t()
    q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=-1))
    if getattr(layer, "qk_norm", None) is not None:  # unit norm times the head's scale
        s = layer.qk_norm.scale.view(1, H, 1, 1)
        q = q / q.pow(2).sum(-1, keepdim=True).sqrt() * s
        k = k / k.pow(2).sum(-1, keepdim=True).sqrt() * s
    if layer.position == "rope_pre":
        q, k = apply_rotary_ref(q, offset=offset, base=layer.base), apply_rotary_ref(k, offset=offset, base=layer.base)
    kind = layer.features.kind
    if kind == "favor":
        fq, fk = favor_features_ref(q, layer.features.projection), favor_features_ref(k, layer.features.projection)
    elif kind == "elu":
        fq, fk = elu_features_ref(q), elu_features_ref(k)
    else:
        fq, fk = relu_features_ref(q), relu_features_ref(k)
    rotary = layer.position in ("rope", "rope_norm")
    if layer.position == "rope_norm":  # Eq. 19's weights W, each row divided by its floored sum
        w = eq19_weights(fq, fk, causal=layer.causal, rotary=True, offset=offset, base=layer.base)
        out = (w / w.sum(-1, keepdim=True).clamp_min(ROW_SUM_FLOOR)) @ v
    else:
        pos = dict(offset=offset, base=layer.base) if rotary else {}
        out = naive_rotary_linear_attention(fq, fk, v, causal=layer.causal, rotary=rotary, **pos)
    out = out.transpose(1, 2).reshape(B, N, H * D)
    return out @ layer.to_out.weight.t() + layer.to_out.bias


def softmax_layer_ref(layer, x: torch.Tensor) -> torch.Tensor:
    """``SoftmaxAttention`` forward (no mask), written out from the layer's weights:
    RoPE on q and k through complex numbers, then ``softmax_attention_ref``."""
    B, N, _ = x.shape
    H, D = layer.heads, layer.dim_head
    q, k, v = ((x @ layer.to_qkv.weight.t()).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4))
    if layer.qk_norm is not None:
        s = layer.qk_norm.scale.view(1, H, 1, 1)
        q = q / q.pow(2).sum(-1, keepdim=True).sqrt() * s
        k = k / k.pow(2).sum(-1, keepdim=True).sqrt() * s
    q, k = apply_rotary_ref(q, base=layer.base), apply_rotary_ref(k, base=layer.base)
    out = softmax_attention_ref(q, k, v, causal=True).transpose(1, 2).reshape(B, N, H * D)
    return out @ layer.to_out.weight.t() + layer.to_out.bias
