"""The recurrent path of Eq. 19: one causal token from the state, O(m e) work whatever the context.

Eq. 19 for the token at position p, from the state (S, z) of the tokens before it::

    S' = S + (R_p phi(k)) v^T,   z' = z + phi(k),   out = (R_p phi(q))^T S' / phi(q)^T z'

``recurrent_rotary_linear_attention`` walks a whole sequence this way, with the signature and
the return type of the chunked and naive paths.
"""
from __future__ import annotations

import torch

from ..features import favor_features
from ..rotary import check_offset, rotary_tables, rotate_with_tables, table_dtype
from .utils import LinearAttentionState, Options, check_args, check_final_state, normalise_scale

__all__ = ["rotary_linear_attention_step", "recurrent_rotary_linear_attention"]


def rotary_linear_attention_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: LinearAttentionState | None,
    position: int | torch.Tensor,
    *,
    rotary: bool = True,
    base: float = 10000.0,
    projection: torch.Tensor | None = None,
    allow_negative: bool = False,
):
    """One causal token of ``rotary_linear_attention`` from the recurrent state.

    Args:
        q_t, k_t: `[B, H, m]` non-negative features of the token (or raw `[B, H, d]` with
            ``projection``, as in ``rotary_linear_attention``).
        v_t: `[B, H, e]` values.
        state: the ``LinearAttentionState`` of the tokens before (``None`` at the start). It is
            not modified.
        position: the token's position (the RoPE angle): an int, or a LongTensor `[B]` per row
            (ragged batches: each row's number of real tokens so far, plus its offset), at most
            ``linear_rope.rotary.MAX_POSITION`` = 2**62 - 1.
        rotary, base, projection, allow_negative: as in ``rotary_linear_attention`` (a ``base``
            other than the default with ``rotary=False``, or ``allow_negative`` with
            ``projection``, has no effect and is refused).

    Returns:
        ``(out_t, state)``: `[B, H, e]` in v's dtype, and the state including this token.
    """
    for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor [B, H, .] (one token), got {got}")
    B = q_t.shape[0]
    position = check_offset(position, "position", rows=B, read=True)  # (the step reads its arguments' values)
    a = check_args(q_t[:, :, None], k_t[:, :, None], v_t[:, :, None],
                   Options(rotary=rotary, offset=position if rotary else 0, base=base, projection=projection,
                           initial_state=state, allow_negative=allow_negative), state_name="state")
    out_dtype = v_t.dtype
    cdt = table_dtype(q_t.dtype)
    state, sk = a.state, None
    with torch.autocast(q_t.device.type, enabled=False):
        q_t, k_t, v_t = q_t.to(cdt), k_t.to(cdt), v_t.to(cdt)
        if projection is not None:
            q_t = favor_features(q_t, projection, is_query=True)
            k_t = favor_features(k_t, projection, is_query=False)
        elif q_t.numel() and k_t.numel():  # as the chunked path: the same output at any feature scale
            qs, ks, state, sk = normalise_scale(q_t.unsqueeze(2), k_t.unsqueeze(2), None, state)
            q_t, k_t = qs.squeeze(2), ks.squeeze(2)
        if rotary:
            pos = position.view(B, 1, 1) if isinstance(position, torch.Tensor) else None
            cos, sin = rotary_tables(1, a.m, offset=0 if pos is not None else position, base=base, dtype=cdt,
                                     device=q_t.device, positions=pos)
            rq, rk = (rotate_with_tables(t.unsqueeze(-2), cos, sin).squeeze(-2) for t in (q_t, k_t))
        else:
            rq, rk = q_t, k_t
        S = rk.unsqueeze(-1) * v_t.unsqueeze(-2)  # (B, H, m, e)
        z = k_t
        if state is not None:
            S, z = state.S.to(cdt) + S, state.z.to(cdt) + z
        num = (rq.unsqueeze(-2) @ S).squeeze(-2)  # (B, H, e)
        den = (q_t * z).sum(-1)  # (B, H)
        out = num / torch.where(den <= 0, 1, den).unsqueeze(-1)  # as naive: <= 0 divides by 1, NaN stays NaN
    return out.to(out_dtype), (LinearAttentionState(S, z) if sk is None else check_final_state(S, z, sk))


def recurrent_rotary_linear_attention(
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
    """The recurrent path over a whole sequence: the signature and the result of
    ``rotary_linear_attention`` (causal only), token by token through
    ``rotary_linear_attention_step``, as decoding runs it. O(N) Python steps: a reference for
    decoding, not a fast path. Tensors `[B, H, N, .]`; returns `[B, H, N, e]` or ``(out, state)``.
    """
    a = check_args(q, k, v, Options(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection,
                   mask=mask, key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                   allow_negative=allow_negative, output_final_state=output_final_state))
    if not causal:
        raise ValueError("causal: the recurrent path walks tokens in order; it is causal only")
    B, H, N, e = q.shape[:3] + v.shape[-1:]
    if a.kmask is not None:  # padding dropped by selection (0 * NaN is NaN), as on the fast path
        q, k, v = (torch.where(a.kmask[:, None, :, None], t, 0) for t in (q, k, v))
    docs = [(0, N)] if a.docs is None else a.docs
    outs, states = [], []
    for d, (s, end) in enumerate(docs):
        rows = slice(None) if a.docs is None else slice(d, d + 1)
        state = None if a.state is None else LinearAttentionState(a.state.S[rows], a.state.z[rows])
        for t in range(s, end):
            pos = a.positions[:, t] if a.positions is not None else a.offset + t - s
            rot = dict(base=base) if rotary else {}
            o, new = rotary_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, pos, rotary=rotary,
                                                  projection=projection, allow_negative=projection is None, **rot)
            if a.kmask is not None:  # a masked token leaves the state as it was and outputs 0
                real = a.kmask[:, t].view(B, 1, 1)
                old = state or LinearAttentionState(torch.zeros_like(new.S), torch.zeros_like(new.z))
                new = LinearAttentionState(torch.where(real[..., None], new.S, old.S), torch.where(real, new.z, old.z))
                o = torch.where(real, o, 0)
            outs.append(o)
            state = new
        if state is None:  # an empty document (or N = 0) without an initial state
            n = B if a.docs is None else 1
            cdt = table_dtype(q.dtype)
            state = LinearAttentionState(v.new_zeros(n, H, a.m, e, dtype=cdt), v.new_zeros(n, H, a.m, dtype=cdt))
        states.append(state)
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, e)
    if not output_final_state:
        return out
    return out, LinearAttentionState(torch.cat([st.S for st in states]), torch.cat([st.z for st in states]))
