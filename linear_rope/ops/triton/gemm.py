"""The Triton kernels' GEMMs and their precisions (``@triton.jit`` helpers), the masked prefix
sums as products with a triangular matrix of ones (``_tri``, ``_cum``) and the FAVOR+ scale.

GEMM precision (``_mm``'s ``PREC``, from ``dispatch.pick_config``):

* ``XPREC``, the FAVOR+ exponent products w . x': about fp32 for every GPU dtype (an error of
  eps in an exponent a is an error of eps * |a| in exp(a), and |a| reaches tens): TF32x3 for
  fp16 and fp32 inputs; ``"bf16w3"`` for bf16 inputs (``favor._exponent``: exact bf16 x times the
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
