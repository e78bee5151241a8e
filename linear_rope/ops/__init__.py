"""Rotary linear attention (RoFormer Eq. 19): one op, three paths, one signature, one set of checks.

* ``naive.py``     the O(N^2) reference: the one place Eq. 19 is written out in full;
* ``chunk.py``     the fast path: chunked causal with a hand-written backward, closed-form
                   bidirectional (``rotary_linear_attention``);
* ``recurrent.py`` one causal token from the state (``rotary_linear_attention_step``);
* ``utils.py``     the state type and the argument checks the three share.
"""
from .chunk import rotary_linear_attention
from .naive import eq19_weights, naive_rotary_linear_attention
from .recurrent import rotary_linear_attention_step
from .utils import LinearAttentionState

__all__ = [
    "rotary_linear_attention",
    "rotary_linear_attention_step",
    "naive_rotary_linear_attention",
    "eq19_weights",
    "LinearAttentionState",
]
