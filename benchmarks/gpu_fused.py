"""The fused kernels' stand-ins for ``benchmarks.gpu_predict --backend fused``: the design priced
before it exists (``linear_rope/ops/fused/pricing.py``).

Four custom ops (namespace ``linear_rope_priced``), one per kernel of the design, with fake
implementations only (their outputs' shapes: the states before every chunk, den, rowmax, delta,
the gradients) and an autograd Function that calls K1, K2 forward and B1, B2 backward. Inductor
keeps each as one extern kernel (nothing to fuse into an opaque op); the predictor lists it as
``own`` and prices it by the formulas of ``pricing.py`` of the call's shapes, not by Inductor's
count of its arguments. ``attention_core_fused()`` sends the model's causal RoPE calls with a
FAVOR+ projection (Eq. 19) to them; everything else in the step (projections, MLP, norms, the
loss) stays as Inductor compiles it. The ops never run: calling one is a RuntimeError.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from linear_rope.ops.fused.pricing import DESIGN

NAMESPACE = "linear_rope_priced"
_BF16, _F32 = torch.bfloat16, torch.float32


def _never(*_a, **_k):
    raise RuntimeError("a stand-in of a fused kernel, priced by benchmarks.gpu_predict: it never runs")


def _op(name: str, schema: str, fake):
    lib_op = f"{NAMESPACE}::{name}"
    torch.library.define(lib_op, schema, lib=_LIB)
    torch.library.impl(lib_op, "CompositeExplicitAutograd", lib=_LIB)(_never)
    torch.library.register_fake(lib_op, fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


_LIB = torch.library.Library(NAMESPACE, "DEF")


def _nc(q):
    return -(-q.shape[2] // DESIGN["C"])


# every op takes q, k, v, w first (the predictor reads the call's shapes from them)
K1 = _op("fused_fwd_states", "(Tensor q, Tensor k, Tensor v, Tensor w) -> (Tensor, Tensor)",
         lambda q, k, v, w: (q.new_empty(*q.shape[:2], _nc(q), w.shape[0], v.shape[-1], dtype=_BF16),
                             q.new_empty(*q.shape[:2], _nc(q), w.shape[0], dtype=_F32)))
K2 = _op("fused_fwd_output", "(Tensor q, Tensor k, Tensor v, Tensor w, Tensor S, Tensor z) -> (Tensor, Tensor, Tensor)",
         lambda q, k, v, w, S, z: (v.new_empty(v.shape, dtype=_BF16), q.new_empty(q.shape[:3], dtype=_F32),
                                   q.new_empty(q.shape[:3], dtype=_F32)))
B1 = _op("fused_bwd_dstates",
         "(Tensor q, Tensor k, Tensor v, Tensor w, Tensor dout, Tensor out, Tensor den, Tensor rowmax) "
         "-> (Tensor, Tensor, Tensor)",
         lambda q, k, v, w, dout, out, den, rowmax: (
             q.new_empty(*q.shape[:2], _nc(q), w.shape[0], v.shape[-1], dtype=_BF16),
             q.new_empty(*q.shape[:2], _nc(q), w.shape[0], dtype=_F32), q.new_empty(q.shape[:3], dtype=_F32)))
B2 = _op("fused_bwd_dqkv",
         "(Tensor q, Tensor k, Tensor v, Tensor w, Tensor dout, Tensor den, Tensor rowmax, Tensor delta, Tensor S, "
         "Tensor z, Tensor dS, Tensor dz) -> (Tensor, Tensor, Tensor)",
         lambda q, k, v, w, dout, den, rowmax, delta, S, z, dS, dz: (
             q.new_empty(q.shape, dtype=_BF16), k.new_empty(k.shape, dtype=_BF16), v.new_empty(v.shape, dtype=_BF16)))


class FusedAttention(torch.autograd.Function):
    """Eq. 19's causal core through the four kernels: K1, K2 forward; B1, B2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, w):
        S, z = K1(q, k, v, w)
        out, den, rowmax = K2(q, k, v, w, S, z)
        ctx.save_for_backward(q, k, v, w, S, z, out, den, rowmax)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, w, S, z, out, den, rowmax = ctx.saved_tensors
        dout = dout.to(_BF16)
        dS, dz, delta = B1(q, k, v, w, dout, out, den, rowmax)
        dq, dk, dv = B2(q, k, v, w, dout, den, rowmax, delta, S, z, dS, dz)
        return dq, dk, dv, None


def _fused_call(orig):
    def call(q, k, v, *, causal=True, rotary=True, projection=None, mask=None, key_mask=None, cu_seqlens=None,
             initial_state=None, output_final_state=False, **kw):
        plain = (causal and rotary and projection is not None and mask is None and key_mask is None
                 and cu_seqlens is None and initial_state is None and not output_final_state
                 and isinstance(kw.get("offset", 0), int) and kw.get("offset", 0) == 0)
        if not plain:
            return orig(q, k, v, causal=causal, rotary=rotary, projection=projection, mask=mask, key_mask=key_mask,
                        cu_seqlens=cu_seqlens, initial_state=initial_state, output_final_state=output_final_state,
                        **kw)
        with torch.autocast(q.device.type, enabled=False):
            out = FusedAttention.apply(q.to(_BF16), k.to(_BF16), v.to(_BF16), projection.detach().to(_BF16))
        return out.to(v.dtype)
    return call


@contextlib.contextmanager
def attention_core_fused():
    """Within the block, the layers' causal RoPE calls with a projection (``position="rope"``)
    take the fused kernels' stand-ins; other calls take the op as it is."""
    import linear_rope.attention as attention
    with mock.patch.object(attention, "rotary_linear_attention", _fused_call(attention.rotary_linear_attention)):
        yield
