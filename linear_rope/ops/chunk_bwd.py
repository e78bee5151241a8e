"""The backward of the chunked causal path: one block's gradients, and the reverse walk.

The same shapes as the forward (``chunk_fwd``), in reverse: suffix sums ``G = sum rq dnum^T``
and ``Zq = sum dden phi(q)`` over the chunks after each one (also the gradients of the initial
state), the masked `[C, C]` products inside each chunk, and FAVOR+'s chain rule back through
the projection GEMM (``phi = exp(a)``, so ``da = dphi * phi``).
"""
from __future__ import annotations

import torch

from .chunk_fwd import block_features, block_rot, block_slices, bmm_batch, chunk_major, prefix_, rotate, safe_den, select

__all__ = ["causal_backward"]


def suffix_(buf, resets=None):
    """In place: buf[c] = buf[c] + ... + buf[-1] (buf[-1] the sums after the block).

    ``resets`` {c: sums}: chunk c starts a packed document; the sums after chunk c - 1 are then
    ``sums`` (the gradient of the previous document's final state). Returns {c: the sums from
    chunk c on} (the gradient of that document's initial state).
    """
    starts = {}
    for c in range(buf.shape[0] - 2, -1, -1):
        if resets and c + 1 in resets:
            starts[c + 1] = buf[c + 1].clone()
            buf[c + 1] = resets[c + 1]
        buf[c] += buf[c + 1]
    return starts


def _states(phk, vals, state0, kept_S, resets):
    """The state before each chunk `[nc+1, BH, m, x]`: kept by the forward, or again."""
    if kept_S is not None:
        return kept_S
    nc, BH, _, m = phk.shape
    Sb = vals.new_empty(nc + 1, BH, m, vals.shape[-1])
    Sb[0] = state0
    torch.bmm(bmm_batch(phk).transpose(1, 2), bmm_batch(vals), out=bmm_batch(Sb[1:]))
    prefix_(Sb, resets)
    return Sb


def _suffix_sums(left, right, after, resets):
    """Gb `[nc+1, BH, m, x]`: Gb[c] = sum over chunks >= c of left^T right, Gb[nc] = ``after``."""
    nc, BH, _, m = left.shape
    Gb = right.new_empty(nc + 1, BH, m, right.shape[-1])
    Gb[nc] = after
    torch.bmm(bmm_batch(left).transpose(1, 2), bmm_batch(right), out=bmm_batch(Gb[:nc]))
    return Gb, suffix_(Gb, resets)


def _numerator(rq, rk, vals, dvals, Sb, Gb, A):
    """Gradients of ``num = rq S + tril(rq rk^T) vals`` chunked: d rq, d rk, d vals (flat batches)."""
    P = torch.bmm(bmm_batch(dvals), bmm_batch(vals).transpose(1, 2)).tril_()  # P[n, j] = dvals_n . vals_j, j <= n
    A = A if A is not None else torch.bmm(bmm_batch(rq), bmm_batch(rk).transpose(1, 2)).tril_()
    drq = torch.bmm(bmm_batch(dvals), bmm_batch(Sb).transpose(1, 2)).baddbmm_(P, bmm_batch(rk))
    drk = torch.bmm(bmm_batch(vals), bmm_batch(Gb).transpose(1, 2)).baddbmm_(P.transpose(1, 2), bmm_batch(rq))
    return drq, drk, A


