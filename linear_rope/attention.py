"""RotaryLinearAttention: multi-head linear self-attention with a choice of RoPE placement."""
from __future__ import annotations

import torch
from torch import nn

from .favor_attention import favor_rotary_attention
from .features import FEATURE_KINDS, FavorFeatures
from .ops import LinearAttentionState, rotary_linear_attention, rotary_linear_attention_step
from .rotary import apply_rotary, check_offset

__all__ = ["RotaryLinearAttention", "POSITIONS"]

POSITIONS = ("rope", "rope_pre", "none")


class RotaryLinearAttention(nn.Module):
    """Multi-head linear self-attention, `[B, N, dim]` -> `[B, N, dim]`.

    Args:
        dim: model width.
        heads, dim_head: H heads of d = dim_head dims (q, k, v are projected to H * d).
        nb_features: m, the number of FAVOR+ features (default int(d ln d), even).
        causal: autoregressive (position t sees positions <= t only) or bidirectional.
        position: where the position enters:
            ``"rope"``     RoFormer Eq. 19, RoPE on the features phi(q), phi(k), numerator only;
            ``"rope_pre"`` RoPE on q and k *before* the feature map (performer-pytorch's
                           ``rotary_position_emb``), then plain linear attention;
            ``"none"``     plain linear attention (Eq. 18), no position information.
        feature_map: ``"favor"``, ``"elu"`` or ``"relu"`` (see ``FavorFeatures``).
        dropout: dropout on the output projection (linear attention never forms the attention
            weights, so there is nothing else to drop).
        base: RoPE base.

    The FAVOR+ projection is shared by all heads, as in performer-pytorch; ``self.features``
    owns it and ``self.features.redraw(generator)`` renews it.
    """

    def __init__(
        self,
        dim: int,
        *,
        heads: int = 8,
        dim_head: int = 64,
        nb_features: int | None = None,
        causal: bool = True,
        position: str = "rope",
        feature_map: str = "favor",
        dropout: float = 0.0,
        base: float = 10000.0,
    ):
        super().__init__()
        if position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
        for name, val in (("dim", dim), ("heads", heads), ("dim_head", dim_head)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if position == "rope_pre" and dim_head % 2:
            raise ValueError(f"dim_head: rope_pre rotates q and k, so it must be even, got {dim_head}")
        if feature_map not in FEATURE_KINDS:
            raise ValueError(f"feature_map must be one of {FEATURE_KINDS}, got {feature_map!r}")
        self.features = FavorFeatures(dim_head, nb_features, kind=feature_map)
        if position == "rope" and self.features.out_features % 2:
            raise ValueError(f"nb_features: rope rotates the features, so m must be even, got {self.features.out_features}")
        self.heads, self.dim_head, self.causal, self.position, self.base = heads, dim_head, causal, position, base
        inner = heads * dim_head
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.to_out = nn.Linear(inner, dim)
        self.dropout = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim_head={self.dim_head}, causal={self.causal}, position={self.position!r}"

    def _qkv(self, x: torch.Tensor, offset: int):
        """x `[B, N, dim]` -> q, k, v `[B, H, N, d]` (q and k rotated for ``rope_pre``)."""
        B, N, _ = x.shape
        q, k, v = (t.view(B, N, self.heads, self.dim_head).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        if self.position == "rope_pre":
            q, k = apply_rotary(q, offset=offset, base=self.base), apply_rotary(k, offset=offset, base=self.base)
        return q, k, v

    def _features(self, x: torch.Tensor, offset: int):
        """x `[B, N, dim]` -> phi(q), phi(k) `[B, H, N, m]` and v `[B, H, N, d]`."""
        q, k, v = self._qkv(x, offset)
        fq, fk = self.features(q, is_query=True), self.features(k, is_query=False)
        return fq, fk, v.to(fq.dtype)  # features are float32 or wider; the op wants one dtype

    def _project_out(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, H, N, d = out.shape
        out = out.transpose(1, 2).reshape(B, N, H * d).to(x.dtype)
        return self.dropout(self.to_out(out))

    def forward(self, x: torch.Tensor, *, offset: int = 0, return_state: bool = False):
        """x: `[B, N, dim]` at positions offset .. offset+N-1 -> `[B, N, dim]`.

        With ``return_state`` (causal only) also returns the ``LinearAttentionState`` after the
        last token, to continue with ``step`` at position offset+N.
        """
        if x.dim() != 3 or x.shape[1] == 0:
            raise ValueError(f"x must have shape [B, N, dim] with N >= 1, got {tuple(x.shape)}")
        check_offset(offset)
        if return_state and not self.causal:
            raise ValueError("return_state: a bidirectional layer has no recurrent state")
        if self.causal and self.features.kind == "favor" and not return_state:
            # fused features + RoPE + Eq. 19 with a hand-written backward (same result)
            q, k, v = self._qkv(x, offset)
            out = favor_rotary_attention(
                q, k, v, self.features.projection, rotary=self.position == "rope", offset=offset, base=self.base
            )
            return self._project_out(out, x)
        fq, fk, v = self._features(x, offset)
        res = rotary_linear_attention(
            fq, fk, v, causal=self.causal, rotary=self.position == "rope", offset=offset,
            base=self.base, return_state=return_state,
        )
        if return_state:
            out, state = res
            return self._project_out(out, x), state
        return self._project_out(res, x)

    def step(self, x_t: torch.Tensor, state: LinearAttentionState | None, position: int):
        """Decode one token: x_t `[B, dim]` at ``position`` -> (`[B, dim]`, new state).

        O(1) in the context length: it reads only the `[B, H, m, d]` state.
        """
        if not self.causal:
            raise ValueError("step: a bidirectional layer cannot decode token by token")
        check_offset(position, "position")
        if x_t.dim() != 2:
            raise ValueError(f"x_t must have shape [B, dim], got {tuple(x_t.shape)}")
        fq, fk, v = self._features(x_t.unsqueeze(1), position)  # (B, H, 1, .)
        out, state = rotary_linear_attention_step(
            fq.squeeze(2), fk.squeeze(2), v.squeeze(2), state, position,
            rotary=self.position == "rope", base=self.base,
        )
        return self._project_out(out.unsqueeze(2), x_t).squeeze(1), state
