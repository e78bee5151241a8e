"""The fused path's op: two ``torch.library.triton_op``s (forward, backward), so that Inductor
sees their Triton kernels (``wrap_triton``) under ``torch.compile``, joined by
``register_autograd``; and ``fused_causal``, which prepares a checked call for them.

Eq. 19 with FAVOR+ inside, causal, on q, k, v as the layer gives them (its dtype and strides):
``launch.forward`` runs two kernels (the states before each chunk, then the outputs of all
chunks), ``launch.backward`` three (the denominator's part of the upstream gradient, the states'
gradients, then dq, dk, dv). Features are made on chip in every kernel and never stored.

Precision, as the chunk-parallel path's (``parallel.py``): bf16 inputs (or a bf16 autocast)
take bf16 GEMM operands with float32 accumulation, the projection as two bf16 parts along K;
float16 and float32 inputs compute in float32 (IEEE products: float16's range would not hold the
features and states). The final state S, z is float32.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op, wrap_triton

from ...features import pair_shift
from ..bf16 import round_bf16
from ..rope_tables import rope_pair_tables
from . import launch

__all__ = ["fused_causal", "DOUBLE_BACKWARD"]

DOUBLE_BACKWARD = ("rotary_linear_attention: double backward (create_graph=True) is not supported on the fused path "
                   "(its backward is written by hand)")


@triton_op("linear_rope::fused_forward", mutates_args=())
def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor,
                  c: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                  mask: Optional[torch.Tensor], S0: Optional[torch.Tensor], z0: Optional[torch.Tensor], lowp: bool,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, S, z, den, rmax, Sb, zb): see ``launch.forward``."""
    return launch.forward(wrap_triton, q, k, v, wa, wb, c, cos, sin, mask, S0, z0, lowp, out_dtype)


@triton_op("linear_rope::fused_backward", mutates_args=())
def fused_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor,
                   c: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                   mask: Optional[torch.Tensor], out: torch.Tensor, den: torch.Tensor, rmax: torch.Tensor,
                   Sb: torch.Tensor, zb: torch.Tensor, dout: torch.Tensor, dS: Optional[torch.Tensor],
                   dz: Optional[torch.Tensor], lowp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dS0, dz0): see ``launch.backward``."""
    return launch.backward(wrap_triton, q, k, v, wa, wb, c, cos, sin, mask, out, den, rmax, Sb, zb, dout, dS, dz,
                           lowp)


def _setup(ctx, inputs, output):
    q, k, v, wa, wb, c, cos, sin, mask, S0, z0, lowp, _ = inputs
    out, _, _, den, rmax, Sb, zb = output
    ctx.save_for_backward(q, k, v, wa, wb, c, cos, sin, mask, out, den, rmax, Sb, zb)
    ctx.lowp = lowp
    ctx.mark_non_differentiable(den, rmax, Sb, zb)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dS, dz, *_):
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD)
    q, k, v, wa, wb, c, cos, sin, mask, out, den, rmax, Sb, zb = ctx.saved_tensors
    if dout is None:  # only the final state used
        dout = torch.zeros_like(out)
    dS = None if dS is None else dS.float().contiguous()
    dz = None if dz is None else dz.float().contiguous()
    dq, dk, dv, dS0, dz0 = fused_backward(q, k, v, wa, wb, c, cos, sin, mask, out, den, rmax, Sb, zb, dout, dS, dz,
                                          ctx.lowp)
    need = ctx.needs_input_grad
    return dq, dk, dv, None, None, None, None, None, None, dS0 if need[9] else None, dz0 if need[10] else None, None, None


torch.library.register_autograd("linear_rope::fused_forward", _backward, setup_context=_setup)


def _projection_of(w: torch.Tensor, lowp: bool):
    """(wa, wb, c): the projection scaled by d^(-1/4) `[m, d]` contiguous (under ``lowp`` its bf16
    value part wa and remainder wb, as ``parallel._projection_operands_of``; else float32, wb = wa)
    and the pair shifts c `[m]` float32."""
    w = w.float()
    w16 = w * w.shape[-1] ** -0.25
    if lowp:
        hi = round_bf16(w16)
        wa, wb = hi.to(torch.bfloat16), round_bf16(w16 - hi.float()).to(torch.bfloat16)
    else:
        wa = wb = w16.contiguous()
    return wa, wb, pair_shift(w).contiguous()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_causal(q, k, v, w, a, rotary: bool, offset: int, base: float, lowp: bool):
    """Causal Eq. 19 (Eq. 18 without ``rotary``) with FAVOR+ features of the projection ``w``
    `[m, d]` inside, on the checked arguments ``a`` (``supports_fused`` took the call): q, k
    `[B, H, N, d]`, v `[B, H, N, e]` in one dtype -> out `[B, H, N, e]` in v's dtype, S, z
    float32. Masked tokens (``a.kmask``, which is ``a.qmask``) are selected away in the kernels;
    masked queries output 0."""
    B, H, N, d = q.shape
    m = w.shape[0]
    wa, wb, c = _projection_of(w.detach(), lowp)  # at every call: no cache to go stale (docs/caches.md)
    cos = sin = None
    if rotary:
        cos2, sin2 = rope_pair_tables(N, m, offset, base, a.positions, q.device, torch.float32)
        if cos2.dim() == 4:  # per-row positions: [B, 1, N, m]
            cos2, sin2 = cos2[:, 0], sin2[:, 0]
        cos, sin = cos2[..., 0::2], sin2[..., 1::2]  # cos and +sin of each pair, as strided views
    mask = None if a.kmask is None else a.kmask.contiguous().view(torch.int8)
    S0 = z0 = None
    if a.state is not None:
        S0, z0 = a.state.S.float().contiguous(), a.state.z.float().contiguous()
    out_dtype = torch.float32 if v.dtype == torch.float16 else v.dtype
    out, S, z, *_ = fused_forward(_unit_last(q), _unit_last(k), _unit_last(v), wa, wb, c, cos, sin, mask, S0, z0,
                                  lowp, out_dtype)
    return out.to(v.dtype), S, z