def block_backward(walk, blk, grads, state0, sums, kept, resets):
    """Gradients of one block. blk as in ``chunk_fwd.block_forward``; grads (g, out `[BH, t, e]`,
    den chunk-major `[nc, BH, C]`); state0 (S0, z0) before the block; sums (G, Zq) after it.
    ``resets`` {c: ((S0, z0), (gS, gz))}: packed documents starting at chunks c >= 1, with their
    initial states and the gradients of the final states of the documents before them.
    Returns dq, dk, dv chunk-major, the suffix sums before the block, and {c: (dS0, dz0)}."""
    q, k, v, km, sl = blk
    g, out, den = grads
    C = walk.C
    BH, t, e = v.shape
    m, nc = state0[0].shape[1], t // C
    kmc = None if km is None else chunk_major(km.unsqueeze(-1), C).squeeze(-1)
    gc = chunk_major(g, C)
    if kmc is not None:  # padded outputs pass no gradient, whatever it holds (selected, not multiplied)
        gc = torch.where(kmc.unsqueeze(-1) > 0, gc, 0)
    dnum = (gc / safe_den(den).unsqueeze(-1)).contiguous()  # (nc, BH, C, e)
    dden = (gc * chunk_major(out, C)).sum(-1).div_(safe_den(den)).neg_().mul_(den > 0).contiguous()  # (nc, BH, C)
    if "phq" in kept:
        phq, phk = kept["phq"], kept["phk"]
    else:
        phq, phk = block_features(walk, chunk_major(q, C), chunk_major(k, C), kmc)
    rot = block_rot(walk, sl)
    if rot is None:  # Eq. 18: the denominator is the ones column of v, as in the forward
        va = v.new_empty(nc, BH, C, e + 1)
        va[..., :e] = chunk_major(v, C)
        if kmc is not None:  # padded values selected away, as in the forward
            va[..., :e].masked_fill_(kmc.unsqueeze(-1) == 0, 0.0)
        va[..., e] = 1.0
        dna = torch.cat((dnum, dden.unsqueeze(-1)), -1)  # (nc, BH, C, e+1)
        cat = lambda a, b: torch.cat((a, b.unsqueeze(-1)), -1)  # noqa: E731
        s0s = resets and {c: cat(*s0) for c, (s0, _) in resets.items()}
        Sb = _states(phk, va, cat(*state0), kept.get("S"), s0s)
        Gb, starts = _suffix_sums(phq, dna, cat(*sums), resets and {c: cat(*gs) for c, (_, gs) in resets.items()})
        starts = {c: (x[..., :e], x[..., e]) for c, x in starts.items()}
        dphq, dphk, A = _numerator(phq, phk, va, dna, Sb[:nc], Gb[1:], bmm_batch(kept["A"]) if "A" in kept else None)
        dv = torch.bmm(bmm_batch(phk), bmm_batch(Gb[1:, ..., :e])).baddbmm_(A.transpose(1, 2), bmm_batch(dnum))
        G, Zq = Gb[0, ..., :e], Gb[0, ..., e]
    else:
        vc = select(chunk_major(v, C), kmc)
        # denominator den_n = phq_n . (z0 + sum_{j <= n} phk_j), chunked
        zb = kept.get("z")
        if zb is None:
            zb = v.new_empty(nc + 1, BH, m)
            zb[0] = state0[1]
            torch.sum(phk, 2, out=zb[1:])
            prefix_(zb, resets and {c: s0[1] for c, (s0, _) in resets.items()})
        Zb = v.new_empty(nc + 1, BH, m)
        Zb[nc] = sums[1]
        torch.bmm(dden.view(-1, 1, C), bmm_batch(phq), out=Zb[:nc].view(-1, 1, m))
        starts_z = suffix_(Zb, resets and {c: gs[1] for c, (_, gs) in resets.items()})
        Md = dden.view(-1, C, 1).expand(-1, C, C).tril()  # Md[n, j] = dden_n for j <= n
        dfq = torch.bmm(dden.view(-1, C, 1), zb[:nc].reshape(-1, 1, m)).baddbmm_(Md, bmm_batch(phk))
        dfk = torch.bmm(Md.transpose(1, 2), bmm_batch(phq)).add_(Zb[1:].reshape(-1, 1, m))
        # numerator: chunked linear attention on the rotated features
        rq, rk = rotate(phq, rot), rotate(phk, rot)
        Sb = _states(rk, vc, state0[0], kept.get("S"), resets and {c: s0[0] for c, (s0, _) in resets.items()})
        Gb, starts = _suffix_sums(rq, dnum, sums[0], resets and {c: gs[0] for c, (_, gs) in resets.items()})
        starts = {c: (starts[c], starts_z[c]) for c in starts}
        drq, drk, A = _numerator(rq, rk, vc, dnum, Sb[:nc], Gb[1:], bmm_batch(kept["A"]) if "A" in kept else None)
        dv = torch.bmm(bmm_batch(rk), bmm_batch(Gb[1:])).baddbmm_(A.transpose(1, 2), bmm_batch(dnum))
        conj = rot.conj()
        drq, drk = rotate(drq.view(nc, BH, C, m), conj), rotate(drk.view(nc, BH, C, m), conj)
        dphq, dphk = dfq.view(nc, BH, C, m).add_(drq), dfk.view(nc, BH, C, m).add_(drk)
        G, Zq = Gb[0], Zb[0]
    dphq, dphk, dv = dphq.view(nc, BH, C, m), dphk.view(nc, BH, C, m), dv.view(nc, BH, C, e)
    dq, dk = _through_features(walk, chunk_major(k, C), (phq, phk), (dphq, dphk), kmc)
    return (dq, dk, dv), (G.clone(), Zq.clone()), starts


