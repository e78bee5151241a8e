"""Eq. 19 written out in full: the O(N^2) reference every fast path is tested against.

RoFormer Eq. 19 (``rotary=True``; Eq. 18 without R), for non-negative features
phi(q), phi(k) and the RoPE rotation R_p of position p (Eq. 34)::

    out_t = sum_n (R_{p_t} phi(q_t))^T (R_{p_n} phi(k_n)) v_n  /  sum_n phi(q_t)^T phi(k_n)

The sums run over the keys n that query t may see: the same row and packed document, a real
token (``mask`` / ``key_mask``), and n <= t when ``causal``. An ``initial_state`` (S0, z0) adds
``(R_{p_t} phi(q_t))^T S0`` to the numerator and ``phi(q_t)^T z0`` to the denominator.

This file builds the explicit `[N, M]` weights, is written for reading, not speed, and shares
no arithmetic with the fast paths: RoPE goes through complex numbers here, real tables there,
and the angle p theta_i is reduced modulo 2 pi in exact integer arithmetic (Python ints) here,
in float64 limbs there. Padding is dropped by selection, never by multiplying by 0 (0 * NaN is
NaN): whatever a masked token holds, the real tokens get what they get without it.
Run it in float64.
"""
from __future__ import annotations

from fractions import Fraction

import torch

from ..features import favor_features
from ..rotary import PI
from .utils import LinearAttentionState, Options, check_args

_BITS = 192  # fixed-point bits of a turn: exact for every |p| < 2**63 (error below 2**-120)

__all__ = ["naive_rotary_linear_attention", "eq19_weights", "rotate_naive"]


