"""The fused path: causal Eq. 19 with FAVOR+ features made on chip (Triton kernels, never a
feature tensor in memory). ``pricing.py`` prices the kernels as built for ``benchmarks.gpu_predict``. ``op.py`` holds the op (``torch.library.triton_op``s and their
autograd), ``launch.py`` the launches, ``forward.py`` / ``backward.py`` / ``common.py`` the
kernels. This module imports no triton: ``supports_fused`` says whether a call can take the
path, ``triton_available`` whether triton is installed.
"""
from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["MAX_D", "MAX_E", "fused_refusal", "supports_fused", "triton_available"]

MAX_D = 128  # q, k head dim (one [64, d] tile)
MAX_E = 128  # value width (the backward's dq, dk loop over value blocks of 64 up to it)
CHUNK = 64  # tokens a chunk (launch.C)
STATE_BYTES = 4 << 30  # the states before every chunk, at most (as parallel.STATE_BYTES, counted in float32)


_TRITON: list[bool] = []  # whether triton is installed, looked up once (a plain global: dynamo reads it)


def triton_available() -> bool:
    if not _TRITON:
        _TRITON.append(importlib.util.find_spec("triton") is not None)
    return _TRITON[0]


def supports_fused(q, k, v, projection, a, causal: bool) -> str | None:
    """None if the fused path takes the call, else why not (one line)."""
    if not causal:
        return "causal=False (the bidirectional closed form is plain ops)"
    if projection is None:
        return "features given (no projection): the fused kernels make FAVOR+ features inside"
    if a.docs is not None:
        return "cu_seqlens (packed documents)"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (the kernels take float32, bfloat16 and float16)"
    if a.kmask is not None and a.qmask is not None and a.kmask is not a.qmask:
        return "separate query and key masks"
    d, e = q.shape[-1], v.shape[-1]
    if d > MAX_D:
        return f"d = {d} > {MAX_D}"
    if not 1 <= e <= MAX_E:
        return f"e = {e} outside 1..{MAX_E}"
    if q.shape[0] * q.shape[1] == 0 or q.shape[2] == 0:
        return "an empty call"
    B, H, N = q.shape[:3]
    states = B * H * -(-N // CHUNK) * projection.shape[0] * e * 4
    if states > STATE_BYTES:
        return (f"the states before every chunk take {states / 2**30:.1f} GiB (float32) > {STATE_BYTES >> 30} GiB: the "
                f"chunk-parallel path walks the sequence in segments")
    return None


def fused_refusal(q, k, v, projection, a, causal: bool, lowp: bool, forced: bool, sizes: bool = False) -> str | None:
    """None if the fused path takes the call, else why not (one line): ``supports_fused``, and
    CUDA tensors (CPU tensors only in Triton's interpreter, ``TRITON_INTERPRET=1``) with triton
    installed. Unforced (``auto``), only bf16 arithmetic (bf16 inputs or a bf16 autocast): the
    float32 kernels multiply in IEEE float32 without tensor cores (built for sm_90 they spill).
    ``sizes``: ``chunk_size`` or ``block_size`` given, which the fused kernels do not take."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"tensors on {q.device.type} (the fused kernels run on CUDA)"
    if not triton_available():
        return "triton is not installed"
    why = supports_fused(q, k, v, projection, a, causal)
    if why is None and sizes:
        why = "chunk_size / block_size given (the fused kernels' chunk is 64 tokens, and they walk no segments)"
    if why is None and not forced and not lowp:
        why = f"{str(q.dtype)[6:]} arithmetic (auto takes the fused path for bf16; LINEAR_ROPE_BACKEND=fused forces it)"
    return why
