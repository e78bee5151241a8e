"""Which path a call takes: the Triton kernels or the torch ops. Imports nothing from Triton.

``should_use_triton(q, k, v, **kwargs)`` is the one call the op makes: the backend comes from
``force`` (``"torch"``, ``"triton"``, ``"auto"``), else the ``LINEAR_ROPE_BACKEND`` environment
variable, else ``"auto"``. ``auto`` takes the kernels for CUDA tensors when Triton is installed
and ``supports`` accepts the call; ``triton`` takes them wherever ``supports`` accepts (on the
CPU that needs ``TRITON_INTERPRET=1``, set before Triton is imported) and raises with the
reason otherwise; ``torch`` never does.
"""
from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["BACKENDS", "ENV_VAR", "GPU_DTYPES", "MAX_HEAD_DIM", "dispatch_configs", "pick_config", "should_use_triton",
           "supports", "triton_available"]

ENV_VAR = "LINEAR_ROPE_BACKEND"
BACKENDS = ("auto", "torch", "triton")
MAX_HEAD_DIM = 64  # d and e, padded to this (the paper's 64): the sm_90 compile test checks this size
NUM_STAGES = 1  # no software pipelining of the chunk loop's loads: less shared memory (see docs/gpu.md)
NUM_WARPS = 8  # 256 threads share each program's tiles: fewer registers per thread (and spills) than 4 warps
CHUNK = 32  # tokens per chunk: 64 spilled more on sm_90 (5.6 KB against 1.3 KB in the bf16 backward)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_available() -> bool:
    """Triton is importable (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pick_config(dtype: torch.dtype) -> dict:
    """The kernels' launch parameters: one config per input dtype, chosen here on the CPU (no
    autotune, so the interpreter and the sm_90 compile test see exactly what runs).

    C = 32 tokens per chunk; BP = 32 rotation pairs per program (m = 266 is 133 pairs: 5
    blocks, 17% padding); BD = BE = 64: d and e padded to 64 (the paper's head size; smaller
    heads pay for the padding); 8 warps, 1 stage (see docs/gpu.md for the sm_90 builds). GEMM precision: TF32 for bf16 / fp16 inputs (they carry 8-11
    bits; TF32 keeps 10), TF32x3 (about fp32 accuracy on tensor cores) for fp32 inputs, fp64
    for fp64 (the interpreter only: on CUDA float64 takes the torch path)."""
    prec = {torch.float16: "tf32", torch.bfloat16: "tf32", torch.float32: "tf32x3"}.get(dtype, "ieee")
    common = dict(C=CHUNK, BP=32, BD=MAX_HEAD_DIM, PREC=prec, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return dict(kernel=dict(common, BE=MAX_HEAD_DIM), qmax=common)


def dispatch_configs() -> list[tuple[torch.dtype, dict]]:
    """Every (input dtype, config) the dispatch can pick on CUDA: what the sm_90 compile test builds."""
    return [(dt, pick_config(dt)) for dt in GPU_DTYPES]


def supports(q, k, v, *, causal=True, rotary=True, offset=0, base=10000.0, projection=None, mask=None,
             key_mask=None, cu_seqlens=None, initial_state=None, output_final_state=False, allow_negative=False,
             **_) -> tuple[bool, str]:
    """(True, "") if the Triton kernels compute this call, else (False, the reason): the calls the
    kernels do not take go to the torch path, which takes every call. Argument errors are not
    judged here: the op's checks raise them on either path."""
    if not triton_available():
        return False, "triton is not installed (pip install 'linear_rope[triton]')"
    if not (q.is_cuda or _interpreting()):
        return False, f"tensors on {q.device.type}: the kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)"
    if key_mask is not None or k.shape[2] != q.shape[2]:
        return False, "cross-attention (key_mask, or k of another length) is bidirectional only (torch path)"
    if not causal:
        return False, "causal=False: the bidirectional closed form is a few GEMMs already (torch path)"
    if cu_seqlens is not None:
        return False, "cu_seqlens (packed documents) is not implemented in the kernels"
    if q.dtype not in GPU_DTYPES and not (q.dtype == torch.float64 and _interpreting()):
        return False, f"dtype {q.dtype}: the kernels take float16, bfloat16 and float32 (float64: the interpreter only)"
    if q.numel() == 0 or v.numel() == 0:
        return False, "an empty batch or head dim: nothing for a kernel to do (torch path)"
    d, e = q.shape[-1], v.shape[-1]
    if (projection is not None and d > MAX_HEAD_DIM) or e > MAX_HEAD_DIM:
        return False, f"head dims d={d}, e={e}: the kernels take d, e <= {MAX_HEAD_DIM}"
    return True, ""


def should_use_triton(q, k, v, *, force: str | None = None, **kwargs) -> bool:
    """True when the call should take the Triton kernels (see the module docstring). ``kwargs``:
    the op's keyword arguments. Raises ValueError for an unknown backend, or when ``triton`` is
    forced for a call the kernels do not take (with the reason)."""
    backend = force if force is not None else os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{ENV_VAR} / force must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    ok, why = supports(q, k, v, **kwargs)
    if backend == "triton" and not ok:
        raise ValueError(f"backend 'triton' was forced, but {why}")
    if backend == "auto":
        return ok and q.is_cuda
    return ok
