"""SoftmaxAttention: exact causal softmax attention with RoPE, the ablation's anchor.

The same projections as ``RotaryLinearAttention`` (``HeadProjections``: ``to_qkv``, ``to_out``, optional ``QKNorm``),
RoPE (Eq. 34) on q and k, then ``scaled_dot_product_attention``. It is the row every linear
variant is read against: what linear attention gives up at the same width, depth and data.
Memory and time are O(N^2) per layer; decoding keeps a key/value cache (O(N) per token).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import check_base, check_flag, check_input
from .ops.utils import check_mask
from .projections import HeadProjections, check_sizes
from .rotary import apply_rotary, check_offset, token_positions

__all__ = ["SoftmaxAttention", "KVCache"]


class KVCache(NamedTuple):
    """Rotated keys and values seen so far, `[B, H, T, d]` each, and which are real `[B, T]`."""

    k: torch.Tensor
    v: torch.Tensor
    key_mask: torch.Tensor


class SoftmaxAttention(HeadProjections):
    """Causal multi-head softmax attention with RoPE, `[B, N, dim]` -> `[B, N, dim]`.

    ``mask`` `[B, N]` (True = real token) works as in ``RotaryLinearAttention``: padded keys are
    never attended to, padded rows output 0 before ``to_out``, and positions count real tokens.
    """

    def __init__(self, dim: int, *, heads: int = 8, dim_head: int = 64, dropout: float = 0.0,
                 base: float = 10000.0, qk_norm: bool = False):
        super().__init__()
        check_sizes(dim=dim, heads=heads, dim_head=dim_head)
        if dim_head % 2:
            raise ValueError(f"dim_head: RoPE rotates q and k, so it must be even, got {dim_head}")
        check_flag("qk_norm", qk_norm)
        self.base, self.causal = check_base(base), True
        self.position = "softmax"  # as RotaryLinearAttention.position: the analyses read it
        self._init_projections(dim, heads, dim_head, dropout, qk_norm)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim_head={self.dim_head}, causal=True, position='rope'"

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None, output_final_state: bool = False):
        """x `[B, N, dim]` -> `[B, N, dim]` (with ``output_final_state``: ``(out, KVCache)``)."""
        check_input(x, "x", "[B, N, dim]", self.to_qkv.weight)
        if x.shape[1] == 0:
            raise ValueError(f"x must have shape [B, N, dim] with N >= 1, got {tuple(x.shape)}")
        B, N = x.shape[:2]
        q, k, v = self._qkv(x)
        if mask is None:
            q, k = apply_rotary(q, base=self.base), apply_rotary(k, base=self.base)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            key_mask = torch.ones(B, N, dtype=torch.bool, device=x.device)
        else:
            key_mask = check_mask(mask, "mask", (B, N))
            pos = token_positions(0, N, key_mask)[:, None]  # (B, 1, N)
            q, k = apply_rotary(q, base=self.base, positions=pos), apply_rotary(k, base=self.base, positions=pos)
            causal = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
            # A padded query may see no real key; its own key keeps its softmax finite, and its
            # output is zeroed below.
            allowed = (causal & key_mask[:, None, None, :]) | torch.eye(N, dtype=torch.bool, device=x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            out = out * key_mask[:, None, :, None].to(out.dtype)
        out = self._project_out(out, x)
        return (out, KVCache(k, v, key_mask)) if output_final_state else out

    def _check_cache(self, state, B: int, x_t: torch.Tensor) -> None:
        """The cache of this layer and batch: k, v `[B, H, T, d]` on x_t's device, key_mask `[B, T]`."""
        if state is None:
            return
        if not isinstance(state, KVCache) or not all(isinstance(t, torch.Tensor) for t in state):
            raise ValueError(f"state must be a KVCache or None, got {type(state).__name__}")
        k, v, real = state
        want = (B, self.heads, k.shape[2] if k.dim() == 4 else -1, self.dim_head)
        if k.dim() != 4 or tuple(k.shape) != want or tuple(v.shape) != want or tuple(real.shape) != (B, k.shape[2]) \
                or real.dtype != torch.bool:
            raise ValueError(f"state: a KVCache of k, v [B={B}, H={self.heads}, T, d={self.dim_head}] and a bool "
                             f"key_mask [B, T] is needed, got k {list(k.shape)}, v {list(v.shape)}, key_mask "
                             f"{real.dtype} {list(real.shape)}")
        if k.device != x_t.device:
            raise ValueError(f"state is on {k.device}, x_t on {x_t.device}")

    def step(self, x_t: torch.Tensor, state: KVCache | None, position: int | torch.Tensor):
        """Decode one token: x_t `[B, dim]` at ``position`` (an int or a LongTensor `[B]`) ->
        (`[B, dim]`, the cache with this token appended)."""
        check_input(x_t, "x_t", "[B, dim]", self.to_qkv.weight)
        B = x_t.shape[0]
        self._check_cache(state, B, x_t)
        position = check_offset(position, "position", rows=B)
        q, k, v = self._qkv(x_t.unsqueeze(1))  # (B, H, 1, d)
        pos = position.view(-1, 1, 1).to(x_t.device) if isinstance(position, torch.Tensor) else None
        off = 0 if pos is not None else position
        q = apply_rotary(q, offset=off, base=self.base, positions=pos)
        k = apply_rotary(k, offset=off, base=self.base, positions=pos)
        real = torch.ones(B, 1, dtype=torch.bool, device=x_t.device)
        if state is not None:
            k, v = torch.cat([state.k, k], dim=2), torch.cat([state.v, v], dim=2)
            real = torch.cat([state.key_mask, real], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :])
        return self._project_out(out, x_t).squeeze(1), KVCache(k, v, real)
