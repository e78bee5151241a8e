"""The GPU's ``tl.dot`` arithmetic in Triton's interpreter, for CPU tests of the kernels.

Triton's interpreter multiplies every ``tl.dot`` in full fp32 (numpy), whatever
``input_precision`` asks for, so an interpreter test cannot see what the tensor cores do to a
kernel's accuracy. ``tensor_core_dots()`` patches the interpreter's dot to compute what an
Ampere / Hopper GPU computes:

* ``"tf32"`` on fp32 operands: the tensor cores read the top 19 bits of each operand (sign,
  exponent, 10 mantissa bits) and ignore the low 13: **truncation**, since the sm_80 / sm_90
  builds put no ``cvt.rna.tf32`` before the ``mma`` (see ``aot.py``'s PTX report). Products
  of the truncated operands are exact; the sum is fp32.
* ``"tf32x3"``: Triton splits each operand into big = round-to-nearest TF32 (``cvt.rna``) and
  small = the rest, and runs three TF32 products, small x big + big x small + big x big (the
  small parts truncated by the tensor cores in turn).
* ``"ieee"``: exact fp32 products (FMA units), as the interpreter already does.
* bf16 / fp16 operands (any precision): exact products, fp32 accumulation.
* fp64 operands: unchanged (the interpreter's float64 runs; no GPU runs them).

Use it around interpreter calls (``TRITON_INTERPRET=1``)::

    with tensor_core_dots():
        out = linear_rope.ops.triton.rotary_linear_attention(q, k, v, projection=W)

``tf32_truncate`` and ``tf32_round`` are the two operand roundings, on numpy float32 arrays.
"""
from __future__ import annotations

import contextlib

import numpy as np

__all__ = ["tensor_core_dots", "tf32_round", "tf32_truncate", "emulated_dot"]

_LOW13 = np.uint32(0x1FFF)
_KEEP = np.uint32(0xFFFFE000)


def tf32_truncate(x: np.ndarray) -> np.ndarray:
    """What the tensor cores read from an fp32 operand in TF32 mode: the low 13 mantissa bits
    dropped (towards zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return (x.view(np.uint32) & _KEEP).view(np.float32)


def tf32_round(x: np.ndarray) -> np.ndarray:
    """``cvt.rna.tf32.f32``: round to the nearest TF32 value, ties away from zero (finite
    inputs; inf and NaN pass through)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    finite = np.isfinite(x)
    rounded = ((bits + np.uint32(0x1000)) & _KEEP).view(np.float32)
    return np.where(finite, rounded, x)


def _precision_name(p) -> str:
    """``ir.INPUT_PRECISION`` member (or a string) -> "tf32", "tf32x3", "ieee", ..."""
    name = getattr(p, "name", None) or str(p).rsplit(".", 1)[-1]
    return name.lower()


def _as_float32(data: np.ndarray, dtype) -> np.ndarray:
    """An interpreter tensor's data as float32 (bf16 is stored as uint16 bit patterns)."""
    name = str(dtype)
    if "bf16" in name or "bfloat16" in name:
        return (data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return data.astype(np.float32)


def emulated_dot(a: np.ndarray, b: np.ndarray, precision: str) -> np.ndarray:
    """a @ b (fp32 operands, fp32 result) as the tensor cores compute it in ``precision``."""
    mm = lambda x, y: np.matmul(x, y, dtype=np.float32)  # noqa: E731 - exact products of <= 11-bit mantissas, fp32 sums
    if precision == "tf32":
        return mm(tf32_truncate(a), tf32_truncate(b))
    if precision == "tf32x3":
        a_big, b_big = tf32_round(a), tf32_round(b)
        a_small, b_small = tf32_truncate(a - a_big), tf32_truncate(b - b_big)
        return (mm(a_small, b_big) + mm(a_big, b_small)) + mm(a_big, b_big)
    return mm(a, b)  # ieee (and anything else): exact fp32 products


@contextlib.contextmanager
def tensor_core_dots():
    """Within the block, the interpreter's ``tl.dot`` computes what the GPU's tensor cores do
    (see the module docstring). Restores the interpreter's own dot on exit."""
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_name, b_name = str(a.dtype), str(b.dtype)
        if "fp64" in a_name or "float64" in a_name or "fp8" in a_name:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        half = any(t in n for n in (a_name, b_name) for t in ("bf16", "bfloat16", "fp16", "float16"))
        x, y = _as_float32(a.data, a.dtype), _as_float32(b.data, b.dtype)
        prec = "ieee" if half else _precision_name(input_precision)
        out = emulated_dot(x, y, prec) + d.data.astype(np.float32)
        return interp.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original
