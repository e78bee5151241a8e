"""The Triton kernels' shared pieces beside the GEMMs (``@triton.jit`` helpers): runtime flags, a
block of rotation pairs and its projection rows, chunk and token loads, the FAVOR+ features in
even and odd halves (``_feats``), RoPE (``_tables``, ``_rotate``) and the state tiles' loads and
stores. GEMM precisions: ``gemm.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .gemm import _mm


@triton.jit
def _with(mask, flag):
    """mask & flag for a runtime scalar flag, broadcast first: Triton 3.9's interpreter gives a
    tensor & scalar a non-bool dtype that tl.load refuses as a mask."""
    return mask & (tl.zeros_like(mask) | flag)


@triton.jit
def _flags(FLAGS):
    """The runtime switches, packed as FLAGS = 3 + 4 * bits (odd and > 1, so Triton's integer
    specialisation never forks a variant): rotary, mask, initial state, final state (forward:
    store it; backward: its gradient is given)."""
    bits = (FLAGS - 3) // 4
    return (bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0, (bits & 8) != 0


@triton.jit
def _block(w_ptr, c_ptr, i, m, d, P, BP: tl.constexpr, BD: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr):
    """What a program keeps for pairs p = i BP .. (i+1) BP - 1: the pairs, which of their even
    and odd features exist, and (FAVOR+) the projection rows transposed `[BD, BP]` and the shifts."""
    p = i * BP + tl.arange(0, BP)
    pmask = p < P
    vale = pmask & (2 * p < m)
    valo = pmask & (2 * p + 1 < m)
    dd = tl.arange(0, BD)
    if FAVOR:
        weT = tl.load(w_ptr + (2 * p)[None, :] * d + dd[:, None], mask=vale[None, :] & (dd[:, None] < d), other=0.0)
        woT = tl.load(w_ptr + (2 * p + 1)[None, :] * d + dd[:, None], mask=valo[None, :] & (dd[:, None] < d),
                      other=0.0)
        c = tl.load(c_ptr + p, mask=pmask, other=0.0).to(ACC)  # (BP,): one shift per pair
        weT, woT = weT.to(ACC), woT.to(ACC)
    else:
        weT = tl.zeros((BD, BP), ACC)
        woT = weT
        c = tl.zeros((BP,), ACC)
    return p, pmask, vale, valo, weT, woT, c


@triton.jit
def _chunk(km_row, t0, N, has_mask, C: tl.constexpr, ACC: tl.constexpr):
    """The chunk at t0: its tokens, which exist, the key mask (1 where a token is real, 0 for
    padding and beyond N) and ``real``. Masked tokens are never loaded by the callers (selected,
    not multiplied by 0: 0 * NaN is NaN)."""
    tok = t0 + tl.arange(0, C)
    tmask = tok < N
    km = tl.where(tmask, tl.load(km_row + tok, mask=_with(tmask, has_mask), other=1.0).to(ACC), 0.0)
    return tok, tmask, km, km > 0


@triton.jit
def _load_x(row, tok, real, d, scale, BD: tl.constexpr, ACC: tl.constexpr):
    """x' = x d^(-1/4) `[C, BD]` of the chunk's real tokens (0 elsewhere): FAVOR+'s input."""
    dd = tl.arange(0, BD)
    x = tl.load(row + tok[:, None] * d + dd[None, :], mask=real[:, None] & (dd[None, :] < d), other=0.0)
    return x.to(ACC) * scale


@triton.jit
def _x(row, tok, real, d, scale, BD: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr):
    """``_load_x`` for FAVOR+, zeros (never read) for features in."""
    if FAVOR:
        x = _load_x(row, tok, real, d, scale, BD, ACC)
    else:
        x = tl.zeros((tok.shape[0], BD), ACC)
    return x


@triton.jit
def _xin(row, tok, real, d, scale, BD: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr, XPREC: tl.constexpr):
    """What ``_exponent`` takes: x as stored (bf16) for ``"bf16w3"``, else x' = x d^(-1/4) (``_x``)."""
    if XPREC == "bf16w3" and FAVOR:
        dd = tl.arange(0, BD)
        x = tl.load(row + tok[:, None] * d + dd[None, :], mask=real[:, None] & (dd[None, :] < d), other=0.0)
    else:
        x = _x(row, tok, real, d, scale, BD, FAVOR, ACC)
    return x


