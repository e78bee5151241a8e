"""Causal Eq. 19 (and Eq. 18): the chunk-parallel Triton kernels, one program per chunk of ``C``
tokens and row-head, given the chunk states of ``kernels._state_kernel`` (forward) and
``kernels._state_grad_kernel`` (backward). Each program loops over the blocks of ``BP`` rotation
pairs and sums the blocks' contributions on chip (registers), so nothing larger than the
outputs is written:

* ``_out_kernel``: out_t = (sum over blocks of R phi(q_t) . h + (A v)_t) / den_t with the
  intra-chunk scores A = (R phi(q))(R phi(k))^T (causal), den_t = phi(q_t) . (hz + sum_{n <= t}
  phi(k_n)) (unrotated); out and den `[BH, N]` (the backward needs them).
* ``_dq_kernel``: dq from dnum . h^T, the intra-chunk (dnum v^T) R phi(k), and the denominator;
  through RoPE back and through the FAVOR+ exponent (dq = (dphi * phi) w d^(-1/4), summed over
  the blocks), or stored per feature for features in.
* ``_dkv_kernel``: dv = sum over blocks of R phi(k) dh + A^T dnum; dk from v dh^T, the
  intra-chunk (v dnum^T) R phi(q) and the denominator's suffix sums, through RoPE and the
  clamped key exponent.

Shared pieces and precisions: ``kernels.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import (_INTS, _block, _chunk, _exp_weights, _feats, _flags, _load_pairs, _mm, _mma, _mma_split, _rotate, _scale,
                      _shift, _split, _sq, _tables, _x, _xin)


@triton.jit
def _program(q_ptr, k_ptr, km_ptr, qmax_ptr, N, H, d, x_dim, FLAGS, C: tl.constexpr, BD: tl.constexpr,
             FAVOR: tl.constexpr, ACC: tl.constexpr):
    """What every chunk-parallel program (chunk ic, row-head bh) starts from: its row-head's batch
    row b, the number of chunks, d^(-1/4), the rotary flag, the chunk's tokens and masks, the
    q / k rows, the query stabiliser and |k'|^2 / 2 of the chunk (once per chunk)."""
    ic, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b = bh // H
    scale = _scale(d, ACC)
    rotary, has_mask, _s0, _sT = _flags(FLAGS)
    tok, tmask, km, real = _chunk(km_ptr + b * N, ic * C, N, has_mask, C, ACC)
    q_row, k_row = q_ptr + bh * N * x_dim, k_ptr + bh * N * x_dim
    qmax = _shift(qmax_ptr + bh * N, tok, tmask, FAVOR, ACC)
    sqk = _sq(k_row, tok, real, d, scale, BD, FAVOR, ACC)
    return ic, bh, b, tl.cdiv(N, C), scale, rotary, tok, tmask, real, q_row, k_row, qmax, sqk


@triton.jit
def _block_feats(i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR,
                 BP: tl.constexpr, BD: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr, XPREC: tl.constexpr):
    """Block i of pairs in a chunk-parallel program: the block (``_block``), the exponent weights'
    first two pieces (the feature gradients' operands), and phi(q), phi(k) with where their
    gradients pass (``_feats``); x is reloaded per block (cache hits), so it is not live across
    the block loop."""
    p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, FAVOR, ACC)
    e1, e2, e3, o1, o2, o3 = _exp_weights(wp_ptr, weT, woT, p, vale, valo, m, d, FAVOR, XPREC)
    xq = _xin(q_row, tok, real, d, scale, BD, FAVOR, ACC, XPREC)
    xk = _xin(k_row, tok, real, d, scale, BD, FAVOR, ACC, XPREC)
    fe, fo, oqe, oqo = _feats(q_row, xq, qmax, tok, real, p, vale, valo, e1, e2, e3, o1, o2, o3, c, qmax, m, FLOOR,
                              False, FAVOR, ACC, XPREC)
    ke, ko, oke, oko = _feats(k_row, xk, sqk, tok, real, p, vale, valo, e1, e2, e3, o1, o2, o3, c, qmax, m, FLOOR,
                              True, FAVOR, ACC, XPREC)
    return p, pmask, vale, valo, weT, woT, e1, e2, o1, o2, fe, fo, oqe, oqo, ke, ko, oke, oko


