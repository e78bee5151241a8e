"""Launches of the fused kernels: block sizes, grids, buffers. Pure functions of tensors, called
from the ``triton_op`` bodies of ``op.py`` through ``wrap_triton`` (so Inductor sees each kernel).

Block sizes: C = 64 tokens a chunk, features in blocks of BM = 32 (two halves of 16: every tile
dim of a ``tl.dot`` at least 16), d padded to BD = next power of two >= 16, values in blocks of
BE = min(64, next power of two of e) (``_output``, ``_states``, ``_dstates``, ``_dqkv``'s BV). ``plan`` holds every launch's block sizes, warps and stages, and
``benchmarks/fused_build.py`` builds exactly those for sm_90 (registers, spills, shared memory,
tensor-core instructions; no GPU measured them): 4 warps (one warpgroup: a `[64, x]` tile is one
``wgmma`` row block, and ptxas's 255 registers a thread leave room for two programs an SM, where 8
warps took 255 and one), ``_dqkv`` as three kernels (dq; dk; dv), and the table in docs/gpu.md.
"""
from __future__ import annotations

import math

import torch
import triton

from ...features import key_exponent_floor
from . import CHUNK
from .backward import _dden, _dqkv, _dstates
from .forward import _output, _states

C = CHUNK  # tokens per chunk
BM = 32  # features per block (even: RoPE pairs stay in a block)
FLOOR = key_exponent_floor(torch.float32)


def _p2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _be(e: int) -> int:
    return min(64, _p2(e))


# the boolean constexprs each kernel is specialized on (one build each combination)
FLAGS = {"_states": ("ROTARY", "MASK", "INIT"), "_output": ("ROTARY", "MASK"), "_dden": ("MASK",),
         "_dstates": ("ROTARY", "MASK", "FINAL_S", "FINAL_Z"), "_dqkv": ("ROTARY", "MASK")}
DQKV_PARTS = (0, 1, 2)  # _dqkv's PART: dq, dk, dv (three launches)


def plan(lowp: bool, d: int, e: int) -> dict:
    """{kernel: (constexprs, options)} for q, k of width d and values of width e: every
    constexpr but the flags (``FLAGS``; ``_dqkv``'s PART: ``DQKV_PARTS``) and the launch options.
    The launches below take these, and the sm_90 builds (``benchmarks/fused_build.py``) too.
    bf16 products (LOWP): 4 warps, one warpgroup, so that a program takes at most half the
    register file; ``_output`` 8 (its accumulators num `[C, BE]` and A `[C, C]` float32 beside the
    q, k tiles spill 40-100 bytes a thread at 4, any stages or BE = 32). Float32 (IEEE products,
    FMA loops without tensor cores): 8 warps (4 spilled 1-25 KB a thread, 8 about 1 KB) and one
    stage (their operands go through shared memory); tf32x3 would put them on the tensor cores
    but is 8x further from float64 on large |q|, |k| (``tests/test_fused_kernel.py``'s check
    against the chunk-parallel path in float32: out 0.31 against 0.039 relative)."""
    BD, BE = _p2(d), _be(e)
    BW = min(BE, 32) if BD > 64 else BE  # the walks' value block: at d = 128 a [64, 128] k or q tile beside S
    st, w = (2, 4) if lowp else (1, 8)
    feat = dict(FLOOR=FLOOR, C=C, BM=BM, BD=BD, BE=BE, LOWP=lowp)
    return {
        "_states": (dict(feat, BE=BW), dict(num_warps=w, num_stages=st)),
        "_output": (feat, dict(num_warps=8, num_stages=st)),
        "_dden": (dict(C=C, BE=BE), dict(num_warps=4, num_stages=st)),
        "_dstates": (dict(C=C, BM=BM, BD=BD, BE=BW, LOWP=lowp), dict(num_warps=w, num_stages=st)),
        # dq, dk: e in value blocks of BV, columns of dq, dk in blocks of BO (a grid dimension: at d = 128
        # a [C, d] float32 accumulator spills); dv: a grid dimension over value blocks of BU. 2 stages spill dq
        # dv's value block BU: 32 at most in float32 (at 64 its dv spills 4.1 KB, at 32 0.8 KB)
        "_dqkv": (dict(feat, BE=_p2(e), BV=BE, BU=BE if lowp else min(BE, 32), BO=min(BD, 64)),
                  dict(num_warps=w, num_stages=1)),
    }


def _strides3(t):
    """(batch, head, row) strides of a `[B, H, N, x]` tensor with unit last stride."""
    return t.stride(0), t.stride(1), t.stride(2)


def _table_args(cos, sin, mask, like):
    """Pointers and strides of the RoPE tables (None: no rotation; a dummy pointer) and mask."""
    if cos is None:
        cos = sin = like
        st = (0, 0, 0)
    else:
        st = (cos.stride(0), cos.stride(1), cos.stride(2)) if cos.dim() == 3 else (0, cos.stride(0), cos.stride(1))
    sm = (mask.stride(0),) if mask is not None else (0,)
    return cos, sin, (like if mask is None else mask), st, sm