@triton.jit
def _sq(row, tok, real, d, scale, BD: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr):
    """|x'|^2 / 2 `[C]` of the chunk's keys (FAVOR+; zeros for features in)."""
    x = _x(row, tok, real, d, scale, BD, FAVOR, ACC)
    return 0.5 * tl.sum(x * x, axis=1)


@triton.jit
def _shift(qmax_row, tok, tmask, FAVOR: tl.constexpr, ACC: tl.constexpr):
    """The query stabiliser of the chunk's tokens (FAVOR+), zeros for features in."""
    if FAVOR:
        s = tl.load(qmax_row + tok, mask=tmask, other=0.0).to(ACC)
    else:
        s = tl.zeros((tok.shape[0],), ACC)
    return s


@triton.jit
def _exp_weights(wp_ptr, weT, woT, p, vale, valo, m, d, FAVOR: tl.constexpr, XPREC: tl.constexpr):
    """The projection tiles the exponent products take, loaded once per block of pairs and shared
    by queries and keys: for ``"bf16w3"`` the rows of w d^(-1/4) in three bf16 pieces
    `[3, m, d]` (w1 + w2 + w3 is the fp32 value exactly), even and odd `[BD, BP]` each; else
    ``_block``'s fp32 tiles (weT, ., ., woT, ., .), also for features in (no projection: ``wp_ptr``
    is then a one-element stand-in, never read)."""
    if XPREC == "bf16w3" and FAVOR:
        dd = tl.arange(0, weT.shape[0])
        off = (2 * p)[None, :] * d + dd[:, None]
        me = vale[None, :] & (dd[:, None] < d)
        mo = valo[None, :] & (dd[:, None] < d)
        e1 = tl.load(wp_ptr + off, mask=me, other=0.0)
        e2 = tl.load(wp_ptr + m * d + off, mask=me, other=0.0)
        e3 = tl.load(wp_ptr + 2 * m * d + off, mask=me, other=0.0)
        o1 = tl.load(wp_ptr + off + d, mask=mo, other=0.0)
        o2 = tl.load(wp_ptr + m * d + off + d, mask=mo, other=0.0)
        o3 = tl.load(wp_ptr + 2 * m * d + off + d, mask=mo, other=0.0)
    else:
        e1, e2, e3, o1, o2, o3 = weT, weT, weT, woT, woT, woT
    return e1, e2, e3, o1, o2, o3


@triton.jit
def _exponent(x, w1, w2, w3, XPREC: tl.constexpr):
    """x . w `[C, BP]`. ``"bf16w3"``: x raw bf16 (exact) times the three pieces of w d^(-1/4):
    three bf16 tensor-core products, each exact, summed in fp32 smallest first (as accurate as
    TF32x3, half the operand registers); else x' `[C, BD]` times w1 in ``_mm``'s precision."""
    if XPREC == "bf16w3":
        acc = tl.dot(x, w3, tl.zeros((x.shape[0], w1.shape[1]), tl.float32))
        acc = tl.dot(x, w2, acc)
        return tl.dot(x, w1, acc)
    else:
        return _mm(x, w1, XPREC)


