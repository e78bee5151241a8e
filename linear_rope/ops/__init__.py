"""Rotary linear attention (RoFormer Eq. 19): one op, three paths, one signature, one set of checks.

The three paths take ``(q, k, v, *, causal, rotary, offset, base, projection, mask, key_mask,
cu_seqlens, initial_state, output_final_state, allow_negative)`` and return `[B, H, N, e]`, or
``(out, LinearAttentionState)`` with ``output_final_state``:

* ``naive.py``     the O(N^2) reference: the one place Eq. 19 is written out in full;
* ``api.py``       the public op (``rotary_linear_attention``): checks once, picks a path, records
                   which and calls it (``prepare.py``: the torch paths' common preparation);
* ``chunk.py``     the torch path: chunked causal as the custom op of ``chunk_op.py`` (forward
                   ``chunk_fwd.py``, backward ``chunk_bwd.py``, layout ``layout.py``),
                   closed-form bidirectional;
* ``parallel.py``  the chunk-parallel causal path in a fixed number of plain torch ops, no
                   host syncs, bf16 tensor-core products under a bf16 autocast: the default on
                   CUDA (``LINEAR_ROPE_BACKEND=parallel`` anywhere);
* ``composite.py`` the causal chunk form in plain differentiable ops: the path under
                   ``torch.func`` transforms and forward-mode AD;
* ``recurrent.py`` token by token (``recurrent_rotary_linear_attention``), and the one-token
                   step decoding uses (``rotary_linear_attention_step``);
* ``utils.py``     the state type and the argument checks the three share (positions resolved
                   once there);
* ``fla_compat.py`` ``chunk_rotary_linear_attn``: the fast path in fla's `[B, T, H, .]` layout and
                   signature.
"""
from .api import rotary_linear_attention
from .fla_compat import chunk_rotary_linear_attn
from .naive import eq19_weights, naive_rotary_linear_attention
from .recurrent import recurrent_rotary_linear_attention, rotary_linear_attention_step
from .utils import LinearAttentionState

__all__ = [
    "rotary_linear_attention",
    "chunk_rotary_linear_attn",
    "rotary_linear_attention_step",
    "recurrent_rotary_linear_attention",
    "naive_rotary_linear_attention",
    "eq19_weights",
    "LinearAttentionState",
]