def forward(wrap, q, k, v, wa, wb, c, cos, sin, mask, S0, z0, lowp: bool, out_dtype: torch.dtype):
    """out `[B, H, N, e]` (out_dtype), S `[B, H, m, e]`, z `[B, H, m]` (float32), and for the
    backward den, rmax `[B H, N]` float32, Sb `[B H, nc, m, e]` (bf16 under lowp, else float32),
    zb `[B H, nc, m]` float32."""
    B, H, N, d = q.shape
    e, m = v.shape[-1], wa.shape[0]
    nc = triton.cdiv(N, C)
    BH = B * H
    dev = q.device
    Sb = torch.empty(BH, nc, m, e, device=dev, dtype=torch.bfloat16 if lowp else torch.float32)
    zb = torch.empty(BH, nc, m, device=dev, dtype=torch.float32)
    S = torch.empty(B, H, m, e, device=dev, dtype=torch.float32)
    z = torch.empty(B, H, m, device=dev, dtype=torch.float32)
    out = torch.empty(B, H, N, e, device=dev, dtype=out_dtype)
    den = torch.empty(BH, N, device=dev, dtype=torch.float32)
    rmax = torch.empty(BH, N, device=dev, dtype=torch.float32)
    cos_, sin_, mask_, st, sm = _table_args(cos, sin, mask, c)
    ksc = 0.5 / math.sqrt(d)
    P = plan(lowp, d, e)
    flags = dict(ROTARY=cos is not None, MASK=mask is not None)
    init = S0 is not None
    wrap(_states)[(BH, triton.cdiv(m, BM), triton.cdiv(e, P["_states"][0]["BE"]))](
        k, v, wa, wb, c, cos_, sin_, mask_, S0 if init else S, z0 if init else z, Sb, zb, S, z,
        *_strides3(k), *_strides3(v), *st, *sm, N, H, nc, m, d, e, ksc, INIT=init, **flags,
        **P["_states"][0], **P["_states"][1])
    wrap(_output)[(nc, BH, triton.cdiv(e, P["_output"][0]["BE"]))](
        q, k, v, wa, wb, c, cos_, sin_, mask_, Sb, zb, out, den, rmax,
        *_strides3(q), *_strides3(k), *_strides3(v), *st, *sm, N, H, nc, m, d, e, ksc, **flags,
        **P["_output"][0], **P["_output"][1])
    return out, S, z, den, rmax, Sb, zb


def backward(wrap, q, k, v, wa, wb, c, cos, sin, mask, out, den, rmax, Sb, zb, dout, dS, dz, lowp: bool):
    """dq, dk `[B, H, N, d]` and dv `[B, H, N, e]` in the inputs' dtype, and the initial state's
    gradients dS0 `[B, H, m, e]`, dz0 `[B, H, m]` float32. ``dS``, ``dz``: the final state's
    gradients, or None."""
    B, H, N, d = q.shape
    e, m = v.shape[-1], wa.shape[0]
    nc = triton.cdiv(N, C)
    BH = B * H
    dev = q.device
    dout = dout.contiguous()
    dden = torch.empty(BH, N, device=dev, dtype=torch.float32)
    dSa = torch.empty(BH, nc, m, e, device=dev, dtype=torch.bfloat16 if lowp else torch.float32)
    dza = torch.empty(BH, nc, m, device=dev, dtype=torch.float32)
    dS0 = torch.empty(B, H, m, e, device=dev, dtype=torch.float32)
    dz0 = torch.empty(B, H, m, device=dev, dtype=torch.float32)
    dq = torch.empty(B, H, N, d, device=dev, dtype=q.dtype)
    dk = torch.empty(B, H, N, d, device=dev, dtype=k.dtype)
    dv = torch.empty(B, H, N, e, device=dev, dtype=v.dtype)
    cos_, sin_, mask_, st, sm = _table_args(cos, sin, mask, c)
    ksc = 0.5 / math.sqrt(d)
    P = plan(lowp, d, e)
    BE = P["_dstates"][0]["BE"]
    msk = mask is not None
    flags = dict(ROTARY=cos is not None, MASK=msk)
    wrap(_dden)[(nc, BH)](dout, out, den, mask_, dden, *sm, N, H, e, MASK=msk, **P["_dden"][0], **P["_dden"][1])
    wrap(_dstates)[(BH, triton.cdiv(m, BM), triton.cdiv(e, BE))](
        q, wa, wb, c, cos_, sin_, mask_, dout, den, rmax, dden, dz0 if dS is None else dS,
        dz0 if dz is None else dz, dSa, dza, dS0, dz0, *_strides3(q), *st, *sm, N, H, nc, m, d, e,
        FINAL_S=dS is not None, FINAL_Z=dz is not None, **flags, **P["_dstates"][0], **P["_dstates"][1])
    for part in DQKV_PARTS:  # dq, dk, dv (dv: over value blocks of BU)
        pq = P["_dqkv"][0]
        grid = (nc, BH, triton.cdiv(e, pq["BU"]) if part == 2 else triton.cdiv(d, pq["BO"]))
        wrap(_dqkv)[grid](
            q, k, v, wa, wb, c, cos_, sin_, mask_, dout, den, rmax, dden, Sb, zb, dSa, dza, dq, dk, dv,
            *_strides3(q), *_strides3(k), *_strides3(v), *st, *sm, N, H, nc, m, d, e, ksc,
            PART=part, **flags, **P["_dqkv"][0], **P["_dqkv"][1])
    return dq, dk, dv, dS0, dz0