def _through_features(walk, kc, feats, dfeats, kmc):
    """d phi(q), d phi(k) -> dq, dk: the features themselves, or FAVOR+'s chain rule."""
    (phq, phk), (dphq, dphk) = feats, dfeats
    if walk.favor is None:  # q and k were the features
        return dphq, (dphk if kmc is None else dphk.mul_(kmc.unsqueeze(-1)))
    # phi = exp(a) with a = [x', (-|k'|^2/2,) 1] @ w_aug^T: da = dphi * phi (masked keys have
    # phi = 0), then back through the GEMM; the shift columns' gradients vanish in the ratio
    w = walk.favor.w
    d = w.shape[1]
    scale = d**-0.25
    da, db = dphq.mul_(phq), dphk.mul_(phk)
    xks = kc * scale  # k'
    if kmc is not None:  # a padded key's k' is 0, as in the forward (selected, whatever k held)
        xks.masked_fill_(kmc.unsqueeze(-1) == 0, 0.0)
    dq = (da @ w).mul_(scale)
    dk = (db @ w).sub_(xks * db.sum(-1, keepdim=True)).mul_(scale)
    return dq, dk


def causal_backward(walk, fwd, g, gstate, state0, bufs):
    """The gradients of ``chunk_fwd.causal_forward``: fwd (q, k, v, out, den, block_S, block_z)
    as it saved them, g `[BH, Np, e]` and gstate (gS, gz) for the final states, state0 (S0, z0)
    and ``bufs`` as the forward got them.
    Returns dq, dk, dv and the gradients of the initial states (dS0, dz0)."""
    q, k, v, out, den, block_S, block_z = fwd
    (gS, gz), (S0, z0) = gstate, state0
    C, T = walk.C, walk.T
    doc_at = {c: d for d, c in enumerate(walk.starts)}
    BH, N, e = v.shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dS0, dz0 = torch.empty_like(S0), torch.empty_like(z0)
    # suffix sums after the last block: the gradient of the last document's final state
    G, Zq = gS[-1].clone(), gz[-1].clone()
    for i, b0 in reversed(list(enumerate(range(0, N, T)))):
        sl = slice(b0, min(b0 + T, N))
        c0, c1 = b0 // C, sl.stop // C
        if c1 in doc_at:  # the next block starts a document: G so far is its initial state's
            d = doc_at[c1]
            dS0[d], dz0[d] = G, Zq
            G, Zq = gS[d - 1].clone(), gz[d - 1].clone()
        km = None if walk.km is None else walk.km[:, sl]
        resets = {c - c0: ((S0[d], z0[d]), (gS[d - 1], gz[d - 1])) for c, d in doc_at.items() if c0 < c < c1}
        (a, b, c), (G, Zq), begun = block_backward(
            walk, (q[:, sl], k[:, sl], v[:, sl], km, sl), (g[:, sl], out[:, sl], den[c0:c1]),
            (block_S[i], block_z[i]), (G, Zq), block_slices(bufs, c0, c1), resets or None)
        for cl, (dS, dz) in begun.items():
            dS0[doc_at[c0 + cl]], dz0[doc_at[c0 + cl]] = dS, dz
        chunk_major(dq[:, sl], C).copy_(a), chunk_major(dk[:, sl], C).copy_(b), chunk_major(dv[:, sl], C).copy_(c)
    dS0[0], dz0[0] = G, Zq
    return (dq, dk, dv), (dS0, dz0)
