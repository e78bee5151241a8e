"""The backward kernels of the fused path: the upstream gradient's denominator part (``_dden``),
the states' gradients after every chunk (``_dstates``: a reverse walk over chunks), then the
gradients of q, k, v of all chunks at once (``_dqkv``). Features are recomputed from q, k and
the projection (the query row max read back from the forward, as flash attention's backward
reads its log-sum-exp); none was saved. The projection gets no gradient, and the query row max
is a constant (the output does not depend on it).

With dnum = dout / den and dden = -(dout . out) / den per query (0 where den <= 0 and for masked
queries), per chunk: ``dA = tril(dnum v^T)``, ``dD = tril(dden 1^T)`` (never formed: its products
are prefix and suffix sums over the chunk's rows),

* ``dv = tril(A)^T dnum + Rk dS_after``
* ``d(Rq) = dA Rk + dnum Sb^T``, ``d(Rk) = dA^T Rq + v dS_after^T``
* ``d(phi_q) = dD phi_k + dden zb`` + R^T d(Rq), ``d(phi_k) = dD^T phi_q + dz_after`` + R^T d(Rk)
* the exponents' gradients ``phi * d(phi)`` (keys: 0 where clamped), then ``dq = daq w16``,
  ``dk = dak w16 - k sum(dak) / sqrt(d)``.

Buffers: dden `[B H, N]` float32; dSa `[B H, nc, m, e]` (bf16 under LOWP, else float32) and dza
`[B H, nc, m]` float32: the gradients of the state after each chunk (the final state's gradient
included); dS0 `[B H, m, e]`, dz0 `[B H, m]` float32: the initial state's.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, _state_block, _k_feats, _op, _q_feats, _rot, _rot_t, _rows, _tables


@triton.jit(do_not_specialize=["N"])
def _dden(do, out, den, mask, dden, s_mb, N, H, e, C: tl.constexpr, BE: tl.constexpr, MASK: tl.constexpr):
    """Grid (cdiv(N, C), B H): dden = -(dout . out) / den per query (dout, out `[B H, N, e]`)."""
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * C + tl.arange(0, C).to(tl.int64)
    tm = t < N
    acc = tl.zeros([C], dtype=tl.float32)
    for e0 in range(0, e, BE):
        ce = e0 + tl.arange(0, BE)
        em = ce < e
        acc += tl.sum(_rows(do + bh * N * e, t, tm, e, ce, em) * _rows(out + bh * N * e, t, tm, e, ce, em), 1)
    dn = tl.load(den + bh * N + t, mask=tm, other=1.0)
    ok = dn > 0.0
    if MASK:
        ok = ok & (tl.load(mask + (bh // H) * s_mb + t, mask=tm, other=0) != 0)
    tl.store(dden + bh * N + t, tl.where(ok, -acc / tl.where(ok, dn, 1.0), 0.0), mask=tm)


@triton.jit
def _dnum(do, den, mask, bh, b, t, tm, ce, em, s_mb, N, e, MASK: tl.constexpr):
    """dout / den `[C, BE]` float32 (0 where den <= 0, for masked queries and past N)."""
    dn = tl.load(den + bh * N + t, mask=tm, other=1.0)
    ok = tm & (dn > 0.0)
    if MASK:
        ok = ok & (tl.load(mask + b * s_mb + t, mask=tm, other=0) != 0)
    g = _rows(do + bh * N * e, t, tm, e, ce, em) / tl.where(ok, dn, 1.0)[:, None]
    return tl.where(ok[:, None], g, 0.0)


@triton.jit(do_not_specialize=["N", "nc"])
def _dstates(q, wa, wb, c, cos, sin, mask, do, den, rmax, dden, dSn, dzn, dSa, dza, dS0, dz0,
             s_qb, s_qh, s_qn, s_tb, s_tn, s_tp, s_mb, N, H, nc, m, d, e,
             C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, ROTARY: tl.constexpr,
             LOWP: tl.constexpr, MASK: tl.constexpr, FINAL_S: tl.constexpr, FINAL_Z: tl.constexpr):
    """Grid (B H, cdiv(m, BM), cdiv(e, BE)): a reverse walk over the chunks with dS `[BM, BE]` and
    dz `[BM]` in float32 registers, from the final state's gradient; stores the gradient of the
    state after each chunk, then the initial state's. ``dS += Rq^T dnum``, ``dz += phi_q^T dden``."""
    bh = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BM
    eb = tl.program_id(2)
    b, h = bh // H, bh % H
    q += b * s_qb + h * s_qh
    cos += b * s_tb
    sin += b * s_tb
    lanes, je, jo, me, mo, ce, em, cols, cm, se, so, mse, mso = _state_block(j0, eb, m, d, e, BM, BD, BE)
    dS_e = tl.zeros([BM // 2, BE], dtype=tl.float32)
    dS_o = tl.zeros([BM // 2, BE], dtype=tl.float32)
    dz_e = tl.zeros([BM // 2], dtype=tl.float32)
    dz_o = tl.zeros([BM // 2], dtype=tl.float32)
    if FINAL_S:
        dS_e += tl.load(dSn + bh * m * e + se, mask=mse, other=0.0).to(tl.float32)
        dS_o += tl.load(dSn + bh * m * e + so, mask=mso, other=0.0).to(tl.float32)
    if FINAL_Z:
        dz_e += tl.load(dzn + bh * m + je, mask=me, other=0.0).to(tl.float32)
        dz_o += tl.load(dzn + bh * m + jo, mask=mo, other=0.0).to(tl.float32)
    for r in range(nc):
        ci = nc - 1 - r
        at = bh * nc + ci
        tl.store(dSa + at * m * e + se, dS_e.to(dSa.dtype.element_ty), mask=mse)
        tl.store(dSa + at * m * e + so, dS_o.to(dSa.dtype.element_ty), mask=mso)
        if eb == 0:
            tl.store(dza + at * m + je, dz_e, mask=me)
            tl.store(dza + at * m + jo, dz_o, mask=mo)
        t = ci * C + tl.arange(0, C).to(tl.int64)
        tm = t < N
        real = tm
        if MASK:
            real = tm & (tl.load(mask + b * s_mb + t, mask=tm, other=0) != 0)
        qt = _op(tl.where(real[:, None], _rows(q, t, tm, s_qn, cols, cm), 0.0), LOWP)
        rmx = tl.load(rmax + bh * N + t, mask=tm, other=0.0)
        fe, fo = _q_feats(qt, rmx, wa, wb, c, j0, m, d, lanes, cols, cm, LOWP)
        re, ro = fe, fo
        if ROTARY:
            cs, sn = _tables(cos, sin, t, tm, s_tn, s_tp, j0, m, lanes)
            re, ro = _rot(fe, fo, cs, sn)
        g = _op(_dnum(do, den, mask, bh, b, t, tm, ce, em, s_mb, N, e, MASK), LOWP)
        dS_e += _dot(tl.trans(_op(re, LOWP)), g, LOWP)
        dS_o += _dot(tl.trans(_op(ro, LOWP)), g, LOWP)
        dd = tl.load(dden + bh * N + t, mask=tm, other=0.0)
        dz_e += tl.sum(_op(fe, LOWP).to(tl.float32) * dd[:, None], 0)
        dz_o += tl.sum(_op(fo, LOWP).to(tl.float32) * dd[:, None], 0)
    tl.store(dS0 + bh * m * e + se, dS_e, mask=mse)
    tl.store(dS0 + bh * m * e + so, dS_o, mask=mso)
    if eb == 0:
        tl.store(dz0 + bh * m + je, dz_e, mask=me)
        tl.store(dz0 + bh * m + jo, dz_o, mask=mo)


@triton.jit(do_not_specialize=["N", "nc"])
def _dqkv(q, k, v, wa, wb, c, cos, sin, mask, do, den, rmax, dden, Sb, zb, dSa, dza, dq, dk, dv,
          s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_tb, s_tn, s_tp, s_mb,
          N, H, nc, m, d, e, ksc,
          FLOOR: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
          BV: tl.constexpr, BU: tl.constexpr, BO: tl.constexpr, ROTARY: tl.constexpr, LOWP: tl.constexpr, MASK: tl.constexpr,
          PART: tl.constexpr):
    """Grid (nc, B H, cdiv(d, BO)), launched three times: one chunk's dq `[C, d]` (``PART`` 0:
    from the states before the chunk, Sb and zb) or its dk `[C, d]` (1), BO columns a program,
    e in value blocks of BV (one where BE = BV: g and v held; else read again), or its dv
    `[C, e]` (2: grid (nc, B H, cdiv(e, BU)), a value block of BU a program; from the gradients
    of the states after it, dSa, and dza for dk), accumulated over
    the feature blocks from the recomputed features; stored in the inputs' dtype `[B, H, N, x]`
    contiguous (0 for masked tokens). Three kernels, each recomputing the features, rather than
    one holding every accumulator: built for sm_90 (4 warps) dk and dv in one spilled 1 KB a
    thread, all three 2 KB. dv reads neither v nor dden nor dza."""
    ci = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    q += b * s_qb + h * s_qh
    k += b * s_kb + h * s_kh
    v += b * s_vb + h * s_vh
    cos += b * s_tb
    sin += b * s_tb
    lanes = tl.arange(0, BM // 2)
    if PART == 2:
        ce = tl.program_id(2) * BU + tl.arange(0, BU)
        gv = tl.zeros([C, BU], dtype=tl.float32)
    else:
        ce = tl.arange(0, BE)
    em = ce < e
    cols = tl.arange(0, BD)
    cm = cols < d
    if BO == BD:  # dq, dk: the columns of this program
        ocols, om = cols, cm
    else:
        ocols = tl.program_id(2) * BO + tl.arange(0, BO)
        om = ocols < d
    i = tl.arange(0, C)
    t = ci * C + i.to(tl.int64)
    tm = t < N
    real = tm
    if MASK:
        real = tm & (tl.load(mask + b * s_mb + t, mask=tm, other=0) != 0)
    qt = _op(tl.where(real[:, None], _rows(q, t, tm, s_qn, cols, cm), 0.0), LOWP)
    kt = _op(tl.where(real[:, None], _rows(k, t, tm, s_kn, cols, cm), 0.0), LOWP)
    ksq = ksc * tl.sum(kt.to(tl.float32) * kt.to(tl.float32), 1)
    rmx = tl.load(rmax + bh * N + t, mask=tm, other=0.0)
    causal = i[:, None] >= i[None, :]
    if PART == 2 or BE == BV:
        g = _op(_dnum(do, den, mask, bh, b, t, tm, ce, em, s_mb, N, e, MASK), LOWP)
    if PART != 2:
        if BE == BV:
            vt = _op(tl.where(real[:, None], _rows(v, t, tm, s_vn, ce, em), 0.0), LOWP)
            dA = _op(tl.where(causal, _dot(g, tl.trans(vt), LOWP), 0.0), LOWP)
        else:  # e over value blocks of BV: dA accumulated, g and v read again where needed
            dA = tl.zeros([C, C], dtype=tl.float32)
            for v0 in range(0, BE, BV):
                cv = v0 + tl.arange(0, BV)
                vm = cv < e
                gb = _op(_dnum(do, den, mask, bh, b, t, tm, cv, vm, s_mb, N, e, MASK), LOWP)
                vb = _op(tl.where(real[:, None], _rows(v, t, tm, s_vn, cv, vm), 0.0), LOWP)
                dA += _dot(gb, tl.trans(vb), LOWP)
            dA = _op(tl.where(causal, dA, 0.0), LOWP)
        dd = tl.load(dden + bh * N + t, mask=tm, other=0.0)
        dd16 = _op(dd, LOWP).to(tl.float32)  # the GEMM operand of tril(dden 1^T), as the parallel path rounds it
    A = tl.zeros([C, C], dtype=tl.float32)
    gx = tl.zeros([C, BO], dtype=tl.float32)  # dq or dk: its columns ocols
    gks = tl.zeros([C], dtype=tl.float32)
    at = bh * nc + ci
    for j0 in range(0, m, BM):
        je = j0 + 2 * lanes
        jo = je + 1
        me, mo = je < m, jo < m
        mse, mso = me[:, None] & em[None, :], mo[:, None] & em[None, :]
        fqe, fqo = _q_feats(qt, rmx, wa, wb, c, j0, m, d, lanes, cols, cm, LOWP)
        fke, fko, ine, ino = _k_feats(kt, ksq, real, wa, wb, c, j0, m, d, lanes, cols, cm, FLOOR, LOWP)
        rke, rko = fke, fko
        if ROTARY:
            cs, sn = _tables(cos, sin, t, tm, s_tn, s_tp, j0, m, lanes)
            rke, rko = _rot(fke, fko, cs, sn)
        rke, rko = _op(rke, LOWP), _op(rko, LOWP)
        if PART == 0:
            # R phi_q's gradient, back through R (its transpose); then the unrotated denominator's:
            # tril(dden 1^T) phi_k as a prefix sum over the chunk's rows (no [C, C] GEMM)
            if BE == BV:
                Sbe = tl.load(Sb + at * m * e + je[:, None] * e + ce[None, :], mask=mse, other=0.0)
                Sbo = tl.load(Sb + at * m * e + jo[:, None] * e + ce[None, :], mask=mso, other=0.0)
                gqe = _dot(dA, rke, LOWP) + _dot(g, tl.trans(Sbe), LOWP)
                gqo = _dot(dA, rko, LOWP) + _dot(g, tl.trans(Sbo), LOWP)
            else:
                gqe = _dot(dA, rke, LOWP)
                gqo = _dot(dA, rko, LOWP)
                for v0 in range(0, BE, BV):
                    cv = v0 + tl.arange(0, BV)
                    vm = cv < e
                    gb = _op(_dnum(do, den, mask, bh, b, t, tm, cv, vm, s_mb, N, e, MASK), LOWP)
                    Sbe = tl.load(Sb + at * m * e + je[:, None] * e + cv[None, :], mask=me[:, None] & vm[None, :], other=0.0)
                    Sbo = tl.load(Sb + at * m * e + jo[:, None] * e + cv[None, :], mask=mo[:, None] & vm[None, :], other=0.0)
                    gqe += _dot(gb, tl.trans(Sbe), LOWP)
                    gqo += _dot(gb, tl.trans(Sbo), LOWP)
            if ROTARY:
                gqe, gqo = _rot_t(gqe, gqo, cs, sn)
            zbe = tl.load(zb + at * m + je, mask=me, other=0.0)
            zbo = tl.load(zb + at * m + jo, mask=mo, other=0.0)
            gqe += dd16[:, None] * tl.cumsum(_op(fke, LOWP).to(tl.float32), 0) + dd[:, None] * zbe[None, :]
            gqo += dd16[:, None] * tl.cumsum(_op(fko, LOWP).to(tl.float32), 0) + dd[:, None] * zbo[None, :]
            # the exponents' gradients, then the projection's rows (its bf16 value part)
            wae = tl.load(wa + je[:, None] * d + ocols[None, :], mask=me[:, None] & om[None, :], other=0.0)
            wao = tl.load(wa + jo[:, None] * d + ocols[None, :], mask=mo[:, None] & om[None, :], other=0.0)
            gx += _dot(_op(gqe * fqe, LOWP), wae, LOWP) + _dot(_op(gqo * fqo, LOWP), wao, LOWP)
        else:
            rqe, rqo = fqe, fqo
            if ROTARY:
                rqe, rqo = _rot(fqe, fqo, cs, sn)
            rqe, rqo = _op(rqe, LOWP), _op(rqo, LOWP)
            if PART == 2:
                dSe = tl.load(dSa + at * m * e + je[:, None] * e + ce[None, :], mask=mse, other=0.0)
                dSo = tl.load(dSa + at * m * e + jo[:, None] * e + ce[None, :], mask=mso, other=0.0)
                A += _dot(rqe, tl.trans(rke), LOWP) + _dot(rqo, tl.trans(rko), LOWP)
                gv += _dot(rke, dSe, LOWP) + _dot(rko, dSo, LOWP)
            else:
                if BE == BV:
                    dSe = tl.load(dSa + at * m * e + je[:, None] * e + ce[None, :], mask=mse, other=0.0)
                    dSo = tl.load(dSa + at * m * e + jo[:, None] * e + ce[None, :], mask=mso, other=0.0)
                    gke = _dot(tl.trans(dA), rqe, LOWP) + _dot(vt, tl.trans(dSe), LOWP)
                    gko = _dot(tl.trans(dA), rqo, LOWP) + _dot(vt, tl.trans(dSo), LOWP)
                else:
                    gke = _dot(tl.trans(dA), rqe, LOWP)
                    gko = _dot(tl.trans(dA), rqo, LOWP)
                    for v0 in range(0, BE, BV):
                        cv = v0 + tl.arange(0, BV)
                        vm = cv < e
                        vb = _op(tl.where(real[:, None], _rows(v, t, tm, s_vn, cv, vm), 0.0), LOWP)
                        dSe = tl.load(dSa + at * m * e + je[:, None] * e + cv[None, :], mask=me[:, None] & vm[None, :], other=0.0)
                        dSo = tl.load(dSa + at * m * e + jo[:, None] * e + cv[None, :], mask=mo[:, None] & vm[None, :], other=0.0)
                        gke += _dot(vb, tl.trans(dSe), LOWP)
                        gko += _dot(vb, tl.trans(dSo), LOWP)
                if ROTARY:
                    gke, gko = _rot_t(gke, gko, cs, sn)
                # the denominator's: tril(dden 1^T)^T phi_q as a suffix sum over the chunk's rows
                dze = tl.load(dza + at * m + je, mask=me, other=0.0)
                dzo = tl.load(dza + at * m + jo, mask=mo, other=0.0)
                gke += tl.cumsum(dd16[:, None] * _op(fqe, LOWP).to(tl.float32), 0, reverse=True) + dze[None, :]
                gko += tl.cumsum(dd16[:, None] * _op(fqo, LOWP).to(tl.float32), 0, reverse=True) + dzo[None, :]
                ake = tl.where(ine, gke * fke, 0.0)  # 0 where the exponent was clamped
                ako = tl.where(ino, gko * fko, 0.0)
                wae = tl.load(wa + je[:, None] * d + ocols[None, :], mask=me[:, None] & om[None, :], other=0.0)
                wao = tl.load(wa + jo[:, None] * d + ocols[None, :], mask=mo[:, None] & om[None, :], other=0.0)
                gx += _dot(_op(ake, LOWP), wae, LOWP) + _dot(_op(ako, LOWP), wao, LOWP)
                gks += tl.sum(ake, 1) + tl.sum(ako, 1)
    keep = real[:, None]
    od = bh * N * d + t[:, None] * d + ocols[None, :]
    if PART == 0:
        tl.store(dq + od, tl.where(keep, gx, 0.0).to(dq.dtype.element_ty), mask=tm[:, None] & om[None, :])
    elif PART == 1:
        if BO == BD:
            ko = kt
        else:
            ko = _op(tl.where(real[:, None], _rows(k, t, tm, s_kn, ocols, om), 0.0), LOWP)
        gx -= (2.0 * ksc) * ko.to(tl.float32) * gks[:, None]
        tl.store(dk + od, tl.where(keep, gx, 0.0).to(dk.dtype.element_ty), mask=tm[:, None] & om[None, :])
    else:
        gv += _dot(tl.trans(_op(tl.where(causal, A, 0.0), LOWP)), g, LOWP)
        tl.store(dv + bh * N * e + t[:, None] * e + ce[None, :], tl.where(keep, gv, 0.0).to(dv.dtype.element_ty),
                 mask=tm[:, None] & em[None, :])
