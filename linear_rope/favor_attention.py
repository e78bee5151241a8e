"""Fused causal FAVOR+ -> RoPE -> Eq. 19, with a hand-written backward. Memory-lean and fast.

``favor_rotary_attention(q, k, v, projection)`` computes exactly what the two-step path

    rotary_linear_attention(FavorFeatures(q, is_query=True), FavorFeatures(k, is_query=False), v)

computes (readable form: ``reference.linear_attention_ref`` over ``reference.favor_features_ref``),
but it never stores a `[N, m]` tensor for the backward pass, and does most of its work as GEMMs:

* The sequence is walked in blocks of ``block_size`` tokens. Within a block, chunks of C
  tokens run as batched GEMMs: a masked `[C, C]` product inside each chunk plus an `[m, d]`
  state from the chunks before. The state ``S`` and the key sum ``z`` go from block to block.
* The denominator is chunked the same way (a masked `[C, C]` product of the unrotated
  features plus ``phi(q) . z``), so it is GEMMs too, never an N x N matrix or an `[N, m]` cumsum.
* The stabiliser shifts are folded into the projection GEMM (``addmm`` with an extra input
  column), and RoPE is one complex multiplication per tensor.
* Backward walks the blocks in reverse, carrying the suffix sums ``G = sum rq dnum^T`` and
  ``Zq = sum dden phi(q)``, and recomputes each block's features from q and k. Saved for
  backward: q, k, v, the output, the denominator and one `[m, d]` state per block.

Gradient of the stabiliser shifts: the per-token query max and the data-independent key shift
cancel in the ratio, so the gradient ignores them (it equals the unstabilised reference's).
Unlike ``FavorFeatures``, no clamp is applied to the key exponent: it is <= 0 up to round-off.
"""
from __future__ import annotations

import torch

from .features import pair_shift
from .ops import check_qkv
from .rotary import check_offset, rotary_tables, table_dtype

__all__ = ["favor_rotary_attention"]

CHUNK = 64
BLOCK = 256  # tokens per block: small blocks stay in cache (measured best of 64..4096 on 2-core EPYC)


def _features(x, w, wk, c, scale, is_query):
    """x `[BH, T, d]` -> (phi `[BH, T, m]`, x * scale).

    Queries: exp(w.x' + c - max). Keys: exp(w.x' - |x'|^2/2 - c), the |x'|^2/2 entering the
    GEMM as an extra input column against a column of ones in ``wk = [w, 1]``.
    """
    BH, T, d = x.shape
    xs = x * scale
    if is_query:
        a = torch.addmm(c, xs.view(BH * T, d), w.t()).view(BH, T, -1)
        a -= a.amax(-1, keepdim=True)
    else:
        xa = torch.cat((xs, (xs * xs).sum(-1, keepdim=True).mul_(-0.5)), dim=-1)
        a = torch.addmm(-c, xa.view(BH * T, d + 1), wk.t()).view(BH, T, -1)
    return a.exp_(), xs


