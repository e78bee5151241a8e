"""RotaryLinearAttention: multi-head linear attention with a choice of RoPE placement.

A drop-in layer: padding masks, packed documents, state in and out, cross-attention and
token-by-token decoding with per-row positions, all on the fast path of ``linear_rope.ops``.
"""
from __future__ import annotations

import torch

from .checks import check_base, check_flag, check_input
from .features import FEATURE_KINDS, FavorFeatures
from .ops import LinearAttentionState, rotary_linear_attention, rotary_linear_attention_step
from .ops.utils import check_cu_seqlens, check_mask
from .projections import HeadProjections, check_sizes
from .rotary import apply_rotary, check_last_position, check_offset, token_positions

__all__ = ["RotaryLinearAttention", "POSITIONS"]

POSITIONS = ("rope", "rope_pre", "rope_norm", "none")

# rope_norm divides by max(row sum of Eq. 19's weights, this floor): rows sum to exactly 1
# wherever the rotated weights sum to >= 0.05, and the output gain is at most 20 elsewhere.
ROW_SUM_FLOOR = 0.05


class RotaryLinearAttention(HeadProjections):
    """Multi-head linear attention, `[B, N, dim]` -> `[B, N, dim]`.

    Args:
        dim: model width.
        heads, dim_head: H heads of d = dim_head dims (q, k, v are projected to H * d).
        nb_features: m, the number of FAVOR+ features (default int(d ln d), even).
        causal: autoregressive (position t sees positions <= t only) or bidirectional.
        position: where the position enters:
            ``"rope"``     RoFormer Eq. 19, RoPE on the features phi(q), phi(k), numerator only;
            ``"rope_pre"`` RoPE on q and k *before* the feature map (performer-pytorch's
                           ``rotary_position_emb``), then plain linear attention;
            ``"rope_norm"`` an ablation of Eq. 19 whose rows sum to 1: the rotated numerator
                           over the *rotated* denominator ``sum_n (R_m phi(q_m))^T (R_n phi(k_n))``,
                           floored at ``ROW_SUM_FLOOR`` times the unrotated one (Eq. 19's rows
                           drift away from 1 because only the numerator is rotated);
            ``"none"``     plain linear attention (Eq. 18), no position information.
        feature_map: ``"favor"``, ``"elu"`` or ``"relu"`` (see ``FavorFeatures``).
        dropout: dropout on the output projection (linear attention never forms the attention
            weights, so there is nothing else to drop).
        base: RoPE base.
        qk_norm: q and k scaled to unit norm, times a learned scale per head, before RoPE and the
            feature map (``QKNorm``): bounded logits and well-conditioned FAVOR+ features.

    The FAVOR+ projection is shared by all heads, as in performer-pytorch; ``self.features``
    owns it and ``self.features.redraw(generator)`` renews it. Cross-attention (``context=``)
    needs ``position="none"`` and ``causal=False``: a query and a context token share no
    position axis, so RoPE between them has no meaning; the layer refuses rather than guess.
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
        qk_norm: bool = False,
    ):
        super().__init__()
        if position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
        check_sizes(dim=dim, heads=heads, dim_head=dim_head)
        if position == "rope_pre" and dim_head % 2:
            raise ValueError(f"dim_head: rope_pre rotates q and k, so it must be even, got {dim_head}")
        if feature_map not in FEATURE_KINDS:
            raise ValueError(f"feature_map must be one of {FEATURE_KINDS}, got {feature_map!r}")
        check_flag("causal", causal), check_flag("qk_norm", qk_norm)
        base = check_base(base)  # a NaN base would make every output NaN, at the first forward
        self.features = FavorFeatures(dim_head, nb_features, kind=feature_map)
        if position in ("rope", "rope_norm") and self.features.out_features % 2:
            raise ValueError(f"nb_features: {position} rotates the features, so m must be even, got {self.features.out_features}")
        self.causal, self.position, self.base = causal, position, base
        self._init_projections(dim, heads, dim_head, dropout, qk_norm)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim_head={self.dim_head}, causal={self.causal}, position={self.position!r}"

    def _op_inputs(self, q, k):
        """FAVOR+ goes inside the op (fused, features never stored); elu / relu before it."""
        if self.features.kind == "favor":
            return q, k, self.features.projection
        return self.features(q, is_query=True), self.features(k, is_query=False), None

    @staticmethod
    def _wide(rotary: bool, v: torch.Tensor) -> bool:
        """Under float16 autocast, RoPE's outputs go to the output projection in float32.

        Eq. 19 divides the rotated numerator by the unrotated denominator, so its gain has no
        bound: where a query's features meet keys that are small on its strongest features but
        large on their rotation partners, outputs reach 1e6 (the ``paper`` preset under float16
        autocast, its third training step), past float16's 65504. Cast to float16 they become
        inf and the output projection NaN. Without RoPE the output is a convex combination of v
        and stays in range; bfloat16 has float32's range."""
        return rotary and v.dtype == torch.float16 and torch.is_autocast_enabled(v.device.type)

    def _ones_column(self, v: torch.Tensor) -> torch.Tensor:
        """rope_norm: a ones column on v, so the op also returns Eq. 19's row sum (rotated
        denominator / unrotated one) as the last output column. Its state has d + 1 columns."""
        if self.position != "rope_norm":
            return v
        return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)

    def _renormalise(self, out: torch.Tensor) -> torch.Tensor:
        if self.position != "rope_norm":
            return out
        return out[..., :-1] / out[..., -1:].clamp_min(ROW_SUM_FLOOR)

    def forward(
        self,
        x: torch.Tensor,
        *,
        offset: int | torch.Tensor = 0,
        mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        initial_state: LinearAttentionState | None = None,
        output_final_state: bool = False,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ):
        """x: `[B, N, dim]` -> `[B, N, dim]` (with ``output_final_state``: ``(out, state)``).

        Args:
            offset: position of token 0, an int or a LongTensor `[B]` per row.
            mask: `[B, N]` bool, True = real token; padding (left or right) adds nothing, gets
                output 0, and the real tokens get what the row gives alone.
            cu_seqlens: int32 `[D+1]`, documents packed in x `[1, T, dim]`: each is its own sequence.
            initial_state, output_final_state: continue from / return the recurrent state
                (``LinearAttentionState``; per document with ``cu_seqlens``).
            context, context_mask: cross-attention to `[B, M, dim]` with `[B, M]` real tokens
                (layers with ``position="none"``, ``causal=False`` only). ``context_mask`` is the
                only mask of the context (None: every context token is real); ``mask`` then masks
                the queries only.
        """
        check_layer_inputs(self, x, context, context_mask, cu_seqlens, initial_state, output_final_state)
        q, k, v = self._qkv(x, context)
        B, N = x.shape[:2]
        if self.position == "rope_pre":  # RoPE on q and k, at the positions the op would use
            mask = None if mask is None else check_mask(mask, "mask", (B, N), x.device)
            if cu_seqlens is not None:
                docs = check_cu_seqlens(cu_seqlens, B, N)
                off = check_offset(offset, rows=len(docs))
                check_last_position(off, max(e - s for s, e in docs))
                pos = token_positions(off, N, mask, device=x.device, docs=docs)
            else:
                offset = check_offset(offset, rows=B)
                check_last_position(offset, N)
                pos = token_positions(offset, N, mask, device=x.device)
            pos = None if pos is None else pos[:, None]  # (B, 1, N): broadcast over heads
            q = apply_rotary(q, offset=offset if pos is None else 0, base=self.base, positions=pos)
            k = apply_rotary(k, offset=offset if pos is None else 0, base=self.base, positions=pos)
        q, k, projection = self._op_inputs(q, k)
        v = self._ones_column(v)
        key_mask = None
        if context is not None:  # context_mask alone masks the context keys; mask is the queries'
            key_mask = context_mask if context_mask is not None else torch.ones(
                context.shape[:2], dtype=torch.bool, device=context.device)
        rotary = self.position in ("rope", "rope_norm")
        wide = self._wide(rotary, v)
        if wide:
            q, k, v = q.float(), k.float(), v.float()
        pos = dict(offset=offset, base=self.base) if rotary else {}  # the op uses them only with RoPE
        if self.position == "none":  # no positions here, but a bad offset is an error as in the other variants
            check_offset(offset, rows=B if cu_seqlens is None else len(check_cu_seqlens(cu_seqlens, B, N)))
        res = rotary_linear_attention(
            q, k, v, causal=self.causal, rotary=rotary, projection=projection, mask=mask, key_mask=key_mask,
            cu_seqlens=cu_seqlens, initial_state=initial_state, output_final_state=output_final_state, **pos,
        )
        out, state = res if output_final_state else (res, None)
        out = self._project_out(self._renormalise(out), x, wide=wide)
        return (out, state) if output_final_state else out

    def step(self, x_t: torch.Tensor, state: LinearAttentionState | None, position: int | torch.Tensor):
        """Decode one token: x_t `[B, dim]` at ``position`` (an int, or a LongTensor `[B]` of
        per-row positions) -> (`[B, dim]`, new state). O(1) in the context length."""
        if not self.causal:
            raise ValueError("step: a bidirectional layer cannot decode token by token")
        if not isinstance(x_t, torch.Tensor) or x_t.dim() != 2 or not x_t.is_floating_point():
            raise ValueError(f"x_t must be a floating-point tensor [B, dim], got {getattr(x_t, 'dtype', type(x_t))} "
                             f"{list(getattr(x_t, 'shape', []))}")
        check_input(x_t, "x_t", "[B, dim]", self.to_qkv.weight)
        position = check_offset(position, "position", rows=x_t.shape[0])
        q, k, v = (t[:, :, 0] for t in self._qkv(x_t.unsqueeze(1), None))  # (B, H, d)
        if self.position == "rope_pre":
            pos = position.view(-1, 1, 1) if isinstance(position, torch.Tensor) else None
            off = 0 if pos is not None else position
            q = apply_rotary(q.unsqueeze(-2), offset=off, base=self.base, positions=pos).squeeze(-2)
            k = apply_rotary(k.unsqueeze(-2), offset=off, base=self.base, positions=pos).squeeze(-2)
        q, k, projection = self._op_inputs(q, k)
        rotary = self.position in ("rope", "rope_norm")
        wide = self._wide(rotary, v)
        if wide:
            q, k, v = q.float(), k.float(), v.float()
        out, state = rotary_linear_attention_step(
            q, k, self._ones_column(v), state, position, rotary=rotary, projection=projection,
            **(dict(base=self.base) if rotary else {}),
        )
        return self._project_out(self._renormalise(out).unsqueeze(2), x_t, wide=wide).squeeze(1), state


