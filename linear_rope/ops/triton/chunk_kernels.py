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
* ``_dk_kernel``: dk from v dh^T, the intra-chunk (v dnum^T) R phi(q) and the denominator's
  suffix sums, through RoPE and the clamped key exponent.
* ``_dv_kernel``: dv = sum over blocks of R phi(k) dh + A^T dnum (dk and dv in two kernels:
  together they did not fit the registers of two blocks per SM).

On the bf16 tensor-core path every transposed ``tl.dot`` operand is a 16-bit tile (loaded, or
rounded / split to bf16 first), so the transpose is a view of it in shared memory, never a
register shuffle of a product's fp32 result (``gemm._mma_nt``, ``gemm._mma_tn``).

Shared pieces: ``favor.py``; GEMMs and their precisions: ``gemm.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .favor import _block, _chunk, _exp_weights, _feats, _flags, _load_pairs, _rotate, _shift, _sq, _tables, _x, _xin
from .gemm import _cum, _mma, _mma_bsplit, _mma_nt, _mma_split, _scale, _split, _tri
from .kernels import _INTS


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
    """Block i of pairs in a chunk-parallel program: the block (``_block``) and phi(q), phi(k)
    with where their gradients pass (``_feats``); x is reloaded per block (cache hits), so it is
    not live across the block loop."""
    p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, FAVOR, ACC)
    e1, e2, e3, o1, o2, o3 = _exp_weights(wp_ptr, weT, woT, p, vale, valo, m, d, FAVOR, XPREC)
    xq = _xin(q_row, tok, real, d, scale, BD, FAVOR, ACC, XPREC)
    xk = _xin(k_row, tok, real, d, scale, BD, FAVOR, ACC, XPREC)
    fe, fo, oqe, oqo = _feats(q_row, xq, qmax, tok, real, p, vale, valo, e1, e2, e3, o1, o2, o3, c, qmax, m, FLOOR,
                              False, FAVOR, ACC, XPREC)
    ke, ko, oke, oko = _feats(k_row, xk, sqk, tok, real, p, vale, valo, e1, e2, e3, o1, o2, o3, c, qmax, m, FLOOR,
                              True, FAVOR, ACC, XPREC)
    return p, pmask, vale, valo, fe, fo, oqe, oqo, ke, ko, oke, oko


@triton.jit
def _pairs(e, o):
    """A block's even and odd halves `[C, BP]` interleaved back into its features in order
    `[C, 2 BP]`: the operand of every product that sums over the block's features, whose
    K = 2 BP then reaches the tensor cores' 16 with blocks of 8 pairs (half the registers of
    each per-block tile)."""
    return tl.reshape(tl.join(e, o), (e.shape[0], 2 * e.shape[1]))


@triton.jit
def _rows(ptr, row, i, ee, m, e, BP: tl.constexpr, ACC: tl.constexpr):
    """Block i's 2 BP feature rows of a state `[rows, m, e]` at ``row``, in order `[2 BP, BE]`
    (the other operand of a ``_pairs`` product)."""
    f = i * (2 * BP) + tl.arange(0, 2 * BP)
    return tl.load((ptr + row * m * e) + f[:, None] * e + ee[None, :], mask=(f[:, None] < m) & (ee[None, :] < e),
                   other=0.0).to(ACC)


@triton.jit
def _wrows(w_ptr, wp_ptr, i, m, d, BP: tl.constexpr, BD: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr,
           XPREC: tl.constexpr):
    """Block i's 2 BP projection rows in order `[2 BP, BD]`, the feature gradients' operands: for
    ``"bf16w3"`` the first two bf16 pieces of w d^(-1/4) (``_exp_weights``), else w in ACC
    (twice); zeros for features in (never read)."""
    f = i * (2 * BP) + tl.arange(0, 2 * BP)
    dd = tl.arange(0, BD)
    off = f[:, None] * d + dd[None, :]
    fm = (f[:, None] < m) & (dd[None, :] < d)
    if FAVOR:
        if XPREC == "bf16w3":
            w1 = tl.load(wp_ptr + off, mask=fm, other=0.0)
            w2 = tl.load(wp_ptr + m * d + off, mask=fm, other=0.0)
        else:
            w1 = tl.load(w_ptr + off, mask=fm, other=0.0).to(ACC)
            w2 = w1
    else:
        w1 = tl.zeros((2 * BP, BD), ACC)
        w2 = w1
    return w1, w2


