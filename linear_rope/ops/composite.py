"""The causal path in plain differentiable torch ops: what a call takes under the ``torch.func``
transforms (``vmap``, ``grad``, ``jacrev``, ``jvp``, ``jacfwd``) and with forward-mode AD
(``torch.autograd.forward_ad``).

The custom op of ``chunk_op.py`` has a hand-written backward and nothing else: forward-mode AD
through it would give a zero tangent, and ``vmap`` has no rule for it. Here the chunk form of
``chunk_fwd.py`` is written with out-of-place ops that PyTorch differentiates in both modes
(and to any order) and batches: the masked `[C, C]` products inside each chunk, the per-chunk
states ``rk^T v`` and their exclusive prefix sums from the initial state. Memory is
O(N C + N / C * m e) as on the fast path; time is a few times the fast path's (no buffers
kept, no in-place walk), which is the price of the transforms.

Layout `[B, H, N, x]`. Inputs come checked, in the compute dtype, padding already dropped (zero)
and scaled (``prepare.run_torch``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..features import favor_features
from ..rotary import rotary_tables, rotate_with_tables
from .layout import OpConfig

__all__ = ["composite_causal"]


def _chunked(fq, fk, rq, rk, v, S0, z0, C: int):
    """One row or document: features `[B, H, n, m]` (rq is fq without rotation), v `[B, H, n, e]`,
    the state before it -> out `[B, H, n, e]`, S, z after it."""
    n = v.shape[2]
    C = max(1, min(C, n))
    nc = -(-n // C)

    def chunks(t):  # (B, H, n, x) -> (B, H, nc, C, x), zero-padded
        return F.pad(t, (0, 0, 0, nc * C - n)).unflatten(2, (nc, C))

    rotated = rq is not fq
    fq, fk, v = chunks(fq), chunks(fk), chunks(v)
    rq, rk = (chunks(rq), chunks(rk)) if rotated else (fq, fk)
    tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    A = torch.where(tril, rq @ rk.transpose(-1, -2), 0)  # (B, H, nc, C, C)
    Ad = torch.where(tril, fq @ fk.transpose(-1, -2), 0) if rotated else A  # unrotated: the denominator
    Sc, zc = rk.transpose(-1, -2) @ v, fk.sum(-2)  # each chunk's (B, H, nc, m, e), (B, H, nc, m)
    Sb = S0.unsqueeze(2) + F.pad(Sc.cumsum(2), (0, 0, 0, 0, 1, 0))[:, :, :nc]  # the state before each chunk
    zb = z0.unsqueeze(2) + F.pad(zc.cumsum(2), (0, 0, 1, 0))[:, :, :nc]
    num = rq @ Sb + A @ v
    den = (fq @ zb.unsqueeze(-1)).squeeze(-1) + Ad.sum(-1)
    out = num / torch.where(den <= 0, 1, den).unsqueeze(-1)  # as naive: <= 0 divides by 1, NaN stays NaN
    return out.flatten(2, 3)[:, :, :n], S0 + Sc.sum(2), z0 + zc.sum(2)


def features(q, k, w, kmask):
    """phi(q), phi(k): FAVOR+ with the projection ``w``, else q, k as given (features in);
    padded keys (``kmask`` `[B, N]` False) selected away, never multiplied by 0."""
    fq = q if w is None else favor_features(q, w, is_query=True)
    fk = k if w is None else favor_features(k, w, is_query=False)
    if kmask is not None:
        fk = torch.where(kmask[:, None, :, None], fk, 0)
    return fq, fk


def composite_causal(q, k, v, w, a, cfg: OpConfig):
    """Causal Eq. 19 (Eq. 18 without ``cfg.rotary``) on the checked arguments ``a``: q, k
    `[B, H, N, d or m]` (d with the projection ``w``), v `[B, H, N, e]` -> out, S, z (per row, or
    per packed document: none of them empty)."""
    B, H, N, e = v.shape
    fq, fk = features(q, k, w, a.kmask)
    rq, rk = fq, fk
    if cfg.rotary:
        cos, sin = rotary_tables(N, a.m, offset=cfg.offset, base=cfg.base, dtype=v.dtype, device=v.device,
                                 positions=a.positions)
        if cos.dim() == 3:  # per row: broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        rq, rk = rotate_with_tables(fq, cos, sin), rotate_with_tables(fk, cos, sin)
    docs = a.docs or [(0, N)]
    outs, Ss, zs = [], [], []
    for d, (s, t) in enumerate(docs):
        rows = slice(None) if a.docs is None else slice(d, d + 1)
        if a.state is None:
            n = B if a.docs is None else 1
            S0, z0 = v.new_zeros(n, H, a.m, e), v.new_zeros(n, H, a.m)
        else:
            S0, z0 = a.state.S[rows].to(v.dtype), a.state.z[rows].to(v.dtype)
        o, S, z = _chunked(*(x[:, :, s:t] for x in (fq, fk, rq, rk, v)), S0, z0, cfg.C)
        outs.append(o), Ss.append(S), zs.append(z)
    out = torch.cat(outs, dim=2)
    if a.qmask is not None:
        out = torch.where(a.qmask[:, None, :, None], out, 0)
    return out, torch.cat(Ss), torch.cat(zs)
