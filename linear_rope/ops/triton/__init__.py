"""Causal Eq. 19 / Eq. 18 as fused Triton kernels (the GPU path of ``rotary_linear_attention``).

* ``kernels.py``  the ``@triton.jit`` kernels: FAVOR+ features, RoPE and the state on chip;
* ``chunk.py``    their autograd Function and ``rotary_linear_attention`` (the op's signature);
* ``dispatch.py`` ``supports`` (which calls the kernels take, and why not), ``should_use_triton``
                  (the ``LINEAR_ROPE_BACKEND`` switch) and the block sizes: no Triton import.

``rotary_linear_attention`` is imported on first use, so this package imports without Triton.
"""
from .dispatch import BACKENDS, ENV_VAR, pick_config, should_use_triton, supports, triton_available

__all__ = ["rotary_linear_attention", "should_use_triton", "supports", "triton_available", "pick_config",
           "BACKENDS", "ENV_VAR"]


def __getattr__(name):
    if name == "rotary_linear_attention":
        from .chunk import rotary_linear_attention

        return rotary_linear_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
