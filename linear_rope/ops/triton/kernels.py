"""Causal Eq. 19 (and Eq. 18) as Triton kernels: the shared pieces, the query stabiliser and the
two sequential state passes. The chunk-parallel output and gradient kernels are in
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

GEMM precision (``_mm``'s ``PREC``, from ``dispatch.pick_config``):

* ``XPREC``, the FAVOR+ exponent products w . x': about fp32 for every GPU dtype (an error of
  eps in an exponent a is an error of eps * |a| in exp(a), and |a| reaches tens): TF32x3 for
  fp16 and fp32 inputs; ``"bf16w3"`` for bf16 inputs (``_exponent3``: exact bf16 x times the
  projection in three bf16 pieces).
* ``PREC``, every other product: ``"bf16"`` (operands rounded to bf16, exact products, fp32
  sums: the bf16 tensor cores) for bf16 inputs, TF32x3 for fp16 and fp32, ``"ieee"`` (exact)
  for float64 interpreter runs. ``"tf32r"`` (TF32 on operands rounded to nearest: the
  hardware itself truncates) and ``"bf16x3"`` (three bf16 products of split operands, about
  16 mantissa bits) are there for a config that needs them.
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
def _mma(acc, a, b, PREC: tl.constexpr):
    """acc + a @ b with fp32 (or fp64) accumulation into ``acc`` itself (no temporary tile), in
    precision PREC (see the module docstring). An operand that is bf16 already (v of bf16
    inputs) is exact: ``"bf16x3"`` then splits only the other one (two products)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif PREC == "bf16x3":  # a b ~ a_hi b_lo + a_lo b_hi + a_hi b_hi, small terms first
        ah = a.to(tl.bfloat16)
        bh = b.to(tl.bfloat16)
        if b.dtype != tl.bfloat16:
            acc = tl.dot(ah, (b - bh.to(tl.float32)).to(tl.bfloat16), acc)
        if a.dtype != tl.bfloat16:
            acc = tl.dot((a - ah.to(tl.float32)).to(tl.bfloat16), bh, acc)
        return tl.dot(ah, bh, acc)
    elif PREC == "tf32r":
        return tl.dot(_rna(a.to(tl.float32)), _rna(b.to(tl.float32)), acc, input_precision="tf32")
    else:
        return tl.dot(a.to(acc.dtype), b.to(acc.dtype), acc, input_precision=PREC, out_dtype=acc.dtype)


@triton.jit
def _mma_nt(acc, a, b, PREC: tl.constexpr):
    """acc + a @ b^T as ``_mma``, with b `[N, K]` rounded / split in its own orientation and only
    the 16-bit pieces transposed (a view of them in shared memory on the tensor-core path)."""
    if PREC == "bf16x3":
        ah = a.to(tl.bfloat16)
        bh = b.to(tl.bfloat16)
        if b.dtype != tl.bfloat16:
            acc = tl.dot(ah, tl.trans((b - bh.to(tl.float32)).to(tl.bfloat16)), acc)
        if a.dtype != tl.bfloat16:
            acc = tl.dot((a - ah.to(tl.float32)).to(tl.bfloat16), tl.trans(bh), acc)
        return tl.dot(ah, tl.trans(bh), acc)
    elif PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), acc)
    else:
        return _mma(acc, a, tl.trans(b), PREC)


@triton.jit
def _mma_tn(acc, a, b, PREC: tl.constexpr):
    """acc + a^T @ b as ``_mma``, with a `[K, M]` rounded / split before it is transposed."""
    if PREC == "bf16x3":
        ah = a.to(tl.bfloat16)
        bh = b.to(tl.bfloat16)
        if b.dtype != tl.bfloat16:
            acc = tl.dot(tl.trans(ah), (b - bh.to(tl.float32)).to(tl.bfloat16), acc)
        if a.dtype != tl.bfloat16:
            acc = tl.dot(tl.trans((a - ah.to(tl.float32)).to(tl.bfloat16)), bh, acc)
        return tl.dot(tl.trans(ah), bh, acc)
    elif PREC == "bf16":
        return tl.dot(tl.trans(a.to(tl.bfloat16)), b.to(tl.bfloat16), acc)
    else:
        return _mma(acc, tl.trans(a), b, PREC)


@triton.jit
def _split(a, PREC: tl.constexpr):
    """An operand used in many products, split once: (bf16 hi, bf16 lo) for ``"bf16x3"``, else
    (a, a). For ``_mma_split``: a loop then keeps two bf16 tiles, not the fp32 one and its split."""
    if PREC == "bf16x3":
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
    else:
        hi = a
        lo = a
    return hi, lo


@triton.jit
def _mma_split(acc, ah, al, b, PREC: tl.constexpr):
    """``_mma(acc, a, b, PREC)`` for a given as ``_split(a, PREC)``."""
    if PREC == "bf16x3":
        bh = b.to(tl.bfloat16)
        if b.dtype != tl.bfloat16:
            acc = tl.dot(ah, (b - bh.to(tl.float32)).to(tl.bfloat16), acc)
        acc = tl.dot(al, bh, acc)
        return tl.dot(ah, bh, acc)
    else:
        return _mma(acc, ah, b, PREC)


@triton.jit
def _mma_bsplit(acc, a, bh, bl, PREC: tl.constexpr):
    """``_mma(acc, a, b, PREC)`` for b given as ``_split(b, PREC)`` (for ``"bf16x3"``: b's two bf16
    pieces, e.g. loaded as the wrapper stored them)."""
    if PREC == "bf16x3":
        ah = a.to(tl.bfloat16)
        acc = tl.dot(ah, bl, acc)
        acc = tl.dot((a - ah.to(tl.float32)).to(tl.bfloat16), bh, acc)
        return tl.dot(ah, bh, acc)
    else:
        return _mma(acc, a, bh, PREC)


@triton.jit
def _tri(tri_ptr, C: tl.constexpr, UPPER: tl.constexpr):
    """The chunk's causal matrix of ones from ``tri_ptr`` (the wrapper's `[2, C, C]` in bf16, lower
    then upper triangular): L[t, n] = (n <= t), or for ``UPPER`` its transpose U[n, t] = (n <= t).
    Loaded, not formed in registers, and each in its own row-major copy: a loaded tile that only
    feeds products stays in shared memory."""
    r = tl.arange(0, C)
    return tl.load(tri_ptr + UPPER * C * C + r[:, None] * C + r[None, :])


@triton.jit
def _cum(L, x, PREC: tl.constexpr):
    """L @ x with ``_tri``'s L (or U): the prefix (suffix) sums of x `[C, BP]` over the chunk's
    tokens, as the torch path forms them (a masked product: a NaN reaches the whole chunk, as
    there), about fp32 in every precision (L exact; x split on the bf16 tensor cores)."""
    if PREC == "bf16":
        acc = _mma(tl.zeros_like(x), L, x, "bf16x3")
    else:
        acc = _mma(tl.zeros_like(x), L, x, PREC)
    return acc


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """a @ b in precision PREC (``_mma`` into zeros)."""
    return _mma(tl.zeros((a.shape[0], b.shape[1]), a.dtype if a.dtype == tl.float64 else tl.float32), a, b, PREC)


@triton.jit
def _scale(d, ACC: tl.constexpr):
    """d^(-1/4), formed in ACC (a float argument would arrive as float32, also for float64 runs)."""
    return 1.0 / tl.sqrt(tl.sqrt(tl.full((1,), 0.0, ACC) + d))


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
