"""Pieces every fused kernel shares (``@triton.jit`` helpers): GEMM operands, the FAVOR+
exponents of a block of features made on chip from a q or k tile and the projection, and RoPE
on interleaved pairs.

Features are handled in blocks of BM (even) features, each as two halves of BM / 2: the even
features 2i and the odd ones 2i + 1 of the block, so that a RoPE pair (2i, 2i + 1) is the same
lane of the two halves and the rotation is elementwise (no shuffle):
``r_even = f_even cos - f_odd sin``, ``r_odd = f_odd cos + f_even sin``. States are kept and
stored the same way (rows 2i and 2i + 1 of the `[m, e]` state).

Precision (``LOWP``): bf16 GEMM operands with float32 accumulation (the tensor cores), as the
chunk-parallel path's bf16 arithmetic (``parallel.py``); else float32 operands multiplied in
IEEE float32 (``input_precision="ieee"``: no tf32). Arithmetic outside ``tl.dot`` is float32.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _op(x, LOWP: tl.constexpr):
    """The GEMM operand of a float32 tile: bf16 (rounded to nearest) under LOWP, else itself."""
    if LOWP:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _state_block(j0, eb, m, d, e, BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """The walks' indices (``_states``, ``_dstates``): a block's even and odd feature lanes (a RoPE
    pair shares a lane) from ``j0`` and their masks, the value columns of block ``eb``, q or k's
    columns, and the state tile's offsets and masks `[BM / 2, BE]`."""
    lanes = tl.arange(0, BM // 2)
    je = j0 + 2 * lanes
    jo = je + 1
    me, mo = je < m, jo < m
    ce = eb * BE + tl.arange(0, BE)
    em = ce < e
    cols = tl.arange(0, BD)
    cm = cols < d
    se = je[:, None] * e + ce[None, :]
    so = jo[:, None] * e + ce[None, :]
    return lanes, je, jo, me, mo, ce, em, cols, cm, se, so, me[:, None] & em[None, :], mo[:, None] & em[None, :]


@triton.jit
def _dot(a, b, LOWP: tl.constexpr):
    """a @ b with a float32 result: bf16 operands under LOWP, IEEE float32 otherwise."""
    if LOWP:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _rows(ptr, t, tm, s_n, cols, cm):
    """Rows t (int64 `[C]`, valid where tm) of a `[N, x]` slab with row stride s_n and unit column
    stride: `[C, X]` in float32 (0 outside)."""
    x = tl.load(ptr + t[:, None] * s_n + cols[None, :], mask=tm[:, None] & cm[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _proj(x, wa, wb, j, jm, cols, cm, d, LOWP: tl.constexpr):
    """x `[C, BD]` (operand) @ w16[j]^T -> `[C, H]` float32: the exponents of features j (rows of
    the projection scaled by d^(-1/4), `[m, d]` contiguous; under LOWP its bf16 value part wa and
    remainder wb, so the exponents are as from the float32 projection)."""
    p = j[:, None] * d + cols[None, :]
    msk = jm[:, None] & cm[None, :]
    a = _dot(x, tl.trans(tl.load(wa + p, mask=msk, other=0.0)), LOWP)
    if LOWP:
        a += tl.dot(x, tl.trans(tl.load(wb + p, mask=msk, other=0.0)))
    return a


@triton.jit
def _q_exps(x, wa, wb, c, j0, m, d, lanes, cols, cm, LOWP: tl.constexpr):
    """The query exponents ``q w16^T + c`` of the even and odd features of the block at j0, -inf
    past m (so that they drop out of the row max and their features are 0)."""
    je = j0 + 2 * lanes
    jo = je + 1
    me = je < m
    mo = jo < m
    ae = _proj(x, wa, wb, je, me, cols, cm, d, LOWP) + tl.load(c + je, mask=me, other=0.0)[None, :]
    ao = _proj(x, wa, wb, jo, mo, cols, cm, d, LOWP) + tl.load(c + jo, mask=mo, other=0.0)[None, :]
    return tl.where(me[None, :], ae, float("-inf")), tl.where(mo[None, :], ao, float("-inf"))


@triton.jit
def _q_feats(x, rmax, wa, wb, c, j0, m, d, lanes, cols, cm, LOWP: tl.constexpr):
    """phi(q) of the block's even and odd features: ``exp(a - rowmax)`` (0 past m)."""
    ae, ao = _q_exps(x, wa, wb, c, j0, m, d, lanes, cols, cm, LOWP)
    return tl.exp(ae - rmax[:, None]), tl.exp(ao - rmax[:, None])


@triton.jit
def _k_feats(x, ksq, real, wa, wb, c, j0, m, d, lanes, cols, cm, FLOOR: tl.constexpr, LOWP: tl.constexpr):
    """phi(k) of the block's even and odd features: ``exp(clamp(k w16^T - c - |k|^2 / (2 sqrt d),
    FLOOR, 0))``, 0 for keys that are not real (padding, past N) and past m; and where the
    exponent lies inside the clamp (where its gradient passes)."""
    je = j0 + 2 * lanes
    jo = je + 1
    me = je < m
    mo = jo < m
    ae = _proj(x, wa, wb, je, me, cols, cm, d, LOWP) - tl.load(c + je, mask=me, other=0.0)[None, :] - ksq[:, None]
    ao = _proj(x, wa, wb, jo, mo, cols, cm, d, LOWP) - tl.load(c + jo, mask=mo, other=0.0)[None, :] - ksq[:, None]
    ke = real[:, None] & me[None, :]
    ko = real[:, None] & mo[None, :]
    fe = tl.where(ke, tl.exp(tl.minimum(tl.maximum(ae, FLOOR), 0.0)), 0.0)
    fo = tl.where(ko, tl.exp(tl.minimum(tl.maximum(ao, FLOOR), 0.0)), 0.0)
    return fe, fo, ke & (ae >= FLOOR) & (ae <= 0.0), ko & (ao >= FLOOR) & (ao <= 0.0)


@triton.jit
def _tables(cos, sin, t, tm, s_n, s_p, j0, m, lanes):
    """cos, sin `[C, H]` of the pairs of the block at j0 at rows t (0 outside)."""
    p = j0 // 2 + lanes
    msk = tm[:, None] & (2 * p < m)[None, :]
    off = t[:, None] * s_n + p[None, :] * s_p
    return tl.load(cos + off, mask=msk, other=0.0).to(tl.float32), tl.load(sin + off, mask=msk, other=0.0).to(tl.float32)


@triton.jit
def _rot(fe, fo, cs, sn):
    """RoPE of the pairs (even, odd): by the angle."""
    return fe * cs - fo * sn, fo * cs + fe * sn


@triton.jit
def _rot_t(ge, go, cs, sn):
    """The transpose of ``_rot`` (RoPE by minus the angle), for gradients."""
    return ge * cs + go * sn, go * cs - ge * sn
