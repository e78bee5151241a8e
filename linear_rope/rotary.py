"""Rotary position embedding (RoFormer Eq. 34), interleaved pairs.

Position ``p`` rotates the pair ``(x[2i], x[2i+1])`` of a ``D``-dim vector by the angle
``p * theta_i`` with ``theta_i = base ** (-2i / D)``::

    out[2i]   = x[2i] * cos(p theta_i) - x[2i+1] * sin(p theta_i)
    out[2i+1] = x[2i] * sin(p theta_i) + x[2i+1] * cos(p theta_i)

This is the pairing of the paper and of performer-pytorch's ``rotate_every_two``; it is *not*
the "half-split" pairing (i, i + D/2) used by GPT-NeoX / Llama.

Positions are integers, at most ``MAX_POSITION`` = 2**62 - 1 (a ValueError beyond). The angle
``p * theta_i`` is reduced modulo 2 pi exactly before its cos and sin are taken
(``rope_turns``): a float64 product alone is off by ``p * 2**-53`` radians (a whole radian
at p = 2**53), so every position up to the bound gets its angle to about 1e-15 radians, as
position 0 does. A position beyond the bound that no check read (a tensor's values on the
GPU's rule, see ``checks.value_checks``; an offset plus a length that wrapped past 2**63) gets
NaN angles, never the angle of another position. The cos/sin tables are kept in float32 or
wider whatever the input dtype.
"""
from __future__ import annotations

import functools
from decimal import Decimal
from fractions import Fraction

import torch

from .checks import check_base, is_static, value_checks, values

__all__ = ["rotary_tables", "apply_rotary", "rotate_with_tables", "check_offset", "check_positions", "token_positions",
           "MAX_POSITION",
           "rope_thetas", "rope_turns", "check_last_position"]