@triton.jit(do_not_specialize=_INTS)
def _out_kernel(q_ptr, k_ptr, v_ptr, w_ptr, wp_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, h_ptr, hz_ptr, out_ptr,
                den_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
                C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (c, bh): out `[BH, N, e]` and den `[BH, N]` of chunk c (den <= 0 is stored as 0 and
    divides by 1, as in ``naive.py``; NaN stays NaN)."""
    ic, bh, b, NT, scale, rotary, tok, tmask, real, q_row, k_row, qmax, sqk = _program(
        q_ptr, k_ptr, km_ptr, qmax_ptr, N, H, d, x_dim, FLAGS, C, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    A = tl.zeros((C, C), ACC)
    num = tl.zeros((C, BE), ACC)
    den = tl.zeros((C,), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, weT, woT, e1, e2, o1, o2, fe, fo, _, _, ke, ko, _, _ = _block_feats(
            i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR, BP, BD, FAVOR, ACC, XPREC)
        h_e, h_o, z_e, z_o = _load_pairs(h_ptr, hz_ptr, bh * NT + ic, p, vale, valo, ee, m, e, True, ACC)
        den += tl.sum(fe * (z_e[None, :] + tl.cumsum(ke, axis=0)) + fo * (z_o[None, :] + tl.cumsum(ko, axis=0)),
                      axis=1)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        re, ro = _rotate(fe, fo, cs, sn)
        rke, rko = _rotate(ke, ko, cs, sn)
        A = _mma(_mma(A, re, tl.trans(rke), PREC), ro, tl.trans(rko), PREC)
        num = _mma(_mma(num, re, h_e, SPREC), ro, h_o, SPREC)
    vm = real[:, None] & (ee[None, :] < e)
    v = tl.load((v_ptr + bh * N * e) + tok[:, None] * e + ee[None, :], mask=vm, other=0.0)  # input dtype: exact
    A = tl.where(tok[:, None] >= tok[None, :], A, 0.0)
    num = _mma(num, A, v, PREC)
    out = num / tl.where(den <= 0.0, 1.0, den)[:, None]
    tl.store((out_ptr + bh * N * e) + tok[:, None] * e + ee[None, :], out, mask=tmask[:, None] & (ee[None, :] < e))
    tl.store((den_ptr + bh * N) + tok, tl.where(den <= 0.0, 0.0, den), mask=tmask)


@triton.jit
def _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC: tl.constexpr):
    """v, dnum `[C, BE]` and dden `[C]` of the chunk, 0 at masked tokens."""
    vm = real[:, None] & (ee[None, :] < e)
    off = tok[:, None] * e + ee[None, :]  # 32-bit tile offsets from 64-bit scalar bases
    v = tl.load((v_ptr + bh * N * e) + off, mask=vm, other=0.0)  # in the input dtype: an exact operand (``_mma``)
    dnum = tl.load((dnum_ptr + bh * N * e) + off, mask=vm, other=0.0).to(ACC)
    dden = tl.load((dden_ptr + bh * N) + tok, mask=real, other=0.0).to(ACC)
    return v, dnum, dden


@triton.jit
def _feature_grad(dx, dfe, dfo, fe, fo, oke, oko, weT, woT, e1, e2, o1, o2, PREC: tl.constexpr, XPREC: tl.constexpr):
    """FAVOR+: d phi -> d exponent (phi = exp(a): da = dphi * phi, 0 where the gradient does not
    pass) -> dx plus the block's share (through a = w . x'), and sum_j da_j `[C]` (keys: the
    |x'|^2 / 2 term). ``"bf16w3"``: through the scaled projection's first two bf16 pieces
    (16 bits, as ``"bf16x3"``), so dx is d/dx itself (``_grad_scale`` = 1); else through
    ``_block``'s fp32 tiles, dx is d/dx' (``_grad_scale`` = d^(-1/4))."""
    dae = tl.where(oke, dfe * fe, 0.0)
    dao = tl.where(oko, dfo * fo, 0.0)
    if XPREC == "bf16w3":
        ah, al = _split(dae, "bf16x3")
        dx = tl.dot(ah, tl.trans(e1), tl.dot(ah, tl.trans(e2), tl.dot(al, tl.trans(e1), dx)))
        ah, al = _split(dao, "bf16x3")
        dx = tl.dot(ah, tl.trans(o1), tl.dot(ah, tl.trans(o2), tl.dot(al, tl.trans(o1), dx)))
    else:
        dx = _mma(_mma(dx, dae, tl.trans(weT), PREC), dao, tl.trans(woT), PREC)
    return dx, tl.sum(dae + dao, axis=1)


@triton.jit
def _grad_scale(scale, XPREC: tl.constexpr):
    """What ``_feature_grad``'s dx is multiplied by to give dq (see there)."""
    if XPREC == "bf16w3":
        g = scale * 0.0 + 1.0
    else:
        g = scale
    return g


@triton.jit
def _store_columns(ptr, bh, N, m, tok, tmask, p, vale, valo, dfe, dfo, oke, oko):
    """Features in: the block's columns of d phi `[BH, N, m]` (0 at masked tokens)."""
    off = tok[:, None] * m + 2 * p[None, :]
    ptr = ptr + bh * N * m
    tl.store(ptr + off, tl.where(oke, dfe, 0.0), mask=tmask[:, None] & vale[None, :])
    tl.store(ptr + off + 1, tl.where(oko, dfo, 0.0), mask=tmask[:, None] & valo[None, :])


@triton.jit(do_not_specialize=_INTS)
def _dq_kernel(q_ptr, k_ptr, v_ptr, w_ptr, wp_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, h_ptr, hz_ptr, dnum_ptr,
               dden_ptr, dq_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
               C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
               FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (c, bh): dq of chunk c, `[BH, N, d]` (FAVOR+) or `[BH, N, m]` (features in)."""
    ic, bh, b, NT, scale, rotary, tok, tmask, real, q_row, k_row, qmax, sqk = _program(
        q_ptr, k_ptr, km_ptr, qmax_ptr, N, H, d, x_dim, FLAGS, C, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    v, dnum, dden = _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC)
    Pm = tl.where(tok[:, None] >= tok[None, :], _mm(dnum, tl.trans(v), PREC), 0.0)  # dnum_t . v_n, n <= t
    pmh, pml = _split(Pm, PREC)  # split once, outside the block loop
    dnh, dnl = _split(dnum, SPREC)
    dx = tl.zeros((C, BD), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, weT, woT, e1, e2, o1, o2, fe, fo, oqe, oqo, ke, ko, _, _ = _block_feats(
            i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR, BP, BD, FAVOR, ACC, XPREC)
        h_e, h_o, z_e, z_o = _load_pairs(h_ptr, hz_ptr, bh * NT + ic, p, vale, valo, ee, m, e, True, ACC)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        rke, rko = _rotate(ke, ko, cs, sn)
        dre = _mma_split(_mma_split(tl.zeros_like(rke), dnh, dnl, tl.trans(h_e), SPREC), pmh, pml, rke, PREC)
        dro = _mma_split(_mma_split(tl.zeros_like(rko), dnh, dnl, tl.trans(h_o), SPREC), pmh, pml, rko, PREC)
        dre, dro = _rotate(dre, dro, cs, -sn)  # R^T: rotate back
        dfe = dre + dden[:, None] * (z_e[None, :] + tl.cumsum(ke, axis=0))
        dfo = dro + dden[:, None] * (z_o[None, :] + tl.cumsum(ko, axis=0))
        if FAVOR:
            dx, _ = _feature_grad(dx, dfe, dfo, fe, fo, oqe, oqo, weT, woT, e1, e2, o1, o2, PREC, XPREC)
        else:
            _store_columns(dq_ptr, bh, N, m, tok, tmask, p, vale, valo, dfe, dfo, oqe, oqo)
    if FAVOR:
        dd = tl.arange(0, BD)
        tl.store((dq_ptr + bh * N * d) + tok[:, None] * d + dd[None, :], dx * _grad_scale(scale, XPREC),
                 mask=tmask[:, None] & (dd[None, :] < d))


@triton.jit(do_not_specialize=_INTS)
def _dkv_kernel(q_ptr, k_ptr, v_ptr, w_ptr, wp_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, dh_ptr, dhz_ptr, dnum_ptr,
                dden_ptr, dk_ptr, dv_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
                C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (c, bh): dk (as dq) and dv `[BH, N, e]` of chunk c, given the later chunks' state
    gradients dh, dhz."""
    ic, bh, b, NT, scale, rotary, tok, tmask, real, q_row, k_row, qmax, sqk = _program(
        q_ptr, k_ptr, km_ptr, qmax_ptr, N, H, d, x_dim, FLAGS, C, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    v, dnum, dden = _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC)
    later = tok[:, None] <= tok[None, :]  # [n, t]: t >= n
    Pt = tl.where(later, _mm(v, tl.trans(dnum), PREC), 0.0)  # v_n . dnum_t
    pth, ptl = _split(Pt, PREC)  # split once, outside the block loop
    At = tl.zeros((C, C), ACC)
    dv = tl.zeros((C, BE), ACC)
    dx = tl.zeros((C, BD), ACC)
    dsum = tl.zeros((C,), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, weT, woT, e1, e2, o1, o2, fe, fo, _, _, ke, ko, oke, oko = _block_feats(
            i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR, BP, BD, FAVOR, ACC, XPREC)
        G_e, G_o, Z_e, Z_o = _load_pairs(dh_ptr, dhz_ptr, bh * NT + ic, p, vale, valo, ee, m, e, True, ACC)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        re, ro = _rotate(fe, fo, cs, sn)
        rke, rko = _rotate(ke, ko, cs, sn)
        At = _mma(_mma(At, rke, tl.trans(re), PREC), rko, tl.trans(ro), PREC)
        dv = _mma(_mma(dv, rke, G_e, SPREC), rko, G_o, SPREC)
        dre = _mma_split(_mm(v, tl.trans(G_e), SPREC), pth, ptl, re, PREC)
        dro = _mma_split(_mm(v, tl.trans(G_o), SPREC), pth, ptl, ro, PREC)
        dre, dro = _rotate(dre, dro, cs, -sn)
        dke = dre + Z_e[None, :] + tl.cumsum(dden[:, None] * fe, axis=0, reverse=True)
        dko = dro + Z_o[None, :] + tl.cumsum(dden[:, None] * fo, axis=0, reverse=True)
        if FAVOR:
            dx, si = _feature_grad(dx, dke, dko, ke, ko, oke, oko, weT, woT, e1, e2, o1, o2, PREC, XPREC)
            dsum += si
        else:
            _store_columns(dk_ptr, bh, N, m, tok, tmask, p, vale, valo, dke, dko, oke, oko)
    v, dnum, dden = _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC)  # reloaded: not live
    dv = _mma(dv, tl.where(later, At, 0.0), dnum, PREC)
    vm = tmask[:, None] & (ee[None, :] < e)
    tl.store((dv_ptr + bh * N * e) + tok[:, None] * e + ee[None, :], tl.where(real[:, None], dv, 0.0), mask=vm)
    if FAVOR:
        dd = tl.arange(0, BD)
        xk = _x(k_row, tok, real, d, scale, BD, FAVOR, ACC)
        tl.store((dk_ptr + bh * N * d) + tok[:, None] * d + dd[None, :], dx * _grad_scale(scale, XPREC) - xk * (dsum * scale)[:, None],
                 mask=tmask[:, None] & (dd[None, :] < d))
