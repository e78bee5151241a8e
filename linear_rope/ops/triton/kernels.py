"""Causal Eq. 19 (and Eq. 18) as Triton kernels: the query stabiliser and the two sequential
state passes. Their pieces: ``favor.py`` (features, RoPE, loads and stores), ``gemm.py`` (GEMMs
and their precisions). The chunk-parallel output and gradient kernels are in
``chunk_kernels.py``; the wrapper (``chunk.py``) launches them in this order:

forward   ``_qmax_kernel`` -> ``_state_kernel`` -> ``chunk_kernels._out_kernel``
backward  ``_state_grad_kernel`` -> ``chunk_kernels._dq_kernel``, ``_dk_kernel`` and ``_dv_kernel``

Layout `[B, H, N, x]` as everywhere in ``linear_rope.ops``, flattened to `[BH, N, x]`; the maths
is ``naive.py``'s. The sequence is cut into chunks of ``C`` tokens.

* Features come in rotation pairs (2i, 2i+1) and are handled in blocks of ``BP`` pairs (``2 BP``
  features), as even and odd halves `[C, BP]`, so RoPE needs no shuffle. Every kernel
  recomputes the FAVOR+ features it needs from q, k and the projection (nothing of size N x m
  is ever written to memory).
* ``_state_kernel`` (grid: blocks of pairs x blocks of e x BH) walks the chunks in order and
  writes the state *before* each chunk, h `[BH, NT, m, e]` and hz `[BH, NT, m]` (the rotated
  key-value sums and the unrotated key sums), then the final state. It is the only serial part
  of the forward (fla's ``chunk_h`` layout).
* ``_state_grad_kernel`` walks the chunks backwards: dh `[BH, NT, m, e]`, dhz `[BH, NT, m]`,
  the gradient of the state after each chunk from all later chunks (and from the final
  state's gradient), and the initial state's gradient.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .favor import (_block, _chunk, _exp_weights, _feats, _flags, _load_pairs, _load_x, _rotate, _shift, _sq,
                    _store_pairs, _tables, _xin)
from .gemm import _mm, _mma_tn, _scale

_INTS = ["N", "H", "m", "d", "e", "P", "x_dim", "tab_rows", "FLAGS"]  # never specialised: see ``aot.py``


@triton.jit(do_not_specialize=["N", "m", "d", "P"])
def _qmax_kernel(q_ptr, w_ptr, c_ptr, qmax_ptr, N, m, d, P,
                 C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, XPREC: tl.constexpr):
    """qmax[bh, t] = max_j (w_j . q_t' + c_j): the FAVOR+ query stabiliser over all m features
    (it cancels in the ratio; every block must use the same one)."""
    it, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    scale = _scale(d, ACC)
    tok = it * C + tl.arange(0, C)
    tmask = tok < N
    xs = _load_x(q_ptr + bh * N * d, tok, tmask, d, scale, BD, ACC)
    best = tl.full((C,), float("-inf"), ACC)
    for i in range(0, tl.cdiv(P, BP)):
        p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, True, ACC)
        se = tl.where(vale[None, :], _mm(xs, weT, XPREC) + c[None, :], float("-inf"))
        so = tl.where(valo[None, :], _mm(xs, woT, XPREC) + c[None, :], float("-inf"))
        best = tl.maximum(best, tl.maximum(tl.max(se, axis=1), tl.max(so, axis=1)))
    tl.store(qmax_ptr + bh * N + tok, best, mask=tmask)


@triton.jit(do_not_specialize=_INTS)
def _state_kernel(k_ptr, v_ptr, w_ptr, wp_ptr, c_ptr, km_ptr, cos_ptr, sin_ptr, s0_ptr, z0_ptr, h_ptr, hz_ptr, sT_ptr,
                  zT_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
                  C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                  FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (i, j, bh): pairs [i BP, (i+1) BP) and value columns [j BV, (j+1) BV) of row-head
    bh. h[bh, c] = S0 + sum over tokens before chunk c of R phi(k) v^T, hz[bh, c] = z0 + sum
    phi(k); then the final state."""
    i, j, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    b = bh // H
    NT = tl.cdiv(N, C)
    scale = _scale(d, ACC)
    rotary, has_mask, has_state, has_out_state = _flags(FLAGS)
    p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, FAVOR, ACC)
    e1, e2, e3, o1, o2, o3 = _exp_weights(wp_ptr, weT, woT, p, vale, valo, m, d, FAVOR, XPREC)
    vv = j * BV + tl.arange(0, BV)
    S_e, S_o, z_e, z_o = _load_pairs(s0_ptr, z0_ptr, bh, p, vale, valo, vv, m, e, has_state, ACC)
    k_row = k_ptr + bh * N * x_dim
    for ic in range(0, NT):
        _store_pairs(h_ptr, hz_ptr, bh * NT + ic, p, vale, valo, vv, m, e, S_e, S_o, z_e, z_o, True, j == 0)
        tok, tmask, km, real = _chunk(km_ptr + b * N, ic * C, N, has_mask, C, ACC)
        xk = _xin(k_row, tok, real, d, scale, BD, FAVOR, ACC, XPREC)
        ke, ko, _, _ = _feats(k_row, xk, _sq(k_row, tok, real, d, scale, BD, FAVOR, ACC), tok, real, p, vale, valo,
                              e1, e2, e3, o1, o2, o3, c, km, m, FLOOR, True, FAVOR, ACC, XPREC)
        v = tl.load((v_ptr + bh * N * e) + tok[:, None] * e + vv[None, :], mask=real[:, None] & (vv[None, :] < e),
                    other=0.0)  # in the input dtype: exact operands (``_mma``)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        rke, rko = _rotate(ke, ko, cs, sn)
        S_e = _mma_tn(S_e, rke, v, SPREC)
        S_o = _mma_tn(S_o, rko, v, SPREC)
        z_e += tl.sum(ke, axis=0)
        z_o += tl.sum(ko, axis=0)
    _store_pairs(sT_ptr, zT_ptr, bh, p, vale, valo, vv, m, e, S_e, S_o, z_e, z_o, has_out_state, j == 0)