@triton.jit
def _den_block(fe, fo, ke, ko, z_e, z_o, causal, FAVOR: tl.constexpr, PREC: tl.constexpr):
    """A block's share of den `[C]`: phi(q_t) . (hz + sum_{n <= t} phi(k_n)). FAVOR+: the
    intra-chunk part as the row sums of the causal unrotated scores phi(q) phi(k)^T, in
    tensor-core products (fewer live registers than a scan beside the exponent products); a NaN
    key reaches only the later tokens, as through a cumulative sum. Features in: the scan."""
    if FAVOR:
        D = _mma_nt(tl.zeros((fe.shape[0], ke.shape[0]), fe.dtype), _pairs(fe, fo), _pairs(ke, ko), PREC)
        den = tl.sum(fe * z_e[None, :] + fo * z_o[None, :], axis=1) + tl.sum(tl.where(causal, D, 0.0), axis=1)
    else:
        den = tl.sum(fe * (z_e[None, :] + tl.cumsum(ke, axis=0)) + fo * (z_o[None, :] + tl.cumsum(ko, axis=0)), axis=1)
    return den


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
    causal = tok[:, None] >= tok[None, :]
    A = tl.zeros((C, C), ACC)
    num = tl.zeros((C, BE), ACC)
    den = tl.zeros((C,), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, fe, fo, _, _, ke, ko, _, _ = _block_feats(
            i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR, BP, BD, FAVOR, ACC, XPREC)
        _, _, z_e, z_o = _load_pairs(h_ptr, hz_ptr, bh * NT + ic, p, vale, valo, ee, m, e, True, ACC)
        den += _den_block(fe, fo, ke, ko, z_e, z_o, causal, FAVOR, PREC)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        re, ro = _rotate(fe, fo, cs, sn)
        rke, rko = _rotate(ke, ko, cs, sn)
        rq = _pairs(re, ro)
        A = _mma_nt(A, rq, _pairs(rke, rko), PREC)
        num = _mma(num, rq, _rows(h_ptr, bh * NT + ic, i, ee, m, e, BP, ACC), SPREC)
    vm = real[:, None] & (ee[None, :] < e)
    v = tl.load((v_ptr + bh * N * e) + tok[:, None] * e + ee[None, :], mask=vm, other=0.0)  # input dtype: exact
    A = tl.where(causal, A, 0.0)
    num = _mma(num, A, v, PREC)
    out = num / tl.where(den <= 0.0, 1.0, den)[:, None]
    tl.store((out_ptr + bh * N * e) + tok[:, None] * e + ee[None, :], out, mask=tmask[:, None] & (ee[None, :] < e))
    tl.store((den_ptr + bh * N) + tok, tl.where(den <= 0.0, 0.0, den), mask=tmask)


@triton.jit
def _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC: tl.constexpr, SPREC: tl.constexpr):
    """v `[C, BE]`, dnum `[C, BE]` as (hi, lo) and dden `[C]` of the chunk, 0 at masked tokens.
    For ``SPREC == "bf16x3"`` the wrapper stores dnum as its two bf16 pieces `[2, BH, N, e]`
    (split once, in memory: the products read them from shared memory, not registers); else
    dnum is `[BH, N, e]` in ACC and hi = lo = dnum."""
    vm = real[:, None] & (ee[None, :] < e)
    off = tok[:, None] * e + ee[None, :]  # 32-bit tile offsets from 64-bit scalar bases
    v = tl.load((v_ptr + bh * N * e) + off, mask=vm, other=0.0)  # in the input dtype: an exact operand (``_mma``)
    if SPREC == "bf16x3":
        dnh = tl.load((dnum_ptr + bh * N * e) + off, mask=vm, other=0.0)
        dnl = tl.load((dnum_ptr + (tl.num_programs(1) + bh) * N * e) + off, mask=vm, other=0.0)
    else:
        dnh = tl.load((dnum_ptr + bh * N * e) + off, mask=vm, other=0.0).to(ACC)
        dnl = dnh
    dden = tl.load((dden_ptr + bh * N) + tok, mask=real, other=0.0).to(ACC)
    return v, dnh, dnl, dden


