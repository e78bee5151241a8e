"""Rotary linear attention (RoFormer Eq. 19): chunked causal, bidirectional, and recurrent.

Layout for every op here: `[B, H, N, m]` features, `[B, H, N, d]` values. The naive O(N^2)
definitions these are tested against live in ``linear_rope.reference``.

Eq. 19, for non-negative features q = phi(Q), k = phi(K) and RoPE R_n (``apply_rotary``)::

    out_m = sum_{n<=m} (R_m q_m)^T (R_n k_n) v_n  /  sum_{n<=m} q_m^T k_n

The numerator is linear attention over the rotated features; the denominator uses the
unrotated ones, so it stays positive. Causal: the numerator is chunk-parallel (a masked
`[C, C]` product inside each chunk, plus a `[m, d]` state carried across chunks); the
denominator is ``q . cumsum(k)``. Memory is linear in N: the largest tensors are `[N, m]`,
`[N/C, m, d]` and `[N/C, C, C]`; there is no per-token `[N, m, d]` tensor.

All arithmetic (tables, running sums, products) is in float32 or wider; the result has v's
dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .rotary import check_offset, rotary_tables, rotate_with_tables, table_dtype

__all__ = [
    "LinearAttentionState",
    "rotary_linear_attention",
    "rotary_linear_attention_step",
    "DEFAULT_CHUNK_SIZE",
]

DEFAULT_CHUNK_SIZE = 64


class LinearAttentionState(NamedTuple):
    """Recurrent state after a prefix of tokens.

    S: `[B, H, m, d]` sum of (R_n k_n) v_n^T, the rotated numerator state.
    z: `[B, H, m]` sum of k_n, the unrotated key sum of the denominator.
    """

    S: torch.Tensor
    z: torch.Tensor


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotary: bool, seq_dim: bool = True) -> None:
    """ValueError naming the argument for any shape or dtype problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    want = 4 if seq_dim else 3
    layout = "[B, H, N, m]" if seq_dim else "[B, H, m]"
    if q.dim() != want:
        raise ValueError(f"q must have shape {layout}, got {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != want or v.shape[:-1] != q.shape[:-1]:
        vlay = "[B, H, N, d]" if seq_dim else "[B, H, d]"
        raise ValueError(f"v must have shape {vlay} matching q {tuple(q.shape)}, got {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if seq_dim and q.shape[-2] == 0:
        raise ValueError("q: the sequence is empty (N = 0)")
    if rotary and q.shape[-1] % 2:
        raise ValueError(f"q: rotary needs an even feature dim m, got m={q.shape[-1]}")


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # den >= 0; it is 0 only when every feature product is exactly 0 (e.g. relu), where
    # num is 0 too. The guard is the smallest normal number, so it never changes a real ratio.
    return num / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)


def _causal_numerator(rq: torch.Tensor, rk: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """sum_{n<=m} (rq_m . rk_n) v_n, chunk-parallel. rq, rk `[B,H,N,m]`, v `[B,H,N,d]`."""
    B, H, N, m = rq.shape
    d = v.shape[-1]
    C = min(chunk, N)
    pad = (-N) % C
    if pad:  # zero rows add nothing to any sum and their outputs are dropped
        rq, rk, v = (F.pad(t, (0, 0, 0, pad)) for t in (rq, rk, v))
    nc = (N + pad) // C
    rq = rq.reshape(B, H, nc, C, m)
    rk = rk.reshape(B, H, nc, C, m)
    v = v.reshape(B, H, nc, C, d)
    kv = rk.transpose(-1, -2) @ v  # (B, H, nc, m, d) per-chunk state increments
    S = kv.cumsum(2)
    S = torch.cat((torch.zeros_like(S[:, :, :1]), S[:, :, :-1]), dim=2)  # exclusive prefix
    mask = torch.ones(C, C, dtype=torch.bool, device=rq.device).tril()
    attn = (rq @ rk.transpose(-1, -2)).masked_fill(~mask, 0.0)  # (B, H, nc, C, C)
    out = rq @ S + attn @ v  # (B, H, nc, C, d)
    return out.reshape(B, H, nc * C, d)[:, :, :N]


def rotary_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    rotary: bool = True,
    offset: int = 0,
    base: float = 10000.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_state: bool = False,
):
    """Linear attention with RoPE in the numerator only (RoFormer Eq. 19).

    Args:
        q: `[B, H, N, m]` non-negative query features, m even when ``rotary``.
        k: `[B, H, N, m]` non-negative key features.
        v: `[B, H, N, d]` values.
        causal: position m attends to n <= m; otherwise to every n (bidirectional).
        rotary: RoPE on q and k in the numerator (Eq. 19); False gives Eq. 18.
        offset: position of token 0 (positions are offset .. offset+N-1).
        base: RoPE base.
        chunk_size: chunk length of the causal path; any N works.
        return_state: also return the ``LinearAttentionState`` after the last token, to go on
            with ``rotary_linear_attention_step`` at position offset+N.

    Returns:
        `[B, H, N, d]` in v's dtype, or ``(out, state)`` with ``return_state``.
    """
    check_qkv(q, k, v, rotary=rotary)
    check_offset(offset)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    out_dtype = v.dtype
    cdt = table_dtype(q.dtype)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    if rotary:
        cos, sin = rotary_tables(q.shape[-2], q.shape[-1], offset=offset, base=base, dtype=cdt, device=q.device)
        rq, rk = rotate_with_tables(q, cos, sin), rotate_with_tables(k, cos, sin)
    else:
        rq, rk = q, k
    if causal:
        num = _causal_numerator(rq, rk, v, chunk_size)
        den = (q * k.cumsum(-2)).sum(-1)  # (B, H, N)
    else:
        num = rq @ (rk.transpose(-1, -2) @ v)
        den = (q * k.sum(-2, keepdim=True)).sum(-1)
    out = _safe_div(num, den).to(out_dtype)
    if not return_state:
        return out
    return out, LinearAttentionState(rk.transpose(-1, -2) @ v, k.sum(-2))


def rotary_linear_attention_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: LinearAttentionState | None,
    position: int,
    *,
    rotary: bool = True,
    base: float = 10000.0,
):
    """One causal token of Eq. 19 from the recurrent state: O(m d) work, whatever the context.

    Args:
        q_t: `[B, H, m]` non-negative query features of the token at ``position``.
        k_t: `[B, H, m]` non-negative key features.
        v_t: `[B, H, d]` values.
        state: the ``LinearAttentionState`` of the tokens before ``position`` (``None`` at the
            start). It is not modified.
        position: the token's absolute position (the RoPE angle).

    Returns:
        ``(out_t, state)``: `[B, H, d]` in v's dtype, and the state including this token.
    """
    check_qkv(q_t, k_t, v_t, rotary=rotary, seq_dim=False)
    check_offset(position, "position")
    out_dtype = v_t.dtype
    cdt = table_dtype(q_t.dtype)
    q_t, k_t, v_t = q_t.to(cdt), k_t.to(cdt), v_t.to(cdt)
    if rotary:
        cos, sin = rotary_tables(1, q_t.shape[-1], offset=position, base=base, dtype=cdt, device=q_t.device)
        rq, rk = (rotate_with_tables(t.unsqueeze(-2), cos, sin).squeeze(-2) for t in (q_t, k_t))
    else:
        rq, rk = q_t, k_t
    if state is None:
        S = rk.unsqueeze(-1) * v_t.unsqueeze(-2)  # (B, H, m, d)
        z = k_t
    else:
        if state.S.shape != (*q_t.shape, v_t.shape[-1]) or state.z.shape != q_t.shape:
            raise ValueError(
                f"state: S {tuple(state.S.shape)} / z {tuple(state.z.shape)} do not match "
                f"q_t {tuple(q_t.shape)} and v_t {tuple(v_t.shape)}"
            )
        S = state.S.to(cdt) + rk.unsqueeze(-1) * v_t.unsqueeze(-2)
        z = state.z.to(cdt) + k_t
    num = (rq.unsqueeze(-2) @ S).squeeze(-2)  # (B, H, d)
    den = (q_t * z).sum(-1)  # (B, H)
    return _safe_div(num, den).to(out_dtype), LinearAttentionState(S, z)
