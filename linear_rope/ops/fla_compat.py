"""Eq. 19 in fla's layout and signature: ``chunk_rotary_linear_attn``, `[B, T, H, .]` in and out.

flash-linear-attention (fla, v0.5+) writes every op as ``chunk_xxx(q, k, v, scale=None,
initial_state=None, output_final_state=False, cu_seqlens=None) -> (o, final_state)`` over
`[B, T, H, D]` tensors. This is a thin wrapper over ``rotary_linear_attention`` (`[B, H, N, d]`,
``api.py``): the same paths (the chunked custom op on the CPU, the chunk-parallel path on CUDA), the
same checks and the same state, behind fla's names, with this op's own options keyword-only.
q, k and v are transposed into one contiguous copy each, the output back as a view
(what the transposes cost at N = 4096: ``benchmarks/results/fla_layout.json``, made at commit c250ff9).
"""
from __future__ import annotations

import warnings

import torch

from .api import rotary_linear_attention
from .utils import LinearAttentionState

__all__ = ["chunk_rotary_linear_attn"]


def _heads_first(name: str, t) -> torch.Tensor:
    """`[B, T, H, x]` -> `[B, H, T, x]`, contiguous: the op lays its input out contiguously
    anyway (one copy either way), and autograd then keeps this copy for the backward, which would
    otherwise copy the transposed view again."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor [B, T, H, .] (fla's layout), got {got}")
    return t.transpose(1, 2).contiguous()


def chunk_rotary_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: LinearAttentionState | tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    projection: torch.Tensor | None = None,
    rotary: bool = True,
    offset: int | torch.Tensor = 0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Causal Eq. 19 on q, k, v in fla's layout `[B, T, H, d]` (not `[B, H, T, d]`), out `[B, T, H, e]`.

    Causal linear attention with RoPE in the numerator only (RoFormer Eq. 19). A heads-first
    tensor has the same rank and is not an error in itself, so, as fla's own ops do, a call
    whose sequence axis is shorter than its head axis (1 < T < H, where heads-first input
    usually shows) warns: check the layout (``rotary_linear_attention`` takes `[B, H, N, d]`).

    Args:
        q, k: `[B, T, H, m]` non-negative features; or, with ``projection``, raw queries and keys
            `[B, T, H, d]` whose FAVOR+ features are computed inside.
        v: `[B, T, H, e]` values.
        scale: as in fla's ``chunk_linear_attn``: a factor on q, in the numerator and in the
            normaliser alike (None: fla's default ``1 / sqrt(q.shape[-1])``). On features it
            cancels in Eq. 19's ratio, whose normalisation is always on (fla's ``normalize=True``
            cancels it too, up to its 1e-10), and it leaves the state alone (a sum over keys),
            so it is checked and not multiplied in: the result is that of ``q * scale`` up to
            rounding, at no cost. With ``projection`` it is the temperature of the softmax
            kernel that FAVOR+ estimates, ``exp(scale * q.k)``: FAVOR+ holds ``1 / sqrt(d)``
            already (q and k each times ``d ** -0.25``), so q is multiplied by
            ``scale * sqrt(d)``, and not touched at the default.
        initial_state: the state of the tokens before these: ``LinearAttentionState(S, z)`` (or
            an ``(S, z)`` pair), S `[B, H, m, e]`, z `[B, H, m]` (one row per document with
            ``cu_seqlens``), as ``rotary_linear_attention`` and the decoding step use it. fla's
            own ``(kv, z)`` states hold unrotated sums and do not mix with these.
        output_final_state: also return the state after the last token (else None, as fla).
        cu_seqlens: int32 / int64 `[D+1]` cumulative lengths of D documents packed in one row
            (B = 1); each gets what it gets alone (positions and state restart).
        projection: `[m, d]` FAVOR+ projection (``FavorFeatures.projection``), no gradient.
        rotary: RoPE on the features in the numerator (Eq. 19); False gives Eq. 18.
        offset: position of token 0, an int or a LongTensor `[B]` per row (`[D]` per document).
        mask: `[B, T]` bool, True = real token: padded keys add nothing, padded queries give 0,
            positions count real tokens, so a padded row gives what it gives alone.

    Returns:
        ``(o, final_state)``: o `[B, T, H, e]` in v's dtype (a transposed view of the op's
        `[B, H, T, e]` result; ``.contiguous()`` it where a packed layout is needed), and the
        ``LinearAttentionState`` or None.
    """
    qh, kh, vh = _heads_first("q", q), _heads_first("k", k), _heads_first("v", v)
    if 1 < q.shape[1] < q.shape[2]:
        warnings.warn(f"chunk_rotary_linear_attn: q has {q.shape[1]} tokens and {q.shape[2]} heads (T < H): were "
                      f"the inputs passed heads-first, [B, H, T, d]? This op takes fla's [B, T, H, d]", stacklevel=2)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
                              or scale == float("inf")):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if projection is not None and scale is not None:
        factor = float(scale) / q.shape[-1] ** -0.5  # exactly 1 at fla's default
        qh = qh if factor == 1.0 else qh * factor
    res = rotary_linear_attention(qh, kh, vh, causal=True, rotary=rotary, offset=offset, projection=projection,
                                  mask=mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                  output_final_state=output_final_state)
    o, state = res if output_final_state else (res, None)
    return o.transpose(1, 2), state
