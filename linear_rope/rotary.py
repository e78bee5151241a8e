"""Rotary position embedding (RoFormer Eq. 34), interleaved pairs.

Position ``p`` rotates the pair ``(x[2i], x[2i+1])`` of a ``D``-dim vector by the angle
``p * theta_i`` with ``theta_i = base ** (-2i / D)``::

    out[2i]   = x[2i] * cos(p theta_i) - x[2i+1] * sin(p theta_i)
    out[2i+1] = x[2i] * sin(p theta_i) + x[2i+1] * cos(p theta_i)

This is the pairing of the paper and of performer-pytorch's ``rotate_every_two``; it is *not*
the "half-split" pairing (i, i + D/2) used by GPT-NeoX / Llama.

Angles are formed in float64 (``p * theta`` loses digits in float32 once ``p`` is in the
thousands), and the cos/sin tables are kept in float32 or wider whatever the input dtype.
"""
from __future__ import annotations

import torch

__all__ = ["rotary_tables", "apply_rotary", "rotate_with_tables", "check_offset"]


def check_offset(offset: int, name: str = "offset") -> int:
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"{name} must be a non-negative int, got {offset!r}")
    if offset < 0:
        raise ValueError(f"{name} must be non-negative, got {offset}")
    return offset


def table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rotary tables and running sums use: float32 or wider."""
    return torch.promote_types(dtype, torch.float32)


def rotary_tables(
    n: int,
    dim: int,
    *,
    offset: int = 0,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles ``p * theta_i`` for positions ``offset .. offset+n-1``.

    Returns two tensors of shape `[n, dim // 2]` in ``table_dtype(dtype)`` (float32 or wider).
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    check_offset(offset)
    i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
    theta = base ** (-i / dim)  # (dim/2,)
    pos = torch.arange(offset, offset + n, dtype=torch.float64, device=device)
    angle = pos[:, None] * theta[None, :]  # (n, dim/2), exact-ish in float64
    tdt = table_dtype(dtype)
    return angle.cos().to(tdt), angle.sin().to(tdt)


def rotate_with_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` `[..., N, D]` by tables `[N, D/2]`.

    Computes in the tables' dtype (float32 or wider) and returns that dtype; callers cast.
    """
    x = x.to(cos.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., N, D/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


def apply_rotary(x: torch.Tensor, *, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """Apply RoPE (Eq. 34) to ``x``.

    Args:
        x: `[..., N, D]`; dim -2 is the sequence, D (the last dim) must be even.
        offset: position of ``x[..., 0, :]``; positions are ``offset .. offset+N-1``.
        base: the RoPE base (10000 in the paper).

    Returns:
        `[..., N, D]` in the dtype of ``x``; angles and cos/sin are computed in float32 or wider.
    """
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., N, D], got {tuple(x.shape)}")
    n, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"x: the last dim (D={d}) must be even for rotary pairs")
    cos, sin = rotary_tables(n, d, offset=offset, base=base, dtype=x.dtype, device=x.device)
    return rotate_with_tables(x, cos, sin).to(x.dtype)