def _rotate(phi, rot):
    """Interleaved pairs of phi `[BH, T, m]` times the complex table rot `[T, m/2]`."""
    BH, T, m = phi.shape
    return torch.view_as_real(torch.view_as_complex(phi.view(BH, T, m // 2, 2)) * rot).view(BH, T, m)


def _chunks(t, C):
    """`[BH, T, x]` -> `[BH * T/C, C, x]` (batched over chunks for bmm)."""
    BH, T, x = t.shape
    return t.reshape(BH * (T // C), C, x)


def _excl_cumsum(x, start):
    """x `[BH, nc, ...]`: prefix sums before each chunk, starting from ``start``; and the total."""
    inc = x.cumsum(1).add_(start.unsqueeze(1))
    return torch.cat((start.unsqueeze(1), inc[:, :-1]), dim=1), inc[:, -1]


def _excl_suffix(x, end):
    """x `[BH, nc, ...]`: sums after each chunk, plus ``end``; and the total."""
    rev = x.flip(1).cumsum(1).add_(end.unsqueeze(1))  # rev[:, i] = sum of the last i+1 chunks
    return torch.cat((rev[:, :-1].flip(1), end.unsqueeze(1)), dim=1), rev[:, -1]


class _FavorRotaryCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w, wk, c, scale, rot, C, T):
        BH, N, e = v.shape
        m = w.shape[0]
        out = torch.empty_like(v)
        den = torch.empty(BH, N, dtype=v.dtype, device=v.device)
        S, z = v.new_zeros(BH, m, e), v.new_zeros(BH, m)
        S0, z0 = [], []
        for b0 in range(0, N, T):
            b1 = min(b0 + T, N)
            nc = (b1 - b0) // C
            S0.append(S), z0.append(z)
            phq, _ = _features(q[:, b0:b1], w, wk, c, scale, True)
            phk, _ = _features(k[:, b0:b1], w, wk, c, scale, False)
            fq, fk = _chunks(phq, C), _chunks(phk, C)  # unrotated, (BH*nc, C, m)
            zx, z = _excl_cumsum(fk.sum(1).view(BH, nc, m), z)
            dn = (fq @ zx.view(-1, m, 1)).squeeze(-1).add_(torch.bmm(fq, fk.transpose(1, 2)).tril_().sum(-1))
            if rot is not None:
                phq, phk = _rotate(phq, rot[b0:b1]), _rotate(phk, rot[b0:b1])
            rq, rk, vb = _chunks(phq, C), _chunks(phk, C), _chunks(v[:, b0:b1], C)
            Sx, S = _excl_cumsum(torch.bmm(rk.transpose(1, 2), vb).view(BH, nc, m, e), S)
            num = torch.bmm(rq, Sx.view(-1, m, e)).baddbmm_(torch.bmm(rq, rk.transpose(1, 2)).tril_(), vb)
            den[:, b0:b1] = dn.view(BH, -1)
            out[:, b0:b1] = num.view(BH, -1, e) / dn.view(BH, -1, 1)
        ctx.save_for_backward(q, k, v, w, wk, c, rot, out, den, torch.stack(S0), torch.stack(z0))
        ctx.scale, ctx.C, ctx.T = scale, C, T
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, w, wk, c, rot, out, den, S0, z0 = ctx.saved_tensors
        scale, C, T = ctx.scale, ctx.C, ctx.T
        BH, N, e = v.shape
        m = w.shape[0]
        g = g.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        G = v.new_zeros(BH, m, e)  # sum over later tokens of rq_n dnum_n^T
        Zq = v.new_zeros(BH, m)  # sum over later tokens of dden_n phi(q_n)
        for i, b0 in reversed(list(enumerate(range(0, N, T)))):
            b1 = min(b0 + T, N)
            nc = (b1 - b0) // C
            gb, dn = g[:, b0:b1], den[:, b0:b1]
            dnum = gb / dn.unsqueeze(-1)  # (BH, t, e)
            dden = (gb * out[:, b0:b1]).sum(-1).div_(dn).neg_()  # (BH, t)
            phq, _ = _features(q[:, b0:b1], w, wk, c, scale, True)
            phk, xks = _features(k[:, b0:b1], w, wk, c, scale, False)
            fq, fk = _chunks(phq, C), _chunks(phk, C)
            # denominator den_n = phq_n . (z0 + sum_{j <= n} phk_j), chunked
            Md = dden.view(-1, C, 1).expand(-1, C, C).tril()  # Md[n, j] = dden_n for j <= n
            zx, _ = _excl_cumsum(fk.sum(1).view(BH, nc, m), z0[i])
            Zc = torch.bmm(dden.view(-1, 1, C), fq).view(BH, nc, m)
            Zx, Zq = _excl_suffix(Zc, Zq)
            dfq = torch.bmm(Md, fk).addcmul_(dden.view(-1, C, 1), zx.view(-1, 1, m))
            dfk = torch.bmm(Md.transpose(1, 2), fq).add_(Zx.view(-1, 1, m))
            # numerator: chunked linear attention on the rotated features
            if rot is not None:
                rb = rot[b0:b1]
                rq, rk = _chunks(_rotate(phq, rb), C), _chunks(_rotate(phk, rb), C)
            else:
                rq, rk = fq, fk
            vb, dnb = _chunks(v[:, b0:b1], C), _chunks(dnum, C)
            Sx, _ = _excl_cumsum(torch.bmm(rk.transpose(1, 2), vb).view(BH, nc, m, e), S0[i])
            Gx, G = _excl_suffix(torch.bmm(rq.transpose(1, 2), dnb).view(BH, nc, m, e), G)
            Sx, Gx = Sx.view(-1, m, e), Gx.view(-1, m, e)
            P = torch.bmm(dnb, vb.transpose(1, 2)).tril_()  # P[n, j] = dnum_n . v_j, j <= n
            A = torch.bmm(rq, rk.transpose(1, 2)).tril_()
            drq = torch.bmm(dnb, Sx.transpose(1, 2)).baddbmm_(P, rk)
            drk = torch.bmm(vb, Gx.transpose(1, 2)).baddbmm_(P.transpose(1, 2), rq)
            dv[:, b0:b1] = torch.bmm(rk, Gx).baddbmm_(A.transpose(1, 2), dnb).view(BH, -1, e)
            if rot is not None:
                rb = rot[b0:b1].conj()
                drq, drk = _rotate(drq.view(BH, -1, m), rb), _rotate(drk.view(BH, -1, m), rb)
            # phi = exp(a), so da = dphi * phi; then back through the projection GEMM
            da = dfq.view(BH, -1, m).add_(drq.view(BH, -1, m)).mul_(phq)
            dq[:, b0:b1] = (da @ w).mul_(scale)
            db = dfk.view(BH, -1, m).add_(drk.view(BH, -1, m)).mul_(phk)
            dk[:, b0:b1] = (db @ w).sub_(xks * db.sum(-1, keepdim=True)).mul_(scale)
        return dq, dk, dv, None, None, None, None, None, None, None


def favor_rotary_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    *,
    rotary: bool = True,
    offset: int = 0,
    base: float = 10000.0,
    chunk_size: int = CHUNK,
    block_size: int = BLOCK,
) -> torch.Tensor:
    """Causal FAVOR+ attention with RoPE on the features, numerator only (Eq. 19), fused.

    Args:
        q, k: `[B, H, N, d]` queries and keys (before the feature map).
        v: `[B, H, N, e]` values.
        projection: `[m, d]` FAVOR+ projection (``FavorFeatures.projection``), m even if rotary.
        rotary: Eq. 19 (True) or plain FAVOR+ linear attention, Eq. 18 (False).
        offset: position of token 0.
        chunk_size, block_size: the chunk of the masked products and the block walked at once
            (memory is O(block_size * m) plus O(N / block_size * m * e)).

    Returns:
        `[B, H, N, e]` in v's dtype; float32 or wider inside.
    """
    check_qkv(q, k, v, rotary=False)
    check_offset(offset)
    m, d = projection.shape
    if d != q.shape[-1]:
        raise ValueError(f"projection must be [m, d={q.shape[-1]}], got {tuple(projection.shape)}")
    if rotary and m % 2:
        raise ValueError(f"projection: rotary needs an even number of features m, got m={m}")
    if chunk_size < 1 or block_size < 1:
        raise ValueError(f"chunk_size and block_size must be positive, got {chunk_size}, {block_size}")
    B, H, N, e = v.shape
    out_dtype = v.dtype
    cdt = table_dtype(q.dtype)
    C = min(chunk_size, N)
    T = max(C, block_size // C * C)
    pad = (-N) % C  # trailing zero tokens only affect their own (dropped) outputs
    q, k, v = (torch.nn.functional.pad(t.to(cdt), (0, 0, 0, pad)).reshape(B * H, N + pad, -1).contiguous() for t in (q, k, v))
    w = projection.to(cdt)
    c = pair_shift(w)
    wk = torch.cat((w, torch.ones_like(w[:, :1])), dim=1)  # (m, d + 1)
    rot = None
    if rotary:
        cos, sin = rotary_tables(N + pad, m, offset=offset, base=base, dtype=cdt, device=q.device)
        rot = torch.complex(cos, sin)  # (N, m/2)
    out = _FavorRotaryCausal.apply(q, k, v, w, wk, c, d**-0.25, rot, C, T)
    return out.view(B, H, N + pad, e)[:, :, :N].to(out_dtype)
