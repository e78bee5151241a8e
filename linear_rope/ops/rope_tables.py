"""RoPE's cos / sin tables for the chunk-parallel path (and the torch path's ``chunk.py``):
exact angles (``rotary.rope_turns``: positions reduced modulo one turn in integer limbs) with
their constants made once per device, and the tables of positions offset .. offset + n - 1 made
once per shape in eager (none under ``torch.compile``, where they are plain ops). ``rotate``
applies them to interleaved pairs.
"""
from __future__ import annotations

import functools

import torch

from ..checks import is_compiling
from ..rotary import _LIMB, _limb_tensors, rope_turns, rotary_tables

__all__ = ["CACHED_TABLE", "rotate", "rope_pair_tables", "rope_tables"]


def _turns(positions: torch.Tensor, dim: int, base: float, nonneg: bool = False) -> torch.Tensor:
    """``rotary.rope_turns`` with its constants kept per device (``rotary._limb_tensors``, the one
    copy); the same under compile.
    ``nonneg``: the positions are known to lie in [0, MAX_POSITION] (no sign to carry)."""
    if is_compiling():
        return rope_turns(positions, dim, base, in_range=nonneg)
    a, b = _limb_tensors(dim, float(base), positions.device)
    p = positions.reshape(-1, 1)
    mag = p if nonneg else p.abs()
    limbs = torch.cat([(mag >> (_LIMB * j)) & ((1 << _LIMB) - 1) for j in range(3)], dim=1).to(torch.float64)
    if not nonneg:
        limbs = limbs * torch.where(p < 0, -1.0, 1.0).to(torch.float64)
    turns = limbs @ a
    turns -= turns.floor()
    turns = torch.addmm(turns, limbs, b)
    turns -= turns.floor()
    if not nonneg:  # past MAX_POSITION (a wrapped sum, -2**63): NaN, as rope_turns gives
        turns = turns.masked_fill((mag >> 62) != 0, float("nan"))
    return turns.view(*positions.shape, dim // 2)


CACHED_TABLE = 1 << 22  # entries of a cos / sin table kept between calls, at most (16 MiB in float32)


@functools.lru_cache(maxsize=8)
def _tables_at(n: int, dim: int, offset: int, base: float, device: torch.device, dtype: torch.dtype):
    """cos, sin `[n, dim / 2]` of positions offset .. offset + n - 1 (eager: made once per shape;
    plain tensors even when first asked for under ``torch.inference_mode``)."""
    with torch.inference_mode(False), torch.no_grad():
        return _tables(torch.arange(offset, offset + n, device=device), dim, base, dtype)


def _tables(positions, dim, base, dtype):
    angle = _turns(positions, dim, base) * (2 * torch.pi)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _pair_tables(positions, dim, base, dtype, nonneg=False):
    """The tables of ``rotate``: (cos, cos) and (-sin, sin) per pair, `[..., n, dim]`."""
    angle = (_turns(positions, dim, base, nonneg) * (2 * torch.pi)).to(dtype)  # in [0, 2 pi): exact to dtype
    cos, sin = angle.cos(), angle.sin()
    return torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (``rotary.rotate_with_tables``) as ``x cos2 + swap(x) sin2``,
    swap exchanging each pair: three elementwise kernels (no strided slices, whose backward
    writes zeros first)."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(x * cos2, swapped, sin2)


@functools.lru_cache(maxsize=8)
def _pair_tables_at(n: int, dim: int, offset: int, base: float, device: torch.device, dtype: torch.dtype):
    """``_pair_tables`` of positions offset .. offset + n - 1 (eager: made once per shape; plain
    tensors even when first asked for under ``torch.inference_mode``)."""
    with torch.inference_mode(False), torch.no_grad():
        return _pair_tables(torch.arange(offset, offset + n, device=device), dim, base, dtype, nonneg=True)


def rope_pair_tables(n: int, dim: int, offset: int, base: float, positions, device, dtype):
    """``rotate``'s tables `[n, dim]`, or `[B, 1, n, dim]` for per-row ``positions`` `[B, n]`."""
    if positions is not None:
        cos2, sin2 = _pair_tables(positions.long(), dim, base, dtype)
        return cos2[:, None], sin2[:, None]
    if is_compiling() or n * dim > CACHED_TABLE:
        return _pair_tables(torch.arange(offset, offset + n, device=device), dim, base, dtype, nonneg=True)
    return _pair_tables_at(n, dim, offset, float(base), torch.device(device), dtype)


def rope_tables(n: int, dim: int, offset: int, base: float, positions, device, dtype):
    """cos, sin `[n, dim / 2]`, or `[B, 1, n, dim / 2]` for per-row ``positions`` `[B, n]`."""
    if torch.jit.is_tracing():  # sizes are traced tensors there: the uncached tables
        cos, sin = rotary_tables(int(n), int(dim), offset=offset, base=base, dtype=dtype, device=device,
                                 positions=positions)
        return (cos[:, None], sin[:, None]) if positions is not None else (cos, sin)
    if positions is not None:
        cos, sin = _tables(positions.long(), dim, base, dtype)
        return cos[:, None], sin[:, None]
    if is_compiling() or n * dim // 2 > CACHED_TABLE:
        return _tables(torch.arange(offset, offset + n, device=device), dim, base, dtype)
    return _tables_at(n, dim, offset, float(base), torch.device(device), dtype)