def check_layer_inputs(layer: RotaryLinearAttention, x, context, context_mask, cu_seqlens, initial_state,
                       output_final_state) -> None:
    """The layer's input checks: ``x`` `[B, N, dim]`, and cross-attention's ``context`` (a layer
    with position='none' and causal=False, of x's batch and width, without the self-attention
    keywords) and ``context_mask`` (only with ``context``); one-line ValueErrors."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] == 0:
        raise ValueError(f"x must have shape [B, N, dim] with N >= 1, got {getattr(x, 'shape', x)!r}")
    check_input(x, "x", "[B, N, dim]", layer.to_qkv.weight)
    if context_mask is not None and context is None:
        raise ValueError("context_mask: it masks the context of cross-attention, so it has no effect without "
                         "context=; pass mask= for the tokens of x")
    if context is None:
        return
    if layer.position != "none" or layer.causal:
        raise ValueError(
            "context: cross-attention needs a layer with position='none' and causal=False (a query and "
            f"a context token share no position axis); this layer has position={layer.position!r}, "
            f"causal={layer.causal}"
        )
    if not isinstance(context, torch.Tensor) or context.dim() != 3 or context.shape[0] != x.shape[0] \
            or context.shape[2] != x.shape[2] or context.shape[1] == 0:
        raise ValueError(f"context must have shape [B={x.shape[0]}, M, dim={x.shape[2]}], "
                         f"got {list(getattr(context, 'shape', []))}")
    check_input(context, "context", "[B, M, dim]", layer.to_qkv.weight)
    if cu_seqlens is not None or initial_state is not None or output_final_state:
        raise ValueError("context: cross-attention takes no cu_seqlens, initial_state or output_final_state")