@triton.jit
def _outer(acc, dn, v, V_FIRST: tl.constexpr, PREC: tl.constexpr):
    """acc + dn @ v^T, or acc + v @ dn^T for ``V_FIRST``."""
    if V_FIRST:
        acc = _mma_nt(acc, v, dn, PREC)
    else:
        acc = _mma_nt(acc, dn, v, PREC)
    return acc


@triton.jit
def _dnum_v(dnh, dnl, v, V_FIRST: tl.constexpr, SPREC: tl.constexpr, PREC: tl.constexpr):
    """dnum @ v^T `[C, C]` (``V_FIRST``: v @ dnum^T) from ``_grad_inputs``' pieces of dnum: for
    ``"bf16x3"`` two exact products of bf16 tiles (v is bf16 there), the low piece first."""
    if SPREC == "bf16x3":
        acc = _outer(tl.zeros((v.shape[0], v.shape[0]), tl.float32), dnl, v, V_FIRST, PREC)
    else:
        acc = tl.zeros((v.shape[0], v.shape[0]), dnh.dtype)
    return _outer(acc, dnh, v, V_FIRST, PREC)


@triton.jit
def _dnum_times(acc, dnh, dnl, b, SPREC: tl.constexpr):
    """acc + dnum @ b^T (b `[BP, BE]`, a block of chunk states) from ``_grad_inputs``' pieces."""
    if SPREC == "bf16x3":
        bh = b.to(tl.bfloat16)
        acc = tl.dot(dnh, tl.trans((b - bh.to(tl.float32)).to(tl.bfloat16)), acc)
        acc = tl.dot(dnl, tl.trans(bh), acc)
        acc = tl.dot(dnh, tl.trans(bh), acc)
    else:
        acc = _mma_nt(acc, dnh, b, SPREC)
    return acc


@triton.jit
def _times_dnum(acc, a, dnh, dnl, PREC: tl.constexpr, SPREC: tl.constexpr):
    """acc + a @ dnum from ``_grad_inputs``' pieces of dnum."""
    if SPREC == "bf16x3":
        acc = _mma_bsplit(acc, a, dnh, dnl, "bf16x3")
    else:
        acc = _mma(acc, a, dnh, PREC)
    return acc