def rotate_naive(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE, Eq. 34: pair (2i, 2i+1) is the complex number x[2i] + i x[2i+1], times
    exp(i p theta_i) with theta_i = base^(-2i/m). x `[..., N, m]`, integer positions
    broadcastable to `x.shape[:-1]`."""
    m = x.shape[-1]
    angle = _angles(positions.to(x.device), [base ** (-2.0 * i / m) for i in range(m // 2)])  # (..., N, m/2)
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2).to(x.dtype)


def _angles(positions: torch.Tensor, thetas: list[float]) -> torch.Tensor:
    """p * theta_i modulo 2 pi `[..., len(thetas)]` in float64, for integer positions `[...]`: a
    turn per position theta_i / 2 pi in ``_BITS``-bit fixed point, times p, modulo one turn, all
    in Python ints (exact), then one rounding to float64."""
    one = 1 << _BITS
    turns = [round(Fraction(t) / (2 * PI) * one) for t in thetas]
    uniq, where = torch.unique(positions.long(), return_inverse=True)
    rows = [[(p * u % one) / one for u in turns] for p in uniq.tolist()]
    table = torch.tensor(rows, dtype=torch.float64, device=positions.device).view(len(rows), len(thetas))
    return table[where] * (2 * torch.pi)


def _layout(q, k, a):
    """Per token: positions `[B, N]`, segment ids `[B, N]` / `[B, M]` (the state each token uses:
    its row, or its document when packed), and the query / key masks."""
    B, _, N, _ = q.shape
    M = k.shape[2]
    qmask = a.qmask if a.qmask is not None else torch.ones(B, N, dtype=torch.bool, device=q.device)
    kmask = a.kmask if a.kmask is not None else torch.ones(B, M, dtype=torch.bool, device=q.device)
    if a.docs is None:
        seg_q = torch.arange(B, device=q.device)[:, None].expand(B, N)
        seg_k = torch.arange(B, device=q.device)[:, None].expand(B, M)
    else:
        seg = [torch.full((1, e - s), d, device=q.device) for d, (s, e) in enumerate(a.docs)]
        seg_q = seg_k = torch.cat(seg, dim=1)
    pos = a.positions  # (resolved once by check_args; None: offset .. offset+N-1, or no rotary)
    if pos is None:
        pos = torch.arange(N, device=q.device)[None].expand(B, N) + (a.offset if isinstance(a.offset, int) else 0)
    return pos, seg_q, seg_k, qmask, kmask


def _weights(q, k, *, causal, rotary, base, projection, a):
    """Eq. 19's numerator weights `[B, H, N, M]` and denominator `[B, H, N]` (state not included),
    and the per-token features and layout."""
    fq = q if projection is None else favor_features(q, projection, is_query=True)
    fk = k if projection is None else favor_features(k, projection, is_query=False)
    pos, seg_q, seg_k, qmask, kmask = _layout(q, k, a)
    rq = rotate_naive(fq, pos[:, None], base) if rotary else fq  # (positions broadcast over heads)
    rk = rotate_naive(fk, pos[:, None], base) if rotary else fk
    real_k = kmask[:, None, :, None]
    fk, rk = torch.where(real_k, fk, 0), torch.where(real_k, rk, 0)  # padded keys are dropped, not multiplied
    see = (seg_q[:, :, None] == seg_k[:, None, :]) & kmask[:, None, :]  # (B, N, M)
    if causal:
        see = see & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    a_num = torch.where(see[:, None], rq @ rk.transpose(-1, -2), 0)  # rotated: Eq. 19's numerator
    a_den = torch.where(see[:, None], fq @ fk.transpose(-1, -2), 0)  # unrotated, so positive
    return a_num, a_den.sum(-1), (fq, fk, rq, rk, seg_q, seg_k, qmask, kmask)


def naive_rotary_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    rotary: bool = True,
    offset: int | torch.Tensor = 0,
    base: float = 10000.0,
    projection: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    output_final_state: bool = False,
    allow_negative: bool = False,
):
    """The reference for ``linear_rope.rotary_linear_attention``: same signature, same result."""
    a = check_args(q, k, v, Options(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection,
                   mask=mask, key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                   allow_negative=allow_negative, output_final_state=output_final_state))
    if a.qmask is not None:  # padding is replaced by 0 before anything reads it (its gradient is then 0)
        q = torch.where(a.qmask[:, None, :, None], q, 0)
    if a.kmask is not None:
        k, v = (torch.where(a.kmask[:, None, :, None], t, 0) for t in (k, v))
    a_num, den, (fq, fk, rq, rk, seg_q, seg_k, qmask, kmask) = _weights(
        q, k, causal=causal, rotary=rotary, base=base, projection=projection, a=a)
    num = a_num @ v.to(a_num.dtype)  # (B, H, N, e)
    if a.state is not None:  # each query's row / document state
        S0 = a.state.S.to(num.dtype)[seg_q].transpose(1, 2)  # (B, H, N, m, e)
        z0 = a.state.z.to(num.dtype)[seg_q].transpose(1, 2)  # (B, H, N, m)
        num = num + (rq.unsqueeze(-2) @ S0).squeeze(-2)
        den = den + (fq * z0).sum(-1)
    # A query whose denominator is <= 0 divides by 1: one that sees no key at all (a masked row)
    # gets 0, its numerator is 0 as well. A NaN denominator stays NaN (it is not "<= 0").
    out = num / torch.where(den <= 0, 1, den).unsqueeze(-1)
    out = torch.where(qmask[:, None, :, None], out, 0).to(v.dtype)
    if not output_final_state:
        return out
    rows = q.shape[0] if a.docs is None else len(a.docs)
    own = ((seg_k[..., None] == torch.arange(rows, device=q.device)) & kmask[..., None]).to(rk.dtype)  # (B, M, rows)
    S = torch.einsum("bnr,bhnm,bhne->rhme", own, rk, v.to(rk.dtype))  # every real key, into its state
    z = torch.einsum("bnr,bhnm->rhm", own, fk)
    if a.state is not None:
        S, z = S + a.state.S.to(S.dtype), z + a.state.z.to(z.dtype)
    return out, LinearAttentionState(S, z)


def eq19_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    rotary: bool = True,
    offset: int = 0,
    base: float = 10000.0,
    projection: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The effective attention matrix `[B, H, N, N]` of Eq. 19: ``out = W @ v``.

    Its rows sum to 1 only without rotation: Eq. 19 rotates the numerator alone.
    """
    v = q.new_zeros(q.shape[:-1] + (1,))
    a = check_args(q, k, v, Options(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection,
                   mask=mask, key_mask=None, cu_seqlens=None, initial_state=None, allow_negative=False))
    a_num, den, _ = _weights(q, k, causal=causal, rotary=rotary, base=base, projection=projection, a=a)
    return a_num / torch.where(den <= 0, 1, den).unsqueeze(-1)
