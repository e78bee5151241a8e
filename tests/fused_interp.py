"""Triton's interpreter made to compute bf16 as an NVIDIA GPU does, for the fused kernels' CPU
checks (as ``shared/tools/triton_bytes.py`` patches its loads). Import before triton runs
anything: it sets ``TRITON_INTERPRET=1``, read when a kernel is decorated, so run it in a
process of its own (``tests/fused_check.py`` is one, started by ``tests/test_fused_kernel.py``).

The interpreter keeps bf16 values as their raw 16 bits: its ``tl.dot`` multiplies those bits as
integers, and its float32 -> bf16 cast truncates. Patched: a bf16 operand of ``tl.dot`` is
widened to its float32 value and the product taken in float32 (the tensor cores: exact products,
float32 accumulation); float32 -> bf16 rounds to nearest even (the GPU's ``cvt.rn.bf16.f32``).
``tl.exp`` of float32 is what Triton emits for NVIDIA GPUs (PTX of the sm_90 build):
``ex2.approx.f32`` of x times log2(e) rounded to float32, emulated as ``exp2`` of that product
(the rounded product carries the error: about |x| 2^-24 relative, 5e-6 at |x| = 80). The
kernels' source stays the one the GPU compiles.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _I  # noqa: E402

_B = _I.InterpreterBuilder
_cast, _fp_to_fp, _dot = _B.cast_impl, _B.create_fp_to_fp, _B.create_dot


def _bf16_value(data: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> their float32 values, exactly."""
    return (data.astype(np.uint32) << 16).view(np.float32)


def _to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """float32 -> bf16 rounded to nearest even (torch's cast), as bits."""
    t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _rounding_cast(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return _I.TensorHandle(_to_bf16_bits(src.data), tl.bfloat16)
    return _cast(self, src, dst_type)


def _rounding_fp_to_fp(self, src, dst_type, rounding_mode):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return _I.TensorHandle(_to_bf16_bits(src.data), tl.bfloat16)
    return _fp_to_fp(self, src, dst_type, rounding_mode)


def _float_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
        av = _bf16_value(a.data) if a.dtype.scalar == tl.bfloat16 else a.data.astype(np.float32)
        bv = _bf16_value(b.data) if b.dtype.scalar == tl.bfloat16 else b.data.astype(np.float32)
        return _I.TensorHandle(np.matmul(av, bv, dtype=np.float32) + d.data, d.dtype.scalar)
    return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)


_patch_tensor = _I._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    """numpy >= 2.4 refuses ``int()`` of a one-element 1-d array, which the interpreter holds a
    scalar as: ``range(n)`` over a runtime ``n`` then fails. Read the one element instead."""
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_I._patch_lang_tensor = _patch_lang_tensor
_LOG2E = np.float32(1.4426950408889634)


def _gpu_exp(self, arg):
    if arg.data.dtype == np.float32:
        return _I.TensorHandle(np.exp2(arg.data * _LOG2E).astype(np.float32), arg.dtype.scalar)
    return _I.TensorHandle(np.exp(arg.data), arg.dtype.scalar)


_B.create_exp = _gpu_exp
_B.cast_impl = _rounding_cast
_B.create_fp_trunc = lambda self, src, dst_type: _rounding_cast(self, src, dst_type)
_B.create_fp_ext = lambda self, src, dst_type: _rounding_cast(self, src, dst_type)
_B.create_fp_to_fp = _rounding_fp_to_fp
_B.create_dot = _float_dot


def self_check() -> None:
    """The patch in force: bf16 casts round to nearest even and bf16 dots give float32 products."""
    import triton

    @triton.jit
    def _k(x, y, o, r):
        i = tl.arange(0, 16)
        a = tl.load(x + i[:, None] * 16 + i[None, :]).to(tl.bfloat16)
        tl.store(r + i[:, None] * 16 + i[None, :], a)
        b = tl.load(y + i[:, None] * 16 + i[None, :]).to(tl.bfloat16)
        tl.store(o + i[:, None] * 16 + i[None, :], tl.dot(a, b))

    x, y = torch.randn(16, 16), torch.randn(16, 16)
    o, r = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    _k[(1,)](x, y, o, r)
    assert torch.equal(r, x.bfloat16()), "bf16 cast"
    assert torch.allclose(o, x.bfloat16().float() @ y.bfloat16().float(), rtol=1e-6, atol=1e-6), "bf16 dot"