@triton.jit
def _feature_grad(dx, dfe, dfo, fe, fo, oke, oko, w1, w2, PREC: tl.constexpr, XPREC: tl.constexpr):
    """FAVOR+: d phi -> d exponent (phi = exp(a): da = dphi * phi, 0 where the gradient does not
    pass) -> dx plus the block's share (through a = w . x', the rows ``_wrows`` loads), and
    sum_j da_j `[C]` (keys: the |x'|^2 / 2 term). ``"bf16w3"``: through the scaled
    projection's first two bf16 pieces (16 bits, as ``"bf16x3"``), so dx is d/dx itself
    (``_grad_scale`` = 1); else through w, dx is d/dx' (``_grad_scale`` = d^(-1/4))."""
    dae = tl.where(oke, dfe * fe, 0.0)
    dao = tl.where(oko, dfo * fo, 0.0)
    da = _pairs(dae, dao)
    if XPREC == "bf16w3":
        ah, al = _split(da, "bf16x3")
        dx = tl.dot(ah, w1, tl.dot(ah, w2, tl.dot(al, w1, dx)))
    else:
        dx = _mma(dx, da, w1, PREC)
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
               dden_ptr, tri_ptr, dq_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
               C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
               FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (c, bh): dq of chunk c, `[BH, N, d]` (FAVOR+) or `[BH, N, m]` (features in)."""
    ic, bh, b, NT, scale, rotary, tok, tmask, real, q_row, k_row, qmax, sqk = _program(
        q_ptr, k_ptr, km_ptr, qmax_ptr, N, H, d, x_dim, FLAGS, C, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    v, dnh, dnl, dden = _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC, SPREC)
    Pm = tl.where(tok[:, None] >= tok[None, :], _dnum_v(dnh, dnl, v, False, SPREC, PREC), 0.0)  # dnum_t . v_n, n <= t
    pmh, pml = _split(Pm, PREC)  # split once, outside the block loop
    L = _tri(tri_ptr, C, False)
    dx = tl.zeros((C, BD), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, fe, fo, oqe, oqo, ke, ko, _, _ = _block_feats(
            i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR, BP, BD, FAVOR, ACC, XPREC)
        h_e, h_o, z_e, z_o = _load_pairs(h_ptr, hz_ptr, bh * NT + ic, p, vale, valo, ee, m, e, True, ACC)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        rke, rko = _rotate(ke, ko, cs, sn)
        dre = _mma_split(_dnum_times(tl.zeros_like(rke), dnh, dnl, h_e, SPREC), pmh, pml, rke, PREC)
        dro = _mma_split(_dnum_times(tl.zeros_like(rko), dnh, dnl, h_o, SPREC), pmh, pml, rko, PREC)
        dre, dro = _rotate(dre, dro, cs, -sn)  # R^T: rotate back
        dfe = dre + dden[:, None] * (z_e[None, :] + _cum(L, ke, PREC))
        dfo = dro + dden[:, None] * (z_o[None, :] + _cum(L, ko, PREC))
        if FAVOR:
            w1, w2 = _wrows(w_ptr, wp_ptr, i, m, d, BP, BD, FAVOR, ACC, XPREC)
            dx, _ = _feature_grad(dx, dfe, dfo, fe, fo, oqe, oqo, w1, w2, PREC, XPREC)
        else:
            _store_columns(dq_ptr, bh, N, m, tok, tmask, p, vale, valo, dfe, dfo, oqe, oqo)
    if FAVOR:
        dd = tl.arange(0, BD)
        tl.store((dq_ptr + bh * N * d) + tok[:, None] * d + dd[None, :], dx * _grad_scale(scale, XPREC),
                 mask=tmask[:, None] & (dd[None, :] < d))


@triton.jit(do_not_specialize=_INTS)
def _dk_kernel(q_ptr, k_ptr, v_ptr, w_ptr, wp_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, dh_ptr, dhz_ptr, dnum_ptr,
               dden_ptr, tri_ptr, dk_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
               C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
               FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (c, bh): dk of chunk c (as dq), given the later chunks' state gradients dh, dhz."""
    ic, bh, b, NT, scale, rotary, tok, tmask, real, q_row, k_row, qmax, sqk = _program(
        q_ptr, k_ptr, km_ptr, qmax_ptr, N, H, d, x_dim, FLAGS, C, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    v, dnh, dnl, dden = _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC, SPREC)
    later = tok[:, None] <= tok[None, :]  # [n, t]: t >= n
    Pt = tl.where(later, _dnum_v(dnh, dnl, v, True, SPREC, PREC), 0.0)  # v_n . dnum_t
    pth, ptl = _split(Pt, PREC)  # split once, outside the block loop
    U = _tri(tri_ptr, C, True)
    dx = tl.zeros((C, BD), ACC)
    dsum = tl.zeros((C,), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, fe, fo, _, _, ke, ko, oke, oko = _block_feats(
            i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR, BP, BD, FAVOR, ACC, XPREC)
        G_e, G_o, Z_e, Z_o = _load_pairs(dh_ptr, dhz_ptr, bh * NT + ic, p, vale, valo, ee, m, e, True, ACC)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        sfe = _cum(U, dden[:, None] * fe, PREC)  # the denominator's suffix sums first: fewer live tiles
        sfo = _cum(U, dden[:, None] * fo, PREC)
        re, ro = _rotate(fe, fo, cs, sn)
        dre = _mma_split(_mma_nt(tl.zeros_like(re), v, G_e, SPREC), pth, ptl, re, PREC)
        dro = _mma_split(_mma_nt(tl.zeros_like(ro), v, G_o, SPREC), pth, ptl, ro, PREC)
        dre, dro = _rotate(dre, dro, cs, -sn)
        dke = dre + Z_e[None, :] + sfe
        dko = dro + Z_o[None, :] + sfo
        if FAVOR:
            w1, w2 = _wrows(w_ptr, wp_ptr, i, m, d, BP, BD, FAVOR, ACC, XPREC)
            dx, si = _feature_grad(dx, dke, dko, ke, ko, oke, oko, w1, w2, PREC, XPREC)
            dsum += si
        else:
            _store_columns(dk_ptr, bh, N, m, tok, tmask, p, vale, valo, dke, dko, oke, oko)
    if FAVOR:
        dd = tl.arange(0, BD)
        xk = _x(k_row, tok, real, d, scale, BD, FAVOR, ACC)
        tl.store((dk_ptr + bh * N * d) + tok[:, None] * d + dd[None, :], dx * _grad_scale(scale, XPREC) - xk * (dsum * scale)[:, None],
                 mask=tmask[:, None] & (dd[None, :] < d))


@triton.jit(do_not_specialize=_INTS)
def _dv_kernel(q_ptr, k_ptr, v_ptr, w_ptr, wp_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, dh_ptr, dhz_ptr, dnum_ptr,
               dden_ptr, dv_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
               C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
               FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (c, bh): dv `[BH, N, e]` of chunk c, given the later chunks' state gradients dh:
    the sum over blocks of R phi(k) dh, plus A^T dnum with A^T (the chunk's rotated scores,
    transposed) summed over the blocks first."""
    ic, bh, b, NT, scale, rotary, tok, tmask, real, q_row, k_row, qmax, sqk = _program(
        q_ptr, k_ptr, km_ptr, qmax_ptr, N, H, d, x_dim, FLAGS, C, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    At = tl.zeros((C, C), ACC)
    dv = tl.zeros((C, BE), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, fe, fo, _, _, ke, ko, _, _ = _block_feats(
            i, w_ptr, wp_ptr, c_ptr, q_row, k_row, tok, real, qmax, sqk, m, d, P, scale, FLOOR, BP, BD, FAVOR, ACC, XPREC)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        re, ro = _rotate(fe, fo, cs, sn)
        rke, rko = _rotate(ke, ko, cs, sn)
        rk = _pairs(rke, rko)
        At = _mma_nt(At, rk, _pairs(re, ro), PREC)
        dv = _mma(dv, rk, _rows(dh_ptr, bh * NT + ic, i, ee, m, e, BP, ACC), SPREC)
    v, dnh, dnl, dden = _grad_inputs(v_ptr, dnum_ptr, dden_ptr, bh, N, e, tok, real, ee, ACC, SPREC)
    dv = _times_dnum(dv, tl.where(tok[:, None] <= tok[None, :], At, 0.0), dnh, dnl, PREC, SPREC)
    tl.store((dv_ptr + bh * N * e) + tok[:, None] * e + ee[None, :], tl.where(real[:, None], dv, 0.0),
             mask=tmask[:, None] & (ee[None, :] < e))