@triton.jit(do_not_specialize=_INTS)
def _state_grad_kernel(q_ptr, w_ptr, wp_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, dnum_ptr, dden_ptr, gS_ptr, gz_ptr,
                       dh_ptr, dhz_ptr, dS0_ptr, dz0_ptr, N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
                       C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                       FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (i, j, bh) as in ``_state_kernel``, walking the chunks backwards. dnum `[BH, N, e]`
    = g / den and dden `[BH, N]` = -g.out / den (0 at masked tokens). dh[bh, c] = gS + sum over
    tokens after chunk c of R phi(q) dnum^T, dhz[bh, c] = gz + sum dden phi(q); at the end the
    initial state's gradient."""
    i, j, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    b = bh // H
    NT = tl.cdiv(N, C)
    scale = _scale(d, ACC)
    rotary, has_mask, has_state, has_out_state = _flags(FLAGS)
    p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, FAVOR, ACC)
    e1, e2, e3, o1, o2, o3 = _exp_weights(wp_ptr, weT, woT, p, vale, valo, m, d, FAVOR, XPREC)
    vv = j * BV + tl.arange(0, BV)
    G_e, G_o, Z_e, Z_o = _load_pairs(gS_ptr, gz_ptr, bh, p, vale, valo, vv, m, e, has_out_state, ACC)
    q_row = q_ptr + bh * N * x_dim
    for jc in range(0, NT):
        ic = NT - 1 - jc
        _store_pairs(dh_ptr, dhz_ptr, bh * NT + ic, p, vale, valo, vv, m, e, G_e, G_o, Z_e, Z_o, True, j == 0)
        tok, tmask, km, real = _chunk(km_ptr + b * N, ic * C, N, has_mask, C, ACC)
        xq = _xin(q_row, tok, real, d, scale, BD, FAVOR, ACC, XPREC)
        qmax = _shift(qmax_ptr + bh * N, tok, tmask, FAVOR, ACC)
        fe, fo, _, _ = _feats(q_row, xq, qmax, tok, real, p, vale, valo, e1, e2, e3, o1, o2, o3, c, qmax, m, FLOOR,
                              False, FAVOR, ACC, XPREC)
        dnum = tl.load((dnum_ptr + bh * N * e) + tok[:, None] * e + vv[None, :], mask=real[:, None] & (vv[None, :] < e),
                       other=0.0)
        dden = tl.load((dden_ptr + bh * N) + tok, mask=real, other=0.0)
        cs, sn = _tables(cos_ptr, sin_ptr, b, tab_rows, tok, tmask, p, pmask, N, P, rotary)
        re, ro = _rotate(fe, fo, cs, sn)
        G_e = _mma_tn(G_e, re, dnum, SPREC)
        G_o = _mma_tn(G_o, ro, dnum, SPREC)
        Z_e += tl.sum(dden[:, None] * fe, axis=0)
        Z_o += tl.sum(dden[:, None] * fo, axis=0)
    _store_pairs(dS0_ptr, dz0_ptr, bh, p, vale, valo, vv, m, e, G_e, G_o, Z_e, Z_o, has_state, j == 0)
