"""The forward kernels of the fused path: the states before every chunk (``_states``), then the
outputs of all chunks at once (``_output``). FAVOR+ features are made on chip from the q and k
tiles and the projection in both; no feature tensor is written. fla's chunk design
(``fla/ops/common/chunk_h.py``, ``chunk_o.py``) with the feature map inside, as fla's
``based/fused_chunk.py`` and ThunderKittens' ``hedgehog`` make theirs.

Layouts: q, k `[B, H, N, d]` and v `[B, H, N, e]` in the layer's dtype and strides (unit last
stride), the projection operands `[m, d]` contiguous, the pair shifts c `[m]` float32, the RoPE
tables cos, sin `[N, m / 2]` or `[B, N, m / 2]` float32 (batch stride 0 when shared), mask
`[B, N]` int8 (1 = real token; ``MASK``), the states S `[B H, m, e]` and z `[B H, m]` float32, the
per-chunk states before each chunk Sb `[B H, nc, m, e]` (bf16 under LOWP, else float32) and zb
`[B H, nc, m]` float32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _dot, _state_block, _k_feats, _op, _q_exps, _q_feats, _rot, _rows, _tables


@triton.jit(do_not_specialize=["N", "nc"])
def _states(k, v, wa, wb, c, cos, sin, mask, S0, z0, Sb, zb, Sn, zn,
            s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_tb, s_tn, s_tp, s_mb,
            N, H, nc, m, d, e, ksc,
            FLOOR: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
            ROTARY: tl.constexpr, LOWP: tl.constexpr, MASK: tl.constexpr, INIT: tl.constexpr):
    """Grid (B H, cdiv(m, BM), cdiv(e, BE)): a serial walk over the chunks with the state block
    `[BM, BE]` (two halves) and its key sum `[BM]` in float32 registers; stores the state before
    each chunk, then the final one."""
    bh = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BM
    eb = tl.program_id(2)
    b, h = bh // H, bh % H
    k += b * s_kb + h * s_kh
    v += b * s_vb + h * s_vh
    cos += b * s_tb
    sin += b * s_tb
    lanes, je, jo, me, mo, ce, em, cols, cm, se, so, mse, mso = _state_block(j0, eb, m, d, e, BM, BD, BE)
    if INIT:
        S_e = tl.load(S0 + bh * m * e + se, mask=mse, other=0.0).to(tl.float32)
        S_o = tl.load(S0 + bh * m * e + so, mask=mso, other=0.0).to(tl.float32)
        z_e = tl.load(z0 + bh * m + je, mask=me, other=0.0).to(tl.float32)
        z_o = tl.load(z0 + bh * m + jo, mask=mo, other=0.0).to(tl.float32)
    else:
        S_e = tl.zeros([BM // 2, BE], dtype=tl.float32)
        S_o = tl.zeros([BM // 2, BE], dtype=tl.float32)
        z_e = tl.zeros([BM // 2], dtype=tl.float32)
        z_o = tl.zeros([BM // 2], dtype=tl.float32)
    for ci in range(nc):
        at = bh * nc + ci
        tl.store(Sb + at * m * e + se, S_e.to(Sb.dtype.element_ty), mask=mse)
        tl.store(Sb + at * m * e + so, S_o.to(Sb.dtype.element_ty), mask=mso)
        if eb == 0:
            tl.store(zb + at * m + je, z_e, mask=me)
            tl.store(zb + at * m + jo, z_o, mask=mo)
        t = ci * C + tl.arange(0, C).to(tl.int64)
        tm = t < N
        real = tm
        if MASK:
            real = tm & (tl.load(mask + b * s_mb + t, mask=tm, other=0) != 0)
        kt = _op(tl.where(real[:, None], _rows(k, t, tm, s_kn, cols, cm), 0.0), LOWP)
        k32 = kt.to(tl.float32)
        ksq = ksc * tl.sum(k32 * k32, 1)
        fe, fo, _, _ = _k_feats(kt, ksq, real, wa, wb, c, j0, m, d, lanes, cols, cm, FLOOR, LOWP)
        re, ro = fe, fo
        if ROTARY:
            cs, sn = _tables(cos, sin, t, tm, s_tn, s_tp, j0, m, lanes)
            re, ro = _rot(fe, fo, cs, sn)
        vt = _op(tl.where(real[:, None], _rows(v, t, tm, s_vn, ce, em), 0.0), LOWP)
        S_e += _dot(tl.trans(_op(re, LOWP)), vt, LOWP)
        S_o += _dot(tl.trans(_op(ro, LOWP)), vt, LOWP)
        z_e += tl.sum(_op(fe, LOWP).to(tl.float32), 0)
        z_o += tl.sum(_op(fo, LOWP).to(tl.float32), 0)
    tl.store(Sn + bh * m * e + se, S_e, mask=mse)
    tl.store(Sn + bh * m * e + so, S_o, mask=mso)
    if eb == 0:
        tl.store(zn + bh * m + je, z_e, mask=me)
        tl.store(zn + bh * m + jo, z_o, mask=mo)


@triton.jit(do_not_specialize=["N", "nc"])
def _output(q, k, v, wa, wb, c, cos, sin, mask, Sb, zb, out, den, rmax,
            s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_tb, s_tn, s_tp, s_mb,
            N, H, nc, m, d, e, ksc,
            FLOOR: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
            ROTARY: tl.constexpr, LOWP: tl.constexpr, MASK: tl.constexpr):
    """Grid (nc, B H, cdiv(e, BE)): one chunk's outputs. Pass 1: the query row max over all m
    features; pass 2, per feature block: phi(q), R phi(q), and the chunk's phi(k), R phi(k)
    again; ``num += Rq Sb``, ``A += Rq Rk^T``, ``den += phi_q . (zb + cumsum(phi_k))`` (the row
    sums of ``tril(phi_q phi_k^T)`` without the `[C, C]` product). Then ``out = (num + tril(A) v)
    / den`` (<= 0 divides by 1). Stores out `[B H,
    N, e]` and, once per row, the denominator and row max `[B H, N]` float32 for the backward."""
    ci = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    eb = tl.program_id(2)
    b, h = bh // H, bh % H
    q += b * s_qb + h * s_qh
    k += b * s_kb + h * s_kh
    v += b * s_vb + h * s_vh
    cos += b * s_tb
    sin += b * s_tb
    lanes = tl.arange(0, BM // 2)
    ce = eb * BE + tl.arange(0, BE)
    em = ce < e
    cols = tl.arange(0, BD)
    cm = cols < d
    i = tl.arange(0, C)
    t = ci * C + i.to(tl.int64)
    tm = t < N
    real = tm
    if MASK:
        real = tm & (tl.load(mask + b * s_mb + t, mask=tm, other=0) != 0)
    qt = _op(tl.where(real[:, None], _rows(q, t, tm, s_qn, cols, cm), 0.0), LOWP)
    kt = _op(tl.where(real[:, None], _rows(k, t, tm, s_kn, cols, cm), 0.0), LOWP)
    k32 = kt.to(tl.float32)
    ksq = ksc * tl.sum(k32 * k32, 1)
    vt = _op(tl.where(real[:, None], _rows(v, t, tm, s_vn, ce, em), 0.0), LOWP)
    rmx = tl.full([C], float("-inf"), dtype=tl.float32)
    for j0 in range(0, m, BM):
        ae, ao = _q_exps(qt, wa, wb, c, j0, m, d, lanes, cols, cm, LOWP)
        rmx = tl.maximum(rmx, tl.maximum(tl.max(ae, 1), tl.max(ao, 1)))
    num = tl.zeros([C, BE], dtype=tl.float32)
    A = tl.zeros([C, C], dtype=tl.float32)
    dn = tl.zeros([C], dtype=tl.float32)
    at = bh * nc + ci
    for j0 in range(0, m, BM):
        je = j0 + 2 * lanes
        jo = je + 1
        me, mo = je < m, jo < m
        fqe, fqo = _q_feats(qt, rmx, wa, wb, c, j0, m, d, lanes, cols, cm, LOWP)
        fke, fko, _, _ = _k_feats(kt, ksq, real, wa, wb, c, j0, m, d, lanes, cols, cm, FLOOR, LOWP)
        rqe, rqo, rke, rko = fqe, fqo, fke, fko
        if ROTARY:
            cs, sn = _tables(cos, sin, t, tm, s_tn, s_tp, j0, m, lanes)
            rqe, rqo = _rot(fqe, fqo, cs, sn)
            rke, rko = _rot(fke, fko, cs, sn)
        rqe, rqo = _op(rqe, LOWP), _op(rqo, LOWP)
        Sbe = tl.load(Sb + at * m * e + je[:, None] * e + ce[None, :], mask=me[:, None] & em[None, :], other=0.0)
        Sbo = tl.load(Sb + at * m * e + jo[:, None] * e + ce[None, :], mask=mo[:, None] & em[None, :], other=0.0)
        num += _dot(rqe, Sbe, LOWP) + _dot(rqo, Sbo, LOWP)
        A += _dot(rqe, tl.trans(_op(rke, LOWP)), LOWP) + _dot(rqo, tl.trans(_op(rko, LOWP)), LOWP)
        # the unrotated denominator: phi_q . (the key sum before the chunk + the chunk's keys up to the row)
        zbe = tl.load(zb + at * m + je, mask=me, other=0.0)
        zbo = tl.load(zb + at * m + jo, mask=mo, other=0.0)
        ze = zbe[None, :] + tl.cumsum(_op(fke, LOWP).to(tl.float32), 0)
        zo = zbo[None, :] + tl.cumsum(_op(fko, LOWP).to(tl.float32), 0)
        dn += tl.sum(_op(fqe, LOWP).to(tl.float32) * ze, 1) + tl.sum(_op(fqo, LOWP).to(tl.float32) * zo, 1)
    causal = i[:, None] >= i[None, :]
    A = tl.where(causal, A, 0.0)
    if LOWP:  # A in two bf16 parts (value, remainder): its rounding does not add to the features'
        Ah = A.to(tl.bfloat16)
        num += tl.dot(Ah, vt) + tl.dot((A - Ah.to(tl.float32)).to(tl.bfloat16), vt)
    else:
        num += _dot(A, vt, LOWP)
    o = num / tl.where(dn <= 0.0, 1.0, dn)[:, None]
    o = tl.where(real[:, None], o, 0.0)
    tl.store(out + bh * N * e + t[:, None] * e + ce[None, :], o.to(out.dtype.element_ty), mask=tm[:, None] & em[None, :])
    if eb == 0:
        tl.store(den + bh * N + t, dn, mask=tm)
        tl.store(rmax + bh * N + t, rmx, mask=tm)
