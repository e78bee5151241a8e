"""Causal Eq. 19 (and Eq. 18) as fused Triton kernels: features, RoPE and the running state on chip.

Layout `[B, H, N, x]` as everywhere in ``linear_rope.ops``; the maths is ``naive.py``'s.

Work split. Features come in rotation pairs (2i, 2i+1), and every program owns a block of
``BP`` pairs (``2 BP`` features) of one row-head: the FAVOR+ features of its pairs are computed
from q, k and the projection rows 2i and 2i+1, rotated in registers (even and odd halves kept
apart, so RoPE needs no shuffle), and the state S `[2 BP, e]`, z `[2 BP]` of those features
stays in registers while the program walks the sequence in chunks of ``C`` tokens. Numerator
and denominator are sums over features, so each program writes a partial sum per token and the
wrapper adds the ``nb = ceil(m / 2 BP)`` partials (m = 266: 133 pairs, 5 blocks of 32).

* ``_qmax_kernel``: the FAVOR+ query stabiliser max_j (w_j . q' + c_j) over all m features,
  one float per token (it cancels in the ratio; every block must use the same one).
* ``_fwd_kernel``: num and den partials, the final state.
* ``_bwd_kernel``: a forward sweep for dq (needs the state before each chunk), a reverse sweep
  for dk and dv (needs the suffix sums G = sum rq dnum^T, Z = sum dden phi(q)); G and Z at the
  start are the initial state's gradient. With FAVOR+ dq and dk are partials over blocks too.

Everything inside is float32 (float64 for float64 inputs); bf16 / fp16 inputs are loaded as
they are and upcast on chip. GEMMs: exact fp32 ("ieee") for fp32 inputs, TF32 for bf16 / fp16
inputs (their inputs carry 8-11 bits; TF32 keeps 10), fp64 for fp64.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scale(d, ACC: tl.constexpr):
    """d^(-1/4), formed in ACC (a float argument would arrive as float32, also for float64 runs)."""
    return 1.0 / tl.sqrt(tl.sqrt(tl.full((1,), 0.0, ACC) + d))


@triton.jit
def _favor(x_ptr, w_ptr, c_ptr, tok, tmask, p, pmask, m, d, scale, FLOOR,
           IS_QUERY: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, qmax):
    """FAVOR+ features of the pairs p `[BP]` for the tokens tok `[C]` of one row-head (x_ptr at
    its token 0): (even, odd, x * scale, not-clamped masks). Padded pairs / tokens give 0."""
    dd = tl.arange(0, BD)
    x = tl.load(x_ptr + tok[:, None] * d + dd[None, :], mask=tmask[:, None] & (dd[None, :] < d), other=0.0)
    xs = x.to(ACC) * scale  # (C, BD)
    emask = pmask & (2 * p < m)
    omask = pmask & (2 * p + 1 < m)
    we = tl.load(w_ptr + (2 * p)[:, None] * d + dd[None, :], mask=emask[:, None] & (dd[None, :] < d), other=0.0)
    wo = tl.load(w_ptr + (2 * p + 1)[:, None] * d + dd[None, :], mask=omask[:, None] & (dd[None, :] < d), other=0.0)
    c = tl.load(c_ptr + p, mask=pmask, other=0.0)  # (BP,): the pair's shift, shared by both features
    ae = tl.dot(xs, tl.trans(we.to(ACC)), input_precision=PREC)  # (C, BP)
    ao = tl.dot(xs, tl.trans(wo.to(ACC)), input_precision=PREC)
    if IS_QUERY:
        ae = ae + c[None, :] - qmax[:, None]
        ao = ao + c[None, :] - qmax[:, None]
        oke = emask[None, :] & tmask[:, None]
        oko = omask[None, :] & tmask[:, None]
    else:
        half = 0.5 * tl.sum(xs * xs, axis=1)
        ae = ae - half[:, None] - c[None, :]
        ao = ao - half[:, None] - c[None, :]
        # the gradient passes where floor <= a <= 0, as through torch's clamp in features.py
        oke = (ae >= FLOOR) & (ae <= 0.0)
        oko = (ao >= FLOOR) & (ao <= 0.0)
        ae = tl.minimum(tl.maximum(ae, FLOOR), 0.0)
        ao = tl.minimum(tl.maximum(ao, FLOOR), 0.0)
    fe = tl.where(emask[None, :] & tmask[:, None], tl.exp(ae), 0.0)
    fo = tl.where(omask[None, :] & tmask[:, None], tl.exp(ao), 0.0)
    return fe, fo, xs, oke, oko


@triton.jit
def _features(q_ptr, k_ptr, w_ptr, c_ptr, km_ptr, qmax_ptr, tok, tmask, p, pmask, m, d, scale, FLOOR,
              FAVOR: tl.constexpr, HAS_MASK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
              PREC: tl.constexpr):
    """phi(q), phi(k) of one chunk, even and odd halves `[C, BP]`; masked keys are 0."""
    km = tl.full(tok.shape, 1.0, ACC)
    if HAS_MASK:
        km = tl.load(km_ptr + tok, mask=tmask, other=0).to(ACC)
    if FAVOR:
        qmax = tl.load(qmax_ptr + tok, mask=tmask, other=0.0)
        fe, fo, xq, _, _ = _favor(q_ptr, w_ptr, c_ptr, tok, tmask, p, pmask, m, d, scale, FLOOR, True, BD, ACC,
                                  PREC, qmax)
        ke, ko, xk, oke, oko = _favor(k_ptr, w_ptr, c_ptr, tok, tmask, p, pmask, m, d, scale, FLOOR, False, BD,
                                      ACC, PREC, qmax)
    else:
        emask = tmask[:, None] & (pmask & (2 * p < m))[None, :]
        omask = tmask[:, None] & (pmask & (2 * p + 1 < m))[None, :]
        off_e = tok[:, None] * m + 2 * p[None, :]
        fe = tl.load(q_ptr + off_e, mask=emask, other=0.0).to(ACC)
        fo = tl.load(q_ptr + off_e + 1, mask=omask, other=0.0).to(ACC)
        ke = tl.load(k_ptr + off_e, mask=emask, other=0.0).to(ACC)
        ko = tl.load(k_ptr + off_e + 1, mask=omask, other=0.0).to(ACC)
        xq = fe
        xk = ke
        oke = emask
        oko = omask
    ke = ke * km[:, None]
    ko = ko * km[:, None]
    return fe, fo, ke, ko, xq, xk, oke, oko, km


@triton.jit
def _tables(cos_ptr, sin_ptr, tok, tmask, p, pmask, P):
    cs = tl.load(cos_ptr + tok[:, None] * P + p[None, :], mask=tmask[:, None] & pmask[None, :], other=1.0)
    sn = tl.load(sin_ptr + tok[:, None] * P + p[None, :], mask=tmask[:, None] & pmask[None, :], other=0.0)
    return cs, sn


@triton.jit
def _qmax_kernel(q_ptr, w_ptr, c_ptr, qmax_ptr, N, m, d, P,
                 C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """qmax[bh, t] = max_j (w_j . q_t' + c_j): the FAVOR+ query stabiliser over all m features."""
    it, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    scale = _scale(d, ACC)
    tok = it * C + tl.arange(0, C)
    tmask = tok < N
    dd = tl.arange(0, BD)
    x = tl.load(q_ptr + bh * N * d + tok[:, None] * d + dd[None, :], mask=tmask[:, None] & (dd[None, :] < d),
                other=0.0)
    xs = x.to(ACC) * scale
    best = tl.full((C,), float("-inf"), ACC)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        for odd in tl.static_range(2):
            j = 2 * p + odd
            jm = (p < P) & (j < m)
            w = tl.load(w_ptr + j[:, None] * d + dd[None, :], mask=jm[:, None] & (dd[None, :] < d), other=0.0)
            c = tl.load(c_ptr + p, mask=p < P, other=0.0)
            s = tl.dot(xs, tl.trans(w.to(ACC)), input_precision=PREC) + c[None, :]
            s = tl.where(jm[None, :], s, float("-inf"))
            best = tl.maximum(best, tl.max(s, axis=1))
    tl.store(qmax_ptr + bh * N + tok, best, mask=tmask)


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, s0_ptr, z0_ptr,
                num_ptr, den_ptr, sT_ptr, zT_ptr,
                N, H, m, d, e, P, x_dim, tab_rows, FLOOR,
                C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                FAVOR: tl.constexpr, ROTARY: tl.constexpr, HAS_MASK: tl.constexpr, HAS_STATE: tl.constexpr,
                STORE_STATE: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """Program (i, bh): pairs [i BP, (i+1) BP) of row-head bh over all N tokens.
    num `[nb, BH, N, e]`, den `[nb, BH, N]` partials; final S `[BH, m, e]`, z `[BH, m]`."""
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    scale = _scale(d, ACC)
    BH = tl.num_programs(1)
    b = bh // H
    p = i * BP + tl.arange(0, BP)
    pmask = p < P
    ee = tl.arange(0, BE)
    emask_v = ee < e
    je, jo = 2 * p, 2 * p + 1
    se_mask = (pmask & (je < m))[:, None] & emask_v[None, :]
    so_mask = (pmask & (jo < m))[:, None] & emask_v[None, :]
    if HAS_STATE:
        S_e = tl.load(s0_ptr + bh * m * e + je[:, None] * e + ee[None, :], mask=se_mask, other=0.0).to(ACC)
        S_o = tl.load(s0_ptr + bh * m * e + jo[:, None] * e + ee[None, :], mask=so_mask, other=0.0).to(ACC)
        z_e = tl.load(z0_ptr + bh * m + je, mask=pmask & (je < m), other=0.0).to(ACC)
        z_o = tl.load(z0_ptr + bh * m + jo, mask=pmask & (jo < m), other=0.0).to(ACC)
    else:
        S_e = tl.zeros((BP, BE), ACC)
        S_o = tl.zeros((BP, BE), ACC)
        z_e = tl.zeros((BP,), ACC)
        z_o = tl.zeros((BP,), ACC)
    q_row = q_ptr + bh * N * x_dim
    k_row = k_ptr + bh * N * x_dim
    tab = (b % tab_rows) * N * P
    ar = tl.arange(0, C)
    causal = ar[:, None] >= ar[None, :]
    for t0 in range(0, N, C):
        tok = t0 + ar
        tmask = tok < N
        fe, fo, ke, ko, _, _, _, _, _ = _features(q_row, k_row, w_ptr, c_ptr, km_ptr + b * N, qmax_ptr + bh * N,
                                                  tok, tmask, p, pmask, m, d, scale, FLOOR, FAVOR, HAS_MASK,
                                                  BD, ACC, PREC)
        v = tl.load(v_ptr + bh * N * e + tok[:, None] * e + ee[None, :], mask=tmask[:, None] & emask_v[None, :],
                    other=0.0).to(ACC)
        if ROTARY:
            cs, sn = _tables(cos_ptr + tab, sin_ptr + tab, tok, tmask, p, pmask, P)
            re, ro = fe * cs - fo * sn, fe * sn + fo * cs
            rke, rko = ke * cs - ko * sn, ke * sn + ko * cs
            den = tl.sum(fe * (z_e[None, :] + tl.cumsum(ke, axis=0)) + fo * (z_o[None, :] + tl.cumsum(ko, axis=0)),
                         axis=1)
        else:
            re, ro, rke, rko = fe, fo, ke, ko
        A = tl.dot(re, tl.trans(rke), input_precision=PREC) + tl.dot(ro, tl.trans(rko), input_precision=PREC)
        A = tl.where(causal, A, 0.0)
        if not ROTARY:
            den = tl.sum(A, axis=1) + tl.sum(fe * z_e[None, :] + fo * z_o[None, :], axis=1)
        num = tl.dot(re, S_e, input_precision=PREC) + tl.dot(ro, S_o, input_precision=PREC)
        num += tl.dot(A, v, input_precision=PREC)
        tl.store(num_ptr + ((i * BH + bh) * N + tok[:, None]) * e + ee[None, :], num,
                 mask=tmask[:, None] & emask_v[None, :])
        tl.store(den_ptr + (i * BH + bh) * N + tok, den, mask=tmask)
        S_e += tl.dot(tl.trans(rke), v, input_precision=PREC)
        S_o += tl.dot(tl.trans(rko), v, input_precision=PREC)
        z_e += tl.sum(ke, axis=0)
        z_o += tl.sum(ko, axis=0)
    if STORE_STATE:
        tl.store(sT_ptr + bh * m * e + je[:, None] * e + ee[None, :], S_e, mask=se_mask)
        tl.store(sT_ptr + bh * m * e + jo[:, None] * e + ee[None, :], S_o, mask=so_mask)
        tl.store(zT_ptr + bh * m + je, z_e, mask=pmask & (je < m))
        tl.store(zT_ptr + bh * m + jo, z_o, mask=pmask & (jo < m))


@triton.jit
def _store_feature_grad(ptr, bh, N, tok, tmask, p, pmask, m, d, dfe, dfo, fe, fo, oke, oko, xs, w_ptr, scale,
                        i, BH, FAVOR: tl.constexpr, IS_KEY: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
                        PREC: tl.constexpr):
    """d phi -> d input. Features in: dq / dk columns of these pairs. FAVOR+: phi = exp(a), so
    da = dphi * phi (0 where the key exponent was clamped), then back through a = w . x' (- |x'|^2/2):
    a partial `[C, d]` of block i."""
    if FAVOR:
        dae = tl.where(oke, dfe * fe, 0.0)
        dao = tl.where(oko, dfo * fo, 0.0)
        dd = tl.arange(0, BD)
        we = tl.load(w_ptr + (2 * p)[:, None] * d + dd[None, :], mask=(pmask & (2 * p < m))[:, None] & (dd[None, :] < d),
                     other=0.0).to(ACC)
        wo = tl.load(w_ptr + (2 * p + 1)[:, None] * d + dd[None, :],
                     mask=(pmask & (2 * p + 1 < m))[:, None] & (dd[None, :] < d), other=0.0).to(ACC)
        dx = tl.dot(dae, we, input_precision=PREC) + tl.dot(dao, wo, input_precision=PREC)
        if IS_KEY:
            dx -= xs * tl.sum(dae + dao, axis=1)[:, None]
        tl.store(ptr + ((i * BH + bh) * N + tok[:, None]) * d + dd[None, :], dx * scale,
                 mask=tmask[:, None] & (dd[None, :] < d))
    else:
        off = bh * N * m + tok[:, None] * m + 2 * p[None, :]
        tl.store(ptr + off, dfe, mask=oke)
        tl.store(ptr + off + 1, dfo, mask=oko)


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, s0_ptr, z0_ptr,
                dnum_ptr, dden_ptr, gS_ptr, gz_ptr, dq_ptr, dk_ptr, dv_ptr, dS0_ptr, dz0_ptr,
                N, H, m, d, e, P, x_dim, tab_rows, FLOOR,
                C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                FAVOR: tl.constexpr, ROTARY: tl.constexpr, HAS_MASK: tl.constexpr, HAS_STATE: tl.constexpr,
                HAS_GSTATE: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """Program (i, bh) as in the forward. dnum `[BH, N, e]` = g / den, dden `[BH, N]` = -g.out / den.
    dv `[nb, BH, N, e]` partials; dq, dk partials `[nb, BH, N, d]` (FAVOR+) or `[BH, N, m]`."""
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    scale = _scale(d, ACC)
    BH = tl.num_programs(1)
    b = bh // H
    p = i * BP + tl.arange(0, BP)
    pmask = p < P
    ee = tl.arange(0, BE)
    emask_v = ee < e
    je, jo = 2 * p, 2 * p + 1
    se_mask = (pmask & (je < m))[:, None] & emask_v[None, :]
    so_mask = (pmask & (jo < m))[:, None] & emask_v[None, :]
    q_row = q_ptr + bh * N * x_dim
    k_row = k_ptr + bh * N * x_dim
    tab = (b % tab_rows) * N * P
    ar = tl.arange(0, C)
    causal = ar[:, None] >= ar[None, :]  # [t, n]: n <= t
    # sweep 1, forward: dq needs the state before each chunk
    if HAS_STATE:
        S_e = tl.load(s0_ptr + bh * m * e + je[:, None] * e + ee[None, :], mask=se_mask, other=0.0).to(ACC)
        S_o = tl.load(s0_ptr + bh * m * e + jo[:, None] * e + ee[None, :], mask=so_mask, other=0.0).to(ACC)
        z_e = tl.load(z0_ptr + bh * m + je, mask=pmask & (je < m), other=0.0).to(ACC)
        z_o = tl.load(z0_ptr + bh * m + jo, mask=pmask & (jo < m), other=0.0).to(ACC)
    else:
        S_e = tl.zeros((BP, BE), ACC)
        S_o = tl.zeros((BP, BE), ACC)
        z_e = tl.zeros((BP,), ACC)
        z_o = tl.zeros((BP,), ACC)
    for t0 in range(0, N, C):
        tok = t0 + ar
        tmask = tok < N
        fe, fo, ke, ko, xq, _, _, _, _ = _features(q_row, k_row, w_ptr, c_ptr, km_ptr + b * N, qmax_ptr + bh * N,
                                                   tok, tmask, p, pmask, m, d, scale, FLOOR, FAVOR, HAS_MASK,
                                                   BD, ACC, PREC)
        vm = tmask[:, None] & emask_v[None, :]
        v = tl.load(v_ptr + bh * N * e + tok[:, None] * e + ee[None, :], mask=vm, other=0.0).to(ACC)
        dnum = tl.load(dnum_ptr + bh * N * e + tok[:, None] * e + ee[None, :], mask=vm, other=0.0)
        dden = tl.load(dden_ptr + bh * N + tok, mask=tmask, other=0.0)
        Pm = tl.where(causal, tl.dot(dnum, tl.trans(v), input_precision=PREC), 0.0)  # dnum_t . v_n, n <= t
        dfe = dden[:, None] * (z_e[None, :] + tl.cumsum(ke, axis=0))
        dfo = dden[:, None] * (z_o[None, :] + tl.cumsum(ko, axis=0))
        if ROTARY:
            cs, sn = _tables(cos_ptr + tab, sin_ptr + tab, tok, tmask, p, pmask, P)
            rke, rko = ke * cs - ko * sn, ke * sn + ko * cs
        else:
            rke, rko = ke, ko
        dre = tl.dot(dnum, tl.trans(S_e), input_precision=PREC) + tl.dot(Pm, rke, input_precision=PREC)
        dro = tl.dot(dnum, tl.trans(S_o), input_precision=PREC) + tl.dot(Pm, rko, input_precision=PREC)
        if ROTARY:  # R^T: rotate back by -angle
            dfe += dre * cs + dro * sn
            dfo += dro * cs - dre * sn
        else:
            dfe += dre
            dfo += dro
        qm = tmask[:, None] & pmask[None, :]
        _store_feature_grad(dq_ptr, bh, N, tok, tmask, p, pmask, m, d, dfe, dfo, fe, fo,
                            qm & (2 * p < m)[None, :], qm & (2 * p + 1 < m)[None, :], xq, w_ptr, scale, i, BH,
                            FAVOR, False, BD, ACC, PREC)
        S_e += tl.dot(tl.trans(rke), v, input_precision=PREC)
        S_o += tl.dot(tl.trans(rko), v, input_precision=PREC)
        z_e += tl.sum(ke, axis=0)
        z_o += tl.sum(ko, axis=0)
    # sweep 2, reverse: G = gS + sum_{later} rq dnum^T, Z = gz + sum_{later} dden phi(q)
    if HAS_GSTATE:
        G_e = tl.load(gS_ptr + bh * m * e + je[:, None] * e + ee[None, :], mask=se_mask, other=0.0).to(ACC)
        G_o = tl.load(gS_ptr + bh * m * e + jo[:, None] * e + ee[None, :], mask=so_mask, other=0.0).to(ACC)
        Z_e = tl.load(gz_ptr + bh * m + je, mask=pmask & (je < m), other=0.0).to(ACC)
        Z_o = tl.load(gz_ptr + bh * m + jo, mask=pmask & (jo < m), other=0.0).to(ACC)
    else:
        G_e = tl.zeros((BP, BE), ACC)
        G_o = tl.zeros((BP, BE), ACC)
        Z_e = tl.zeros((BP,), ACC)
        Z_o = tl.zeros((BP,), ACC)
    later = ar[:, None] <= ar[None, :]  # [n, t]: t >= n
    n_chunks = tl.cdiv(N, C)
    for jc in range(0, n_chunks):
        t0 = (n_chunks - 1 - jc) * C
        tok = t0 + ar
        tmask = tok < N
        fe, fo, ke, ko, _, xk, oke, oko, km = _features(q_row, k_row, w_ptr, c_ptr, km_ptr + b * N,
                                                        qmax_ptr + bh * N, tok, tmask, p, pmask, m, d, scale,
                                                        FLOOR, FAVOR, HAS_MASK, BD, ACC, PREC)
        vm = tmask[:, None] & emask_v[None, :]
        v = tl.load(v_ptr + bh * N * e + tok[:, None] * e + ee[None, :], mask=vm, other=0.0).to(ACC)
        dnum = tl.load(dnum_ptr + bh * N * e + tok[:, None] * e + ee[None, :], mask=vm, other=0.0)
        dden = tl.load(dden_ptr + bh * N + tok, mask=tmask, other=0.0)
        if ROTARY:
            cs, sn = _tables(cos_ptr + tab, sin_ptr + tab, tok, tmask, p, pmask, P)
            re, ro = fe * cs - fo * sn, fe * sn + fo * cs
            rke, rko = ke * cs - ko * sn, ke * sn + ko * cs
        else:
            re, ro, rke, rko = fe, fo, ke, ko
        Pt = tl.where(later, tl.dot(v, tl.trans(dnum), input_precision=PREC), 0.0)  # v_n . dnum_t, t >= n
        At = tl.dot(rke, tl.trans(re), input_precision=PREC) + tl.dot(rko, tl.trans(ro), input_precision=PREC)
        At = tl.where(later, At, 0.0)
        dv = tl.dot(rke, G_e, input_precision=PREC) + tl.dot(rko, G_o, input_precision=PREC)
        dv += tl.dot(At, dnum, input_precision=PREC)
        tl.store(dv_ptr + ((i * BH + bh) * N + tok[:, None]) * e + ee[None, :], dv, mask=vm)
        dre = tl.dot(v, tl.trans(G_e), input_precision=PREC) + tl.dot(Pt, re, input_precision=PREC)
        dro = tl.dot(v, tl.trans(G_o), input_precision=PREC) + tl.dot(Pt, ro, input_precision=PREC)
        qe = dden[:, None] * fe
        qo = dden[:, None] * fo
        dke = Z_e[None, :] + tl.cumsum(qe, axis=0, reverse=True)
        dko = Z_o[None, :] + tl.cumsum(qo, axis=0, reverse=True)
        if ROTARY:
            dke += dre * cs + dro * sn
            dko += dro * cs - dre * sn
        else:
            dke += dre
            dko += dro
        dke = dke * km[:, None]
        dko = dko * km[:, None]
        _store_feature_grad(dk_ptr, bh, N, tok, tmask, p, pmask, m, d, dke, dko, ke, ko, oke, oko, xk, w_ptr,
                            scale, i, BH, FAVOR, True, BD, ACC, PREC)
        G_e += tl.dot(tl.trans(re), dnum, input_precision=PREC)
        G_o += tl.dot(tl.trans(ro), dnum, input_precision=PREC)
        Z_e += tl.sum(qe, axis=0)
        Z_o += tl.sum(qo, axis=0)
    if HAS_STATE:
        tl.store(dS0_ptr + bh * m * e + je[:, None] * e + ee[None, :], G_e, mask=se_mask)
        tl.store(dS0_ptr + bh * m * e + jo[:, None] * e + ee[None, :], G_o, mask=so_mask)
        tl.store(dz0_ptr + bh * m + je, Z_e, mask=pmask & (je < m))
        tl.store(dz0_ptr + bh * m + jo, Z_o, mask=pmask & (jo < m))
