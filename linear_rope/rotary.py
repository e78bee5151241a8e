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

__all__ = ["rotary_tables", "apply_rotary", "rotate_with_tables", "check_offset", "token_positions"]


def check_offset(offset, name: str = "offset", rows: int | None = None):
    """An int >= 0, or (when ``rows`` is given) also a LongTensor `[rows]` of per-row values >= 0."""
    if isinstance(offset, torch.Tensor) and rows is not None:
        if offset.dtype not in (torch.int32, torch.int64) or offset.shape != (rows,):
            raise ValueError(f"{name} must be an int or an integer tensor [{rows}], got "
                             f"{offset.dtype} {tuple(offset.shape)}")
        if bool((offset < 0).any()):
            raise ValueError(f"{name} must be non-negative, got {offset.tolist()}")
        return offset.long()
    if isinstance(offset, bool) or not isinstance(offset, int):
        kind = "an int or an integer tensor [B]" if rows is not None else "a non-negative int"
        raise ValueError(f"{name} must be {kind}, got {offset!r}")
    if offset < 0:
        raise ValueError(f"{name} must be non-negative, got {offset}")
    return offset


def token_positions(offset, n: int, mask: torch.Tensor | None = None, device=None,
                    docs: list[tuple[int, int]] | None = None) -> torch.Tensor | None:
    """Positions `[B, n]` of every token, or None where they are simply offset .. offset+n-1.

    The one place positions are computed. With a ``mask`` `[B, n]` (True = real token) a
    token's position is ``offset`` plus the number of real tokens before it in its row, so a
    padded row gets the positions it has alone (padding tokens take their neighbour's; they are
    masked anyway). ``offset`` is an int or a LongTensor `[B]` of per-row starts. With ``docs``
    ([start, end) of documents packed in one row) each document restarts at its own offset
    (``offset`` then an int or a LongTensor `[D]`).
    """
    if docs is not None:
        parts = []
        for d, (s, e) in enumerate(docs):
            off = offset[d : d + 1] if isinstance(offset, torch.Tensor) else offset
            p = token_positions(off, e - s, None if mask is None else mask[:, s:e], device=device)
            parts.append(torch.arange(e - s, device=device)[None] + off if p is None else p)
        return torch.cat(parts, dim=1)
    if mask is None and not isinstance(offset, torch.Tensor):
        return None
    if mask is not None:
        rel = (mask.long().cumsum(-1) - 1).clamp_min(0)
    else:
        rel = torch.arange(n, device=device)[None]
    off = offset.to(rel.device)[:, None] if isinstance(offset, torch.Tensor) else offset
    return rel + off


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
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles ``p * theta_i`` for positions ``offset .. offset+n-1``, or for
    explicit integer ``positions`` `[..., n]` (then ``offset`` is ignored).

    Returns two tensors of shape `[n, dim // 2]` (`[..., n, dim // 2]` with ``positions``) in
    ``table_dtype(dtype)`` (float32 or wider).
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    if positions is None:
        check_offset(offset)
        pos = torch.arange(offset, offset + n, dtype=torch.float64, device=device)
    else:
        device = positions.device
        pos = positions.to(torch.float64)
    i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
    theta = base ** (-i / dim)  # (dim/2,)
    angle = pos[..., None] * theta  # (..., n, dim/2), exact-ish in float64
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


def apply_rotary(
    x: torch.Tensor, *, offset: int = 0, base: float = 10000.0, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Apply RoPE (Eq. 34) to ``x``.

    Args:
        x: `[..., N, D]`; dim -2 is the sequence, D (the last dim) must be even.
        offset: position of ``x[..., 0, :]``; positions are ``offset .. offset+N-1``.
        base: the RoPE base (10000 in the paper).
        positions: explicit integer positions, broadcastable to `x.shape[:-1]` (e.g. `[B, 1, N]`
            per row for `[B, H, N, D]`); overrides ``offset``.

    Returns:
        `[..., N, D]` in the dtype of ``x``; angles and cos/sin are computed in float32 or wider.
    """
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., N, D], got {tuple(x.shape)}")
    n, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"x: the last dim (D={d}) must be even for rotary pairs")
    cos, sin = rotary_tables(n, d, offset=offset, base=base, dtype=x.dtype, device=x.device, positions=positions)
    return rotate_with_tables(x, cos, sin).to(x.dtype)
