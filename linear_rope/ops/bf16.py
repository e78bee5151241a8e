"""bf16 GEMM operands with float32 results, the tensor cores' arithmetic, for the chunk-parallel
path: on CUDA cuBLAS's bf16 GEMM with a float32 output (``bmm(out_dtype=float32)``); elsewhere
the bf16-rounded operands multiplied in float32, which is what the tensor cores compute, so the
CPU tests the GPU's numbers.
"""
from __future__ import annotations

import functools

import torch

from ..checks import is_compiling

__all__ = ["bmm32", "mm32", "native_bf16", "round_bf16"]


def bmm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b `[..., M, K] x [..., K, P]` of bf16 operands with a float32 result (float32
    accumulation, never rounded to bf16): cuBLAS's bf16 GEMM with a float32 output."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return torch.bmm(a3, b3, out_dtype=torch.float32).view(*lead, a.shape[-2], b.shape[-1])


@functools.lru_cache(maxsize=None)
def _has_bf16_f32_gemm(device: torch.device) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` takes bf16 operands on ``device``
    (CUDA builds of recent PyTorch); asked once per device, with a tiny product."""
    if device.type != "cuda":
        return False
    try:
        x = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
        return torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def native_bf16(t: torch.Tensor) -> bool:
    return t.is_cuda and (is_compiling() or _has_bf16_f32_gemm(t.device))


def round_bf16(t: torch.Tensor) -> torch.Tensor:
    """The GEMM operand: bf16 where the GEMM takes bf16 with a float32 result (CUDA); elsewhere
    the bf16-rounded values in float32, whose float32 products are what the tensor cores compute."""
    t16 = t.to(torch.bfloat16, memory_format=torch.contiguous_format)  # the copy lays it out too
    return t16 if native_bf16(t) else t16.float()


def mm32(a, b):
    return bmm32(a, b) if a.dtype == torch.bfloat16 else a @ b