@triton.jit
def _clamp(a, FLOOR):
    """min(max(a, floor), 0) with NaN kept (as torch.clamp): the GPU's max.f32 and Triton 3.9's
    interpreter return the other operand of a NaN by default, which would turn a NaN key
    exponent into exp(floor)."""
    a = tl.maximum(a, FLOOR, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _feats(row, x, sq, tok, real, p, vale, valo, e1, e2, e3, o1, o2, o3, c, shift, m, FLOOR,
           IS_KEY: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr, XPREC: tl.constexpr):
    """phi of the chunk's queries or keys for the block's pairs, even and odd halves `[C, BP]`
    (0 at padded pairs and masked tokens), and where the gradient passes (keys: where
    floor <= exponent <= 0, as through torch's clamp). FAVOR+: from ``x`` (``_xin``) and the
    projection tiles (``_exp_weights``), exp(w . x' + c - shift) with ``shift`` the query
    stabiliser `[C]`, or for keys exp(clamp(w . x' - sq + c, floor, 0)) with sq = |x'|^2 / 2
    (``_sq``). Features in: the block's columns of ``row`` `[N, m]`."""
    fme = real[:, None] & vale[None, :]
    fmo = real[:, None] & valo[None, :]
    if FAVOR:
        se = _exponent(x, e1, e2, e3, XPREC)
        so = _exponent(x, o1, o2, o3, XPREC)
        if IS_KEY:
            ck = sq[:, None] + c[None, :]
            ae = se - ck
            ao = so - ck
            oke = fme & (ae >= FLOOR) & (ae <= 0.0)
            oko = fmo & (ao >= FLOOR) & (ao <= 0.0)
            fe = tl.where(fme, tl.exp(_clamp(ae, FLOOR)), 0.0)
            fo = tl.where(fmo, tl.exp(_clamp(ao, FLOOR)), 0.0)
        else:
            cq = c[None, :] - shift[:, None]
            fe = tl.where(fme, tl.exp(se + cq), 0.0)
            fo = tl.where(fmo, tl.exp(so + cq), 0.0)
            oke = fme
            oko = fmo
    else:
        off = tok[:, None] * m + 2 * p[None, :]
        fe = tl.load(row + off, mask=fme, other=0.0).to(ACC)
        fo = tl.load(row + off + 1, mask=fmo, other=0.0).to(ACC)
        oke = fme
        oko = fmo
    return fe, fo, oke, oko


@triton.jit
def _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary):
    """cos, sin `[C, BP]` of the chunk's tokens and the block's pairs; 1 and 0 (no rotation:
    Eq. 18) where not rotary. Tables are `[N, P]`, or `[B, N, P]` for per-row positions."""
    row = (b % tab_rows) * N * P  # scalar: the tiles' offsets stay 32-bit
    to = tok[:, None] * P + p[None, :]
    tm = _with(tmask[:, None] & pmask[None, :], rotary)
    return tl.load(cos_ptr + row + to, mask=tm, other=1.0), tl.load(sin_ptr + row + to, mask=tm, other=0.0)


@triton.jit
def _rotate(fe, fo, cs, sn):
    """RoPE on pairs (even, odd) by tables cos, sin `[C, BP]`; (cs, -sn) rotates back."""
    return fe * cs - fo * sn, fe * sn + fo * cs


@triton.jit
def _pairs_io(ptr, zptr, row, p, vale, valo, vv, m, e, on):
    """Offsets and masks of the block's pairs in a state `[rows, m, e]` / `[rows, m]` at ``row``:
    (even offsets `[BP, BV]`, their mask, odd mask, z offsets `[BP]`, even mask, odd mask)."""
    so = (2 * p)[:, None] * e + vv[None, :]  # 32-bit tile offsets from a 64-bit scalar base
    em = _with(vv[None, :] < e, on)
    return (ptr + row * m * e) + so, vale[:, None] & em, valo[:, None] & em, (zptr + row * m) + 2 * p, \
        _with(vale, on), _with(valo, on)


@triton.jit
def _load_pairs(ptr, zptr, row, p, vale, valo, vv, m, e, on, ACC: tl.constexpr):
    """The block's rows of S `[rows, m, e]` and z `[rows, m]` at ``row``: S_e, S_o `[BP, BV]`,
    z_e, z_o `[BP]`; zeros where not ``on``."""
    sp, me, mo, zp, zme, zmo = _pairs_io(ptr, zptr, row, p, vale, valo, vv, m, e, on)
    return (tl.load(sp, mask=me, other=0.0).to(ACC), tl.load(sp + e, mask=mo, other=0.0).to(ACC),
            tl.load(zp, mask=zme, other=0.0).to(ACC), tl.load(zp + 1, mask=zmo, other=0.0).to(ACC))


@triton.jit
def _store_pairs(ptr, zptr, row, p, vale, valo, vv, m, e, S_e, S_o, z_e, z_o, on, on_z):
    """Store what ``_load_pairs`` loads where ``on`` (z where ``on_z``: the first block of e only)."""
    sp, me, mo, zp, zme, zmo = _pairs_io(ptr, zptr, row, p, vale, valo, vv, m, e, on)
    tl.store(sp, S_e, mask=me)
    tl.store(sp + e, S_o, mask=mo)
    tl.store(zp, z_e, mask=_with(zme, on_z))
    tl.store(zp + 1, z_o, mask=_with(zmo, on_z))
