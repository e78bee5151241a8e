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
they are and upcast on chip. Two GEMM precisions (``dispatch.pick_config``):

* ``XPREC``, the FAVOR+ exponent products w . x' (in ``_features`` and ``_qmax_kernel``):
  TF32x3 (about fp32) for every input dtype. An error of eps in an exponent a is an error of
  eps * |a| in exp(a), and |a| reaches tens: plain TF32 there (truncated operands, 2^-10)
  made bf16 / fp16 outputs 3-20x less accurate than fp32 rounded to the input dtype.
* ``PREC``, every other product: ``"tf32r"`` for bf16 inputs, TF32 on operands rounded to
  nearest first (``_mm``: the tensor cores truncate, which biases every sum), TF32x3 for fp16
  and fp32 inputs, ``"ieee"`` (exact, fp64) for float64 interpreter runs.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rna(x):
    """fp32 -> the nearest TF32 value (ties away from zero), as ``cvt.rna.tf32.f32``: add half
    of the dropped 13 bits' range to the bit pattern, then clear them (finite x)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """a @ b, fp32 accumulation. ``"tf32r"``: TF32 tensor cores on operands rounded to nearest
    (the hardware itself truncates); anything else is ``tl.dot``'s ``input_precision``."""
    if PREC == "tf32r":
        return tl.dot(_rna(a), _rna(b), input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _scale(d, ACC: tl.constexpr):
    """d^(-1/4), formed in ACC (a float argument would arrive as float32, also for float64 runs)."""
    return 1.0 / tl.sqrt(tl.sqrt(tl.full((1,), 0.0, ACC) + d))


@triton.jit
def _block(w_ptr, c_ptr, i, m, d, P, BP: tl.constexpr, BD: tl.constexpr, FAVOR: tl.constexpr, ACC: tl.constexpr):
    """What a program keeps for its pairs p = i BP .. (i+1) BP - 1: the pairs, which of their even
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
def _features(q_row, k_row, km_row, qmax_row, t0, tmask, p, vale, valo, weT, woT, c, m, d, x_dim, scale, FLOOR,
              has_mask, FAVOR: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, XPREC: tl.constexpr):
    """phi(q), phi(k) of the chunk at token t0, even and odd halves `[C, BP]` (padded pairs and
    tokens, and masked tokens, are 0); q' and k' `[C, BD]` (FAVOR+); the keys' not-clamped masks
    (the gradient passes where floor <= exponent <= 0, as through torch's clamp); the key mask.
    Masked tokens are never loaded (selected, not multiplied by 0: 0 * NaN is NaN)."""
    tok = t0 + tl.arange(0, tmask.shape[0])
    km = tl.where(tmask, tl.load(km_row + tok, mask=_with(tmask, has_mask), other=1.0).to(ACC), 0.0)
    real = km > 0
    fme = real[:, None] & vale[None, :]
    fmo = real[:, None] & valo[None, :]
    if FAVOR:
        dd = tl.arange(0, BD)
        xo = tok[:, None] * x_dim + dd[None, :]
        xm = real[:, None] & (dd[None, :] < d)
        xq = tl.load(q_row + xo, mask=xm, other=0.0).to(ACC) * scale
        xk = tl.load(k_row + xo, mask=xm, other=0.0).to(ACC) * scale
        cq = c[None, :] - tl.load(qmax_row + tok, mask=tmask, other=0.0)[:, None]
        fe = tl.where(fme, tl.exp(_mm(xq, weT, XPREC) + cq), 0.0)
        fo = tl.where(fmo, tl.exp(_mm(xq, woT, XPREC) + cq), 0.0)
        ck = 0.5 * tl.sum(xk * xk, axis=1)[:, None] + c[None, :]
        ae = _mm(xk, weT, XPREC) - ck
        ao = _mm(xk, woT, XPREC) - ck
        oke = (ae >= FLOOR) & (ae <= 0.0)
        oko = (ao >= FLOOR) & (ao <= 0.0)
        ke = tl.where(fme, tl.exp(tl.minimum(tl.maximum(ae, FLOOR), 0.0)), 0.0)
        ko = tl.where(fmo, tl.exp(tl.minimum(tl.maximum(ao, FLOOR), 0.0)), 0.0)
    else:
        off = tok[:, None] * m + 2 * p[None, :]
        fe = tl.load(q_row + off, mask=fme, other=0.0).to(ACC)
        fo = tl.load(q_row + off + 1, mask=fmo, other=0.0).to(ACC)
        ke = tl.load(k_row + off, mask=fme, other=0.0).to(ACC)
        ko = tl.load(k_row + off + 1, mask=fmo, other=0.0).to(ACC)
        xq = fe
        xk = ke
        oke = tmask[:, None] & vale[None, :]  # where d phi(k) is stored: 0 at masked tokens
        oko = tmask[:, None] & valo[None, :]
    return fe, fo, ke, ko, xq, xk, oke, oko, km


@triton.jit
def _with(mask, flag):
    """mask & flag for a runtime scalar flag, broadcast first: Triton 3.9's interpreter gives a
    tensor & scalar a non-bool dtype that tl.load refuses as a mask."""
    return mask & (tl.zeros_like(mask) | flag)


@triton.jit
def _flags(FLAGS):
    """The runtime switches, packed as FLAGS = 3 + 4 * bits (odd and > 1, so Triton's integer
    specialisation never forks a variant): rotary, mask, initial state, output-state gradient."""
    bits = (FLAGS - 3) // 4
    return (bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0, (bits & 8) != 0


@triton.jit
def _tables(cos_ptr, sin_ptr, to, tmask, pmask, rotary):
    """cos, sin `[C, BP]` of the chunk; 1 and 0 (no rotation: Eq. 18) where not rotary."""
    tm = _with(tmask[:, None] & pmask[None, :], rotary)
    return tl.load(cos_ptr + to, mask=tm, other=1.0), tl.load(sin_ptr + to, mask=tm, other=0.0)


@triton.jit
def _rotate(fe, fo, cs, sn):
    """RoPE on pairs (even, odd) by tables cos, sin `[C, BP]`; (cs, -sn) rotates back."""
    return fe * cs - fo * sn, fe * sn + fo * cs


_INTS = ["N", "H", "m", "d", "e", "P", "x_dim", "tab_rows", "FLAGS"]  # never specialised: see ``aot.py``


@triton.jit(do_not_specialize=["N", "m", "d", "P"])
def _qmax_kernel(q_ptr, w_ptr, c_ptr, qmax_ptr, N, m, d, P,
                 C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, XPREC: tl.constexpr):
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
    for i in range(0, (P + BP - 1) // BP):
        p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, True, ACC)
        se = tl.where(vale[None, :], _mm(xs, weT, XPREC) + c[None, :], float("-inf"))
        so = tl.where(valo[None, :], _mm(xs, woT, XPREC) + c[None, :], float("-inf"))
        best = tl.maximum(best, tl.maximum(tl.max(se, axis=1), tl.max(so, axis=1)))
    tl.store(qmax_ptr + bh * N + tok, best, mask=tmask)


@triton.jit
def _load_state(ptr, zptr, bh, p, vale, valo, ee, m, e, on, ACC: tl.constexpr):
    """S `[BH, m, e]`, z `[BH, m]` rows of the pairs: (S_e, S_o `[BP, BE]`, z_e, z_o `[BP]`); zeros if not on."""
    so = bh * m * e + (2 * p)[:, None] * e + ee[None, :]
    em = _with(ee[None, :] < e, on)
    S_e = tl.load(ptr + so, mask=vale[:, None] & em, other=0.0).to(ACC)
    S_o = tl.load(ptr + so + e, mask=valo[:, None] & em, other=0.0).to(ACC)
    z_e = tl.load(zptr + bh * m + 2 * p, mask=_with(vale, on), other=0.0).to(ACC)
    z_o = tl.load(zptr + bh * m + 2 * p + 1, mask=_with(valo, on), other=0.0).to(ACC)
    return S_e, S_o, z_e, z_o


@triton.jit
def _store_state(ptr, zptr, bh, p, vale, valo, ee, m, e, S_e, S_o, z_e, z_o, on):
    so = bh * m * e + (2 * p)[:, None] * e + ee[None, :]
    em = _with(ee[None, :] < e, on)
    tl.store(ptr + so, S_e, mask=vale[:, None] & em)
    tl.store(ptr + so + e, S_o, mask=valo[:, None] & em)
    tl.store(zptr + bh * m + 2 * p, z_e, mask=_with(vale, on))
    tl.store(zptr + bh * m + 2 * p + 1, z_o, mask=_with(valo, on))


@triton.jit(do_not_specialize=_INTS)
def _fwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, s0_ptr, z0_ptr,
                num_ptr, den_ptr, sT_ptr, zT_ptr,
                N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
                C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (i, bh): pairs [i BP, (i+1) BP) of row-head bh over all N tokens.
    num `[nb, BH, N, e]`, den `[nb, BH, N]` partials; final S `[BH, m, e]`, z `[BH, m]`."""
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    BH = tl.num_programs(1)
    b = bh // H
    scale = _scale(d, ACC)
    rotary, has_mask, has_state, has_out_state = _flags(FLAGS)
    p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    S_e, S_o, z_e, z_o = _load_state(s0_ptr, z0_ptr, bh, p, vale, valo, ee, m, e, has_state, ACC)
    q_row, k_row = q_ptr + bh * N * x_dim, k_ptr + bh * N * x_dim
    ar = tl.arange(0, C)
    causal = ar[:, None] >= ar[None, :]
    vo = bh * N * e + ar[:, None] * e + ee[None, :]  # this row-head's chunk at token 0
    po = ((i * BH + bh) * N + ar[:, None]) * e + ee[None, :]
    to = (b % tab_rows) * N * P + ar[:, None] * P + p[None, :]
    for t0 in range(0, N, C):
        tmask = t0 + ar < N
        vm = tmask[:, None] & (ee[None, :] < e)
        fe, fo, ke, ko, _, _, _, _, km = _features(q_row, k_row, km_ptr + b * N, qmax_ptr + bh * N, t0, tmask, p,
                                                   vale, valo, weT, woT, c, m, d, x_dim, scale, FLOOR, has_mask,
                                                   FAVOR, BD, ACC, XPREC)
        v = tl.load(v_ptr + vo + t0 * e, mask=vm & (km > 0)[:, None], other=0.0).to(ACC)
        cs, sn = _tables(cos_ptr, sin_ptr, to + t0 * P, tmask, pmask, rotary)
        re, ro = _rotate(fe, fo, cs, sn)
        rke, rko = _rotate(ke, ko, cs, sn)
        # the denominator: unrotated, phi(q_t) . (z + sum_{n <= t} phi(k_n))
        den = tl.sum(fe * (z_e[None, :] + tl.cumsum(ke, axis=0)) + fo * (z_o[None, :] + tl.cumsum(ko, axis=0)), axis=1)
        A = _mm(re, tl.trans(rke), PREC) + _mm(ro, tl.trans(rko), PREC)
        A = tl.where(causal, A, 0.0)
        num = _mm(re, S_e, PREC) + _mm(ro, S_o, PREC)
        num += _mm(A, v, PREC)
        tl.store(num_ptr + po + t0 * e, num, mask=vm)
        tl.store(den_ptr + (i * BH + bh) * N + t0 + ar, den, mask=tmask)
        S_e += _mm(tl.trans(rke), v, PREC)
        S_o += _mm(tl.trans(rko), v, PREC)
        z_e += tl.sum(ke, axis=0)
        z_o += tl.sum(ko, axis=0)
    _store_state(sT_ptr, zT_ptr, bh, p, vale, valo, ee, m, e, S_e, S_o, z_e, z_o, has_out_state)


@triton.jit
def _store_feature_grad(ptr, row, N, t0, tmask, p, m, d, dfe, dfo, fe, fo, oke, oko, xs, weT, woT, scale,
                        FAVOR: tl.constexpr, IS_KEY: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """d phi -> d input, for the chunk at t0. Features in: the dq / dk columns of these pairs
    (ptr at `[BH, N, m]`, row = bh). FAVOR+: phi = exp(a), so da = dphi * phi (0 where a key's
    exponent was clamped), then back through a = w . x' (- |x'|^2 / 2 for keys): the partial
    `[C, d]` of this block (ptr at `[nb, BH, N, d]`, row = i * BH + bh)."""
    tok = t0 + tl.arange(0, tmask.shape[0])
    if FAVOR:
        dae = tl.where(oke, dfe * fe, 0.0)
        dao = tl.where(oko, dfo * fo, 0.0)
        dx = _mm(dae, tl.trans(weT), PREC) + _mm(dao, tl.trans(woT), PREC)
        if IS_KEY:
            dx -= xs * tl.sum(dae + dao, axis=1)[:, None]
        dd = tl.arange(0, BD)
        tl.store(ptr + (row * N + tok[:, None]) * d + dd[None, :], dx * scale,
                 mask=tmask[:, None] & (dd[None, :] < d))
    else:
        off = row * N * m + tok[:, None] * m + 2 * p[None, :]
        tl.store(ptr + off, dfe, mask=oke)
        tl.store(ptr + off + 1, dfo, mask=oko)


@triton.jit(do_not_specialize=_INTS)
def _bwd_kernel(q_ptr, k_ptr, v_ptr, w_ptr, c_ptr, km_ptr, qmax_ptr, cos_ptr, sin_ptr, s0_ptr, z0_ptr,
                dnum_ptr, dden_ptr, gS_ptr, gz_ptr, dq_ptr, dk_ptr, dv_ptr, dS0_ptr, dz0_ptr,
                N, H, m, d, e, P, x_dim, tab_rows, FLOOR, FLAGS,
                C: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                FAVOR: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr):
    """Program (i, bh) as in the forward. dnum `[BH, N, e]` = g / den, dden `[BH, N]` = -g.out / den.
    dv `[nb, BH, N, e]` partials; dq, dk partials `[nb, BH, N, d]` (FAVOR+) or `[BH, N, m]`;
    dS0, dz0 `[BH, m, e]`, `[BH, m]` (initial state)."""
    i, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    BH = tl.num_programs(1)
    b = bh // H
    scale = _scale(d, ACC)
    rotary, has_mask, has_state, has_out_state = _flags(FLAGS)
    p, pmask, vale, valo, weT, woT, c = _block(w_ptr, c_ptr, i, m, d, P, BP, BD, FAVOR, ACC)
    ee = tl.arange(0, BE)
    q_row, k_row = q_ptr + bh * N * x_dim, k_ptr + bh * N * x_dim
    grow = i * BH + bh if FAVOR else bh  # the row of dq / dk this program writes
    ar = tl.arange(0, C)
    vo = bh * N * e + ar[:, None] * e + ee[None, :]
    po = ((i * BH + bh) * N + ar[:, None]) * e + ee[None, :]
    to = (b % tab_rows) * N * P + ar[:, None] * P + p[None, :]
    # sweep 1, forward: dq needs the state before each chunk
    S_e, S_o, z_e, z_o = _load_state(s0_ptr, z0_ptr, bh, p, vale, valo, ee, m, e, has_state, ACC)
    causal = ar[:, None] >= ar[None, :]  # [t, n]: n <= t
    for t0 in range(0, N, C):
        tmask = t0 + ar < N
        vm = tmask[:, None] & (ee[None, :] < e)
        fe, fo, ke, ko, xq, _, _, _, km = _features(q_row, k_row, km_ptr + b * N, qmax_ptr + bh * N, t0, tmask, p,
                                                    vale, valo, weT, woT, c, m, d, x_dim, scale, FLOOR, has_mask,
                                                    FAVOR, BD, ACC, XPREC)
        vl = vm & (km > 0)[:, None]
        v = tl.load(v_ptr + vo + t0 * e, mask=vl, other=0.0).to(ACC)
        dnum = tl.load(dnum_ptr + vo + t0 * e, mask=vl, other=0.0)
        dden = tl.load(dden_ptr + bh * N + t0 + ar, mask=km > 0, other=0.0)
        Pm = tl.where(causal, _mm(dnum, tl.trans(v), PREC), 0.0)  # dnum_t . v_n, n <= t
        dfe = dden[:, None] * (z_e[None, :] + tl.cumsum(ke, axis=0))
        dfo = dden[:, None] * (z_o[None, :] + tl.cumsum(ko, axis=0))
        cs, sn = _tables(cos_ptr, sin_ptr, to + t0 * P, tmask, pmask, rotary)
        rke, rko = _rotate(ke, ko, cs, sn)
        dre = _mm(dnum, tl.trans(S_e), PREC) + _mm(Pm, rke, PREC)
        dro = _mm(dnum, tl.trans(S_o), PREC) + _mm(Pm, rko, PREC)
        dre, dro = _rotate(dre, dro, cs, -sn)  # R^T: rotate back
        fme = tmask[:, None] & vale[None, :]
        fmo = tmask[:, None] & valo[None, :]
        _store_feature_grad(dq_ptr, grow, N, t0, tmask, p, m, d, dfe + dre, dfo + dro, fe, fo, fme, fmo, xq, weT,
                            woT, scale, FAVOR, False, BD, PREC)
        S_e += _mm(tl.trans(rke), v, PREC)
        S_o += _mm(tl.trans(rko), v, PREC)
        z_e += tl.sum(ke, axis=0)
        z_o += tl.sum(ko, axis=0)
    # sweep 2, reverse: G = gS + sum over later tokens of rq dnum^T, Z = gz + sum dden phi(q)
    G_e, G_o, Z_e, Z_o = _load_state(gS_ptr, gz_ptr, bh, p, vale, valo, ee, m, e, has_out_state, ACC)
    later = ar[:, None] <= ar[None, :]  # [n, t]: t >= n
    n_chunks = (N + C - 1) // C
    for jc in range(0, n_chunks):
        t0 = (n_chunks - 1 - jc) * C
        tmask = t0 + ar < N
        vm = tmask[:, None] & (ee[None, :] < e)
        fe, fo, ke, ko, _, xk, oke, oko, km = _features(q_row, k_row, km_ptr + b * N, qmax_ptr + bh * N, t0, tmask,
                                                        p, vale, valo, weT, woT, c, m, d, x_dim, scale, FLOOR,
                                                        has_mask, FAVOR, BD, ACC, XPREC)
        vl = vm & (km > 0)[:, None]
        v = tl.load(v_ptr + vo + t0 * e, mask=vl, other=0.0).to(ACC)
        dnum = tl.load(dnum_ptr + vo + t0 * e, mask=vl, other=0.0)
        dden = tl.load(dden_ptr + bh * N + t0 + ar, mask=km > 0, other=0.0)
        cs, sn = _tables(cos_ptr, sin_ptr, to + t0 * P, tmask, pmask, rotary)
        re, ro = _rotate(fe, fo, cs, sn)
        rke, rko = _rotate(ke, ko, cs, sn)
        Pt = tl.where(later, _mm(v, tl.trans(dnum), PREC), 0.0)  # v_n . dnum_t, t >= n
        At = _mm(rke, tl.trans(re), PREC) + _mm(rko, tl.trans(ro), PREC)
        At = tl.where(later, At, 0.0)
        dv = _mm(rke, G_e, PREC) + _mm(rko, G_o, PREC)
        dv += _mm(At, dnum, PREC)
        tl.store(dv_ptr + po + t0 * e, dv, mask=vm)
        dre = _mm(v, tl.trans(G_e), PREC) + _mm(Pt, re, PREC)
        dro = _mm(v, tl.trans(G_o), PREC) + _mm(Pt, ro, PREC)
        dre, dro = _rotate(dre, dro, cs, -sn)
        qe = dden[:, None] * fe
        qo = dden[:, None] * fo
        dke = tl.where((km > 0)[:, None], Z_e[None, :] + tl.cumsum(qe, axis=0, reverse=True) + dre, 0.0)
        dko = tl.where((km > 0)[:, None], Z_o[None, :] + tl.cumsum(qo, axis=0, reverse=True) + dro, 0.0)
        _store_feature_grad(dk_ptr, grow, N, t0, tmask, p, m, d, dke, dko, ke, ko, oke, oko, xk, weT, woT, scale,
                            FAVOR, True, BD, PREC)
        G_e += _mm(tl.trans(re), dnum, PREC)
        G_o += _mm(tl.trans(ro), dnum, PREC)
        Z_e += tl.sum(qe, axis=0)
        Z_o += tl.sum(qo, axis=0)
    _store_state(dS0_ptr, dz0_ptr, bh, p, vale, valo, ee, m, e, G_e, G_o, Z_e, Z_o, has_state)
