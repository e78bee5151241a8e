"""Naive O(N^2) definitions: the readable specification and the oracle for every test.

Everything here builds the explicit `[N, N]` weight matrix and is written for clarity, not
speed; run it in float64. It shares no code with the fast paths (RoPE here goes through
complex numbers, the fast path through real cos/sin tables).

Layout: `[B, H, N, m]` features, `[B, H, N, d]` values, as in ``linear_rope.ops``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "apply_rotary_ref",
    "linear_attention_ref",
    "favor_features_ref",
    "elu_features_ref",
    "relu_features_ref",
    "softmax_attention_ref",
    "layer_ref",
]


def apply_rotary_ref(x: torch.Tensor, *, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """RoPE, Eq. 34: pair (2i, 2i+1) is the complex number x[2i] + i x[2i+1], multiplied by
    exp(i p theta_i) with theta_i = base^(-2i/D). x: `[..., N, D]`."""
    n, d = x.shape[-2], x.shape[-1]
    theta = torch.tensor([base ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    pos = torch.arange(offset, offset + n, dtype=torch.float64)
    rot = torch.polar(torch.ones(n, d // 2, dtype=torch.float64), pos[:, None] * theta[None, :])
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * rot.to(x.device)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2).to(x.dtype)


def linear_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    rotary: bool = True,
    offset: int = 0,
    base: float = 10000.0,
) -> torch.Tensor:
    """Eq. 19 (``rotary=True``) or Eq. 18 (``rotary=False``) from explicit N x N weights.

    out_m = sum_n (R_m q_m)^T (R_n k_n) v_n / sum_n q_m^T k_n, n over n <= m when causal.
    q, k: `[B, H, N, m]` non-negative features; v: `[B, H, N, d]` -> `[B, H, N, d]`.
    """
    rq = apply_rotary_ref(q, offset=offset, base=base) if rotary else q
    rk = apply_rotary_ref(k, offset=offset, base=base) if rotary else k
    a_num = rq @ rk.transpose(-1, -2)  # (B, H, N, N)
    a_den = q @ k.transpose(-1, -2)  # (B, H, N, N), unrotated: positive
    if causal:
        n = q.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        a_num = a_num.masked_fill(~keep, 0.0)
        a_den = a_den.masked_fill(~keep, 0.0)
    den = a_den.sum(-1, keepdim=True)
    # A query whose weights are all exactly 0 (possible with relu features) gets output 0:
    # its numerator is 0 too, so divide by 1 there instead of producing 0/0.
    return (a_num @ v) / torch.where(den > 0, den, torch.ones_like(den))


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
    if layer.position == "rope_pre":
        q, k = apply_rotary_ref(q, offset=offset), apply_rotary_ref(k, offset=offset)
    kind = layer.features.kind
    if kind == "favor":
        fq, fk = favor_features_ref(q, layer.features.projection), favor_features_ref(k, layer.features.projection)
    elif kind == "elu":
        fq, fk = elu_features_ref(q), elu_features_ref(k)
    else:
        fq, fk = relu_features_ref(q), relu_features_ref(k)
    out = linear_attention_ref(fq, fk, v, causal=layer.causal, rotary=layer.position == "rope", offset=offset)
    out = out.transpose(1, 2).reshape(B, N, H * D)
    return out @ layer.to_out.weight.t() + layer.to_out.bias