MAX_POSITION = 2**62 - 1  # the largest position: offset + N stays in int64, angles stay exact
PI = Fraction(Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628"))
_LIMB = 21  # bits per limb: a product of two limbs (< 2**42), and three such summed, are exact in float64


def rope_thetas(dim: int, base: float) -> list[float]:
    """theta_i = base ** (-2i / dim), i < dim / 2, as float64: the one definition of the frequencies."""
    return [base ** (-2.0 * i / dim) for i in range(dim // 2)]


@functools.lru_cache(maxsize=64)
def _turn_limbs(dim: int, base: float) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """frac(theta_i / 2 pi) to 126 bits, c_1..c_6 (21-bit limbs, weights 2**-21k), folded for
    the position limbs j = 0, 1, 2 of ``rope_turns``: a_j = c_(j+1) 2**-21 (exact) and
    b_j = sum_(k >= j+2) c_k 2**-21(k-j) (rounded). Returns (a `[3][dim/2]`, b `[3][dim/2]`)."""
    cs = []
    for t in rope_thetas(dim, base):
        u = Fraction(t) / (2 * PI)
        U = round((u - (u.numerator // u.denominator)) * 2 ** (6 * _LIMB)) % 2 ** (6 * _LIMB)
        cs.append([0] + [(U >> (6 * _LIMB - _LIMB * k)) & ((1 << _LIMB) - 1) for k in range(1, 7)])
    a = tuple(tuple(c[j + 1] * 2.0**-_LIMB for c in cs) for j in range(3))
    b = tuple(tuple(float(sum(Fraction(c[k], 2 ** (_LIMB * (k - j))) for k in range(j + 2, 7))) for c in cs)
              for j in range(3))
    return a, b


def _limbs(dim: int, base: float):
    """``_turn_limbs``, which torch.compile takes as the constant it is (no tracing of Fractions)."""
    return _turn_limbs(dim, base)


# What ``@torch.compiler.assume_constant_result`` sets, without importing ``torch._dynamo`` (a
# second of ``import linear_rope``) to set it; tests/test_package.py checks the decorator still does.
_limbs._dynamo_marked_constant = True


_LIMB_TENSORS: dict = {}  # (dim, base, device) -> (a, b) on that device, made once


def _limb_tensors(dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``_limbs`` as float64 tensors on ``device``. Made from Python lists once per (dim, base,
    device) and kept, so a forward copies nothing from the host (on CUDA such a copy waits for
    the GPU). In a compiled graph they are the graph's constants; under a ``torch.func``
    transform or a fake-tensor trace they are made afresh and not kept."""
    key = (dim, base, device)
    got = None if is_static() else _LIMB_TENSORS.get(key)
    if got is None:
        with torch.inference_mode(False):  # usable outside inference_mode too
            got = tuple(torch.tensor(t, dtype=torch.float64, device=device) for t in _limbs(dim, base))
        if not is_static() and type(got[0]) is torch.Tensor:  # a plain tensor, not a fake one
            if len(_LIMB_TENSORS) >= 64:
                _LIMB_TENSORS.pop(next(iter(_LIMB_TENSORS)))
            _LIMB_TENSORS[key] = got
    return got


def rope_turns(positions: torch.Tensor, dim: int, base: float, in_range: bool = False) -> torch.Tensor:
    """frac(p * theta_i / 2 pi) `[..., dim / 2]` in float64 for integer positions `[...]`, within
    about 2**-51 turns of the exact value for every |p| <= MAX_POSITION; NaN for the others
    (|p| >= 2**62: among them what an int64 sum that wrapped past 2**63 leaves, and -2**63,
    whose magnitude int64 cannot hold). ``in_range``: the caller knows every |p| <= MAX_POSITION
    (no pass to look).

    p = sum_j P_j 2**21j (three signed 21-bit limbs) and frac(theta / 2 pi) = sum_k c_k 2**-21k.
    P_j 2**21j times c_k is a whole number of turns for k <= j; what is left of limb j is
    P_j a_j + P_j b_j (see ``_turn_limbs``). Each P_j a_j is a multiple of 2**-21 below 2**21,
    so their sum is exact in float64 (in any order, as a GEMM), and so is its fraction; the
    P_j b_j are below 1 each and add a rounding of 2**-53 each.
    """
    dim = int(dim)  # (a 0-dim tensor under torch.jit.trace)
    a, b = _limb_tensors(dim, float(base), positions.device)
    p = positions.long().reshape(-1, 1)
    mag, sign = p.abs(), torch.where(p < 0, -1.0, 1.0).to(torch.float64)
    limbs = torch.cat([(mag >> (_LIMB * j)) & ((1 << _LIMB) - 1) for j in range(3)], dim=1).to(torch.float64) * sign
    turns = limbs @ a  # (positions, dim/2): exact
    turns -= turns.floor()
    turns = torch.addmm(turns, limbs, b)
    turns -= turns.floor()
    if not in_range:  # |p| > MAX_POSITION (and -2**63, whose mag is < 0)
        turns = turns.masked_fill((mag >> 62) != 0, float("nan"))
    return turns.view(*positions.shape, dim // 2)


def _shown(vals: torch.Tensor) -> str:
    vals = vals.tolist()
    return str(vals) if len(vals) <= 8 else f"[{', '.join(map(str, vals[:8]))}, ...]"


def check_offset(offset, name: str = "offset", rows: int | None = None, read: bool | None = None):
    """An int in [0, MAX_POSITION], or (when ``rows`` is given) also an integer tensor `[rows]`
    of per-row values (returned as long). A tensor's values are read where ``read`` says (None:
    ``checks.value_checks``, i.e. on CPU tensors, or everywhere with ``LINEAR_ROPE_CHECKS=1``);
    unread, a negative position gets its exact angle and one past ``MAX_POSITION`` NaN angles
    (``rope_turns``), never another position's."""
    if isinstance(offset, torch.Tensor) and rows is not None:
        if offset.dtype not in (torch.int32, torch.int64) or offset.shape != (rows,):
            raise ValueError(f"{name} must be an int or an integer tensor [{rows}], got "
                             f"{offset.dtype} {tuple(offset.shape)}")
        if offset.device.type == "meta":
            raise ValueError(f"{name}: a meta tensor has no values to read")
        if value_checks(offset) if read is None else read:
            vals = values(offset)
            if vals.numel() and not bool(((vals >= 0) & (vals <= MAX_POSITION)).all()):
                raise ValueError(f"{name} must lie in [0, MAX_POSITION = 2**62 - 1], got {_shown(vals)}")
        return offset.long()
    if isinstance(offset, bool) or not isinstance(offset, int):
        kind = "an int or an integer tensor [B]" if rows is not None else "a non-negative int"
        raise ValueError(f"{name} must be {kind}, got {offset!r}")
    if offset < 0:
        raise ValueError(f"{name} must be non-negative, got {offset}")
    if offset > MAX_POSITION:
        raise ValueError(f"{name} {offset} is past MAX_POSITION = 2**62 - 1, the largest position whose RoPE "
                         "angle is formed exactly")
    return offset


def check_last_position(offset, n: int, name: str = "offset", read: bool | None = None) -> None:
    """ValueError where positions ``offset .. offset + n - 1`` (per row, for a tensor offset
    already checked, where ``read`` says: see ``check_offset``) run past ``MAX_POSITION``."""
    if n <= 0 or not (isinstance(offset, int) or (value_checks(offset) if read is None else read)):
        return
    top = offset if isinstance(offset, int) else (int(values(offset).max()) if offset.numel() else 0)
    if top + n - 1 > MAX_POSITION:
        raise ValueError(f"{name}: positions run to {top} + {n - 1} = {top + n - 1}, past MAX_POSITION = 2**62 - 1, "
                         "the largest position whose RoPE angle is formed exactly")


def check_positions(positions, name: str = "positions") -> None:
    """Explicit positions: an integer tensor whose every value ``p`` has ``|p| <= MAX_POSITION``
    (read where ``checks.value_checks`` says; unread, one beyond gets NaN angles)."""
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex() \
            or positions.dtype in (torch.bool, torch.uint64):  # (uint64 past 2**63 would wrap in int64)
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"{name} must be an integer tensor of int64 or narrower, got {got}")
    if not positions.numel() or not value_checks(positions):
        return
    vals = values(positions).long()
    bad = (vals > MAX_POSITION) | (vals < -MAX_POSITION)
    if bool(bad.any()):
        raise ValueError(f"{name}: {_shown(vals[bad])} past MAX_POSITION = 2**62 - 1 in magnitude, the largest "
                         "position whose RoPE angle is formed exactly")


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
    ``table_dtype(dtype)`` (float32 or wider). Positions are integers; with ``offset`` they must
    stay within ``MAX_POSITION``; every angle is reduced modulo 2 pi exactly (``rope_turns``).
    """
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    base = check_base(base)
    if positions is None:
        check_offset(offset)
        check_last_position(offset, n)
        pos = torch.arange(offset, offset + n, dtype=torch.long, device=device)
    else:
        check_positions(positions)
        pos = positions
    angle = rope_turns(pos, dim, base, in_range=positions is None) * (2 * torch.pi)  # (..., n, dim/2) in [0, 2 pi)
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
        `[..., N, D]` in the dtype of ``x``; angles are reduced modulo 2 pi exactly and cos/sin
        are computed in float32 or wider.
    """
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., N, D], got {tuple(x.shape)}")
    n, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"x: the last dim (D={d}) must be even for rotary pairs")
    cos, sin = rotary_tables(n, d, offset=offset, base=base, dtype=x.dtype, device=x.device, positions=positions)
    return rotate_with_tables(x, cos, sin).to(x.dtype)
