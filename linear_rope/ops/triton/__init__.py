"""Causal Eq. 19 / Eq. 18 as chunked Triton kernels (the GPU path of ``rotary_linear_attention``).

* ``kernels.py``  the shared ``@triton.jit`` pieces (FAVOR+ features, RoPE, the GEMM precisions),
                  the query stabiliser and the two serial state passes;
* ``chunk_kernels.py`` the chunk-parallel output, dq and dk / dv kernels;
* ``chunk.py``    their autograd Function and ``rotary_linear_attention`` (the op's signature);
* ``dispatch.py`` ``supports`` (which calls the kernels take, and why not), ``should_use_triton``
                  (the ``LINEAR_ROPE_BACKEND`` switch), ``kernel_status`` (can they run here:
                  Triton version, compute capability), the fallback and the block sizes;
* ``emulation.py`` the GPU's ``tl.dot`` arithmetic (TF32, TF32x3, half operands) in Triton's
                  interpreter, for the CPU tests;
* ``aot.py``      the ahead-of-time sm_80 / sm_90 builds and what ptxas reports of them.

``rotary_linear_attention`` is imported on first use, so this package imports without Triton.
"""
from .dispatch import (
    BACKENDS, ENV_VAR, KernelError, fallbacks, record_paths, kernel_status, pick_config, should_use_triton, supports,
    triton_available, use_backend,
)

__all__ = ["rotary_linear_attention", "should_use_triton", "supports", "triton_available", "pick_config",
           "kernel_status", "record_paths", "use_backend", "fallbacks", "KernelError", "BACKENDS", "ENV_VAR"]


def __getattr__(name):
    if name == "rotary_linear_attention":
        from .chunk import rotary_linear_attention

        return rotary_linear_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
