"""The blocks of the chunked causal path: its kernels and the autograd Function that walks them.

``chunk.py`` holds the public op and says what the algorithm does; this file is its engine. A
block of tokens is laid out chunk-major, `[nc, BH, C, x]`; ``_block_forward`` and
``_block_backward`` do everything for one block in a few batched GEMMs, and ``_ChunkCausal``
walks the blocks forward, then in reverse for the gradients, carrying the recurrent state
(forward) and its suffix sums (backward) from block to block, with resets where packed
documents start.
"""
from __future__ import annotations

import math

import torch

from ..features import key_exponent_floor

__all__ = ["KEEP_FEATURES_BYTES", "use_compile"]

# What the forward keeps for the backward (see ``_keep_plan``) stays under this size; the rest
# is recomputed block by block (the memory stays O(block) at any length).
KEEP_FEATURES_BYTES = 512 << 20


def _safe(den):
    """The divisor for a denominator the forward kept as 0 where it was <= 0 (see below)."""
    return torch.where(den > 0, den, torch.ones_like(den))


def _cm(x, C):
    """`[BH, t, x]` -> `[nc, BH, C, x]`, chunk-major (a view; ``.contiguous()`` copies it).

    Chunk-major makes every per-chunk batch one contiguous run: the chunk states of a block
    are written by one bmm straight into a buffer with a slot in front for the state before
    the block, and the prefix sums over chunks run in place over whole slabs.
    """
    BH, t, n = x.shape
    return x.view(BH, t // C, C, n).transpose(0, 1)


def _phi(xc, w_aug, scale, is_query, kmc, out=None):
    """xc `[nc, BH, C, d]` chunk-major view -> (phi `[nc, BH, C, m]` (into ``out`` if given),
    x * scale `[nc, BH, C, d]`)."""
    nc, BH, C, d = xc.shape
    xa = xc.new_empty(nc, BH, C, d + (1 if is_query else 2))
    xs = torch.mul(xc, scale, out=xa[..., :d])
    if is_query:
        xa[..., d] = 1.0
    else:
        torch.sum(xs * xs, -1, out=xa[..., d]).mul_(-0.5)
        xa[..., d + 1] = 1.0
        if kmc is not None:  # masked keys: exp(-1e30 + ...) = 0 exactly, no extra pass over phi
            xa[..., d].sub_(kmc.eq(0).to(xa.dtype), alpha=1e30)
    a = torch.matmul(xa, w_aug.t(), out=out)  # (nc, BH, C, m)
    if is_query:
        a -= a.amax(-1, keepdim=True)
        return a.exp_(), xs
    a.clamp_min_(key_exponent_floor(a.dtype)).exp_()  # see features.key_exponent_floor
    if kmc is not None:  # the floor lifted the masked keys' -1e30: back to 0 exactly
        a.mul_(kmc.unsqueeze(-1))
    return a, xs


def _featurize(xq, xk, kmc, w, wq, wk, scale, keep=None, kept=None):
    """Chunk-major block features: FAVOR+ of q, k when ``w`` is given, else q and k are the
    features. Masked keys (``kmc`` `[nc, BH, C]` of 0/1) get zero features. ``keep`` / ``kept``:
    see ``_block_forward``."""
    if w is None:
        phk = xk if kmc is None else xk * kmc.unsqueeze(-1)
        return xq.contiguous(), phk.contiguous(), None
    if kept and "phq" in kept:
        return kept["phq"], kept["phk"], xk * scale
    keep = keep or {}
    phq, _ = _phi(xq, wq, scale, True, None, keep.get("phq"))
    phk, xks = _phi(xk, wk, scale, False, kmc, keep.get("phk"))
    return phq, phk, xks


def _rotate(phi, rot):
    """Interleaved pairs of phi `[nc, BH, C, m]` times the complex table rot `[nc, 1, C, m/2]`
    (shared by the rows) or `[nc, B, 1, C, m/2]` (per row).

    Eager: one complex multiplication (4x faster than strided real arithmetic). Under
    torch.compile, which has no complex codegen, the real form that Inductor fuses into one loop.
    """
    nc, BH, C, m = phi.shape
    shape = (nc, rot.shape[1], BH // rot.shape[1], C, m // 2) if rot.dim() == 5 else (nc, BH, C, m // 2)
    if torch.compiler.is_compiling():
        x = phi.view(*shape, 2)
        x1, x2, cos, sin = x[..., 0], x[..., 1], rot.real, rot.imag
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).view(nc, BH, C, m)
    return torch.view_as_real(torch.view_as_complex(phi.view(*shape, 2)) * rot).view(nc, BH, C, m)


def _b(t):
    """`[nc, BH, C, x]` -> `[nc*BH, C, x]`: one batch entry per (chunk, row) for bmm."""
    return t.view(-1, *t.shape[-2:])


def _prefix_(buf, resets=None):
    """In place: buf[c] = buf[0] + ... + buf[c] over dim 0 (buf[0] the state before the block).

    Then buf[c] is the state before chunk c and buf[-1] the state after the block. Only
    additions, never ``inclusive - x``: round-off of a later chunk cannot reach an earlier one.
    ``resets`` {c: state}: chunk c starts a packed document, whose state starts afresh; returns
    {c: the state after the document that ends before chunk c}.
    """
    if not resets:
        buf.cumsum_(0)  # the same running sum, one kernel
        return {}
    ends = {}
    for c in range(1, buf.shape[0]):
        if resets and c in resets:
            ends[c] = buf[c - 1] + buf[c]
            buf[c] = resets[c]
        else:
            buf[c] += buf[c - 1]
    return ends


def _suffix_(buf, resets=None):
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


def _key_sums(phk, zx):
    """The denominator's key sums `[nc, BH, C, m]`: z before the chunk plus the chunk's keys up
    to and including each token (a running sum within the chunk: additions of earlier keys only)."""
    return torch.cumsum(phk, 2).add_(zx.unsqueeze(2))


def _put(dst, src):
    """dst[...] = src, unless src already is dst (a state kept in place between blocks)."""
    if not (dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride()):
        dst.copy_(src)


def _block_forward(q, k, v, km, w, wq, wk, scale: float, rot, S, z, C: int, keep=None, resets=None):
    """One block: q, k `[BH, t, d or m]`, v `[BH, t, e]`, state S `[BH, m, e]`, z `[BH, m]` before it,
    km `[BH, t]` 0/1 or None, rot chunk-major (see ``_rotate``) or None.

    Returns the block's output and denominator, chunk-major `[nc, BH, C, e]` / `[nc, BH, C]`,
    the state after it, and {c: (S, z)} after each packed document that ends inside it
    (``resets`` {c: (S0, z0)}: the documents that start at its chunks c >= 1).

    ``keep``: the block's slices of buffers that outlive the forward, for the backward: "phq",
    "phk" (features), "A" (the masked intra-chunk products), "S" (and "z" with rotation: the
    state before every chunk; slot 0 is shared with the previous block's last slot).

    Without rotation (Eq. 18) the denominator rides in the numerator's GEMMs: v gets a column
    of ones and S the column z. With rotation the numerator uses R phi, the denominator phi,
    so the denominator has GEMMs of its own.
    """
    BH, t, e = v.shape
    m, nc = S.shape[1], t // C
    kmc = None if km is None else _cm(km.unsqueeze(-1), C).squeeze(-1)  # (nc, BH, C)
    keep = keep or {}
    phq, phk, _ = _featurize(_cm(q, C), _cm(k, C), kmc, w, wq, wk, scale, keep)  # (nc, BH, C, m)
    A_out = _b(keep["A"]) if "A" in keep else None
    if rot is None:
        va = v.new_empty(nc, BH, C, e + 1)
        va[..., :e] = _cm(v, C)
        va[..., e] = 1.0
        Sb = keep["S"] if "S" in keep else v.new_empty(nc + 1, BH, m, e + 1)  # [S | z] before each chunk, then after
        _put(Sb[0, ..., :e], S), _put(Sb[0, ..., e], z)
        torch.bmm(_b(phk).transpose(1, 2), _b(va), out=_b(Sb[1:]))
        ends = _prefix_(Sb, resets and {c: torch.cat((a, b.unsqueeze(-1)), -1) for c, (a, b) in resets.items()})
        ends = {c: (t[..., :e], t[..., e]) for c, t in ends.items()}
        A = torch.bmm(_b(phq), _b(phk).transpose(1, 2), out=A_out).tril_()
        numa = torch.bmm(_b(phq), _b(Sb[:nc])).baddbmm_(A, _b(va)).view(nc, BH, C, e + 1)
        num, den = numa[..., :e], numa[..., e]
        S, z = Sb[nc, ..., :e], Sb[nc, ..., e]
    else:
        vc = _cm(v, C).contiguous()
        rq, rk = _rotate(phq, rot), _rotate(phk, rot)
        Sb = keep["S"] if "S" in keep else v.new_empty(nc + 1, BH, m, e)
        _put(Sb[0], S)
        torch.bmm(_b(rk).transpose(1, 2), _b(vc), out=_b(Sb[1:]))
        ends_S = _prefix_(Sb, resets and {c: a for c, (a, _) in resets.items()})
        zb = keep["z"] if "z" in keep else v.new_empty(nc + 1, BH, m)
        _put(zb[0], z)
        torch.sum(phk, 2, out=zb[1:])
        ends_z = _prefix_(zb, resets and {c: b for c, (_, b) in resets.items()})
        ends = {c: (ends_S[c], ends_z[c]) for c in ends_S}
        A = torch.bmm(_b(rq), _b(rk).transpose(1, 2), out=A_out).tril_()
        num = torch.bmm(_b(rq), _b(Sb[:nc])).baddbmm_(A, _b(vc)).view(nc, BH, C, e)
        den = torch.linalg.vecdot(phq, _key_sums(phk, zb[:nc]))
        S, z = Sb[nc], zb[nc]
    # A query that sees no real key (left padding) has num = den = 0: the guard gives 0. As in
    # naive, a denominator <= 0 (relu features with disjoint supports, allow_negative) divides by
    # 1 and passes no gradient to den: den is kept as 0 there, for the backward.
    den = torch.where(den > 0, den, torch.zeros_like(den))
    out = num / _safe(den).unsqueeze(-1)
    if kmc is not None:
        out *= kmc.unsqueeze(-1)
    if "S" not in keep:
        S, z = S.clone(), z.clone()
    return out, den, S, z, ends


def _block_backward(q, k, v, km, g, out, den, w, wq, wk, scale: float, rot, S0, z0, G, Zq, C: int, kept=None,
                    resets=None):
    """Gradients of one block, given the state before it (S0, z0) and the suffix sums after it
    (G = sum rq dnum^T, Zq = sum dden phi(q)). g, out `[BH, t, e]`, den chunk-major `[nc, BH, C]`.
    ``resets`` {c: ((S0, z0), (gS, gz))}: packed documents starting at chunks c >= 1, with their
    initial states and the gradients of the final states of the documents before them.
    Returns dq, dk, dv chunk-major, the suffix sums before the block, and {c: (dS0, dz0)}."""
    BH, t, e = v.shape
    m, nc = S0.shape[1], t // C
    kmc = None if km is None else _cm(km.unsqueeze(-1), C).squeeze(-1)
    gc = _cm(g, C)
    if kmc is not None:
        gc = gc * kmc.unsqueeze(-1)
    dnum = gc / _safe(den).unsqueeze(-1)  # (nc, BH, C, e)
    dden = (gc * _cm(out, C)).sum(-1).div_(_safe(den)).neg_().mul_(den > 0).contiguous()  # (nc, BH, C)
    kept = kept or {}
    phq, phk, xks = _featurize(_cm(q, C), _cm(k, C), kmc, w, wq, wk, scale, kept=kept)
    if rot is None:  # Eq. 18: the denominator is the ones column of v, as in the forward
        va = v.new_empty(nc, BH, C, e + 1)
        va[..., :e] = _cm(v, C)
        va[..., e] = 1.0
        dna = torch.cat((dnum, dden.unsqueeze(-1)), -1)  # (nc, BH, C, e+1)
        cat = lambda a, b: torch.cat((a, b.unsqueeze(-1)), -1)  # noqa: E731
        Sb = kept.get("S")
        if Sb is None:  # the states before each chunk, again
            Sb = v.new_empty(nc + 1, BH, m, e + 1)
            Sb[0, ..., :e], Sb[0, ..., e] = S0, z0
            torch.bmm(_b(phk).transpose(1, 2), _b(va), out=_b(Sb[1:]))
            _prefix_(Sb, resets and {c: cat(*s0) for c, (s0, _) in resets.items()})
        Gb = v.new_empty(nc + 1, BH, m, e + 1)  # suffix sums after each chunk: G[c+1]
        Gb[nc, ..., :e], Gb[nc, ..., e] = G, Zq
        torch.bmm(_b(phq).transpose(1, 2), _b(dna), out=_b(Gb[:nc]))
        starts = _suffix_(Gb, resets and {c: cat(*gs) for c, (_, gs) in resets.items()})
        starts = {c: (t[..., :e], t[..., e]) for c, t in starts.items()}
        P = torch.bmm(_b(dna), _b(va).transpose(1, 2)).tril_()  # P[n, j] = dna_n . va_j, j <= n
        A = _b(kept["A"]) if "A" in kept else torch.bmm(_b(phq), _b(phk).transpose(1, 2)).tril_()
        dphq = torch.bmm(_b(dna), _b(Sb[:nc]).transpose(1, 2)).baddbmm_(P, _b(phk))
        dphk = torch.bmm(_b(va), _b(Gb[1:]).transpose(1, 2)).baddbmm_(P.transpose(1, 2), _b(phq))
        dv = torch.bmm(_b(phk), _b(Gb[1:, ..., :e])).baddbmm_(A.transpose(1, 2), _b(dnum.contiguous()))
        G, Zq = Gb[0, ..., :e], Gb[0, ..., e]
    else:
        vc = _cm(v, C).contiguous()
        # denominator den_n = phq_n . (z0 + sum_{j <= n} phk_j), chunked
        zb = kept.get("z")
        if zb is None:
            zb = v.new_empty(nc + 1, BH, m)
            zb[0] = z0
            torch.sum(phk, 2, out=zb[1:])
            _prefix_(zb, resets and {c: s0[1] for c, (s0, _) in resets.items()})
        Zb = v.new_empty(nc + 1, BH, m)
        Zb[nc] = Zq
        torch.bmm(dden.view(-1, 1, C), _b(phq), out=Zb[:nc].view(-1, 1, m))
        starts_z = _suffix_(Zb, resets and {c: gs[1] for c, (_, gs) in resets.items()})
        Md = dden.view(-1, C, 1).expand(-1, C, C).tril()  # Md[n, j] = dden_n for j <= n
        dfq = _key_sums(phk, zb[:nc]).mul_(dden.unsqueeze(-1))
        dfk = torch.bmm(Md.transpose(1, 2), _b(phq)).add_(Zb[1:].reshape(-1, 1, m))
        # numerator: chunked linear attention on the rotated features
        rq, rk = _rotate(phq, rot), _rotate(phk, rot)
        Sb = kept.get("S")
        if Sb is None:
            Sb = v.new_empty(nc + 1, BH, m, e)
            Sb[0] = S0
            torch.bmm(_b(rk).transpose(1, 2), _b(vc), out=_b(Sb[1:]))
            _prefix_(Sb, resets and {c: s0[0] for c, (s0, _) in resets.items()})
        dnum = dnum.contiguous()
        Gb = v.new_empty(nc + 1, BH, m, e)
        Gb[nc] = G
        torch.bmm(_b(rq).transpose(1, 2), _b(dnum), out=_b(Gb[:nc]))
        starts = _suffix_(Gb, resets and {c: gs[0] for c, (_, gs) in resets.items()})
        starts = {c: (starts[c], starts_z[c]) for c in starts}
        P = torch.bmm(_b(dnum), _b(vc).transpose(1, 2)).tril_()  # P[n, j] = dnum_n . v_j, j <= n
        A = _b(kept["A"]) if "A" in kept else torch.bmm(_b(rq), _b(rk).transpose(1, 2)).tril_()
        drq = torch.bmm(_b(dnum), _b(Sb[:nc]).transpose(1, 2)).baddbmm_(P, _b(rk))
        drk = torch.bmm(_b(vc), _b(Gb[1:]).transpose(1, 2)).baddbmm_(P.transpose(1, 2), _b(rq))
        dv = torch.bmm(_b(rk), _b(Gb[1:])).baddbmm_(A.transpose(1, 2), _b(dnum))
        conj = rot.conj()
        drq, drk = _rotate(drq.view(nc, BH, C, m), conj), _rotate(drk.view(nc, BH, C, m), conj)
        dphq, dphk = dfq.view(nc, BH, C, m).add_(drq), dfk.view(nc, BH, C, m).add_(drk)
        G, Zq = Gb[0], Zb[0]
    dphq, dphk, dv = dphq.view(nc, BH, C, m), dphk.view(nc, BH, C, m), dv.view(nc, BH, C, e)
    if w is None:  # q and k were the features
        return dphq, (dphk if kmc is None else dphk.mul_(kmc.unsqueeze(-1))), dv, G.clone(), Zq.clone(), starts
    # phi = exp(a), so da = dphi * phi (masked keys have phi = 0); then back through the GEMM
    da, db = dphq.mul_(phq), dphk.mul_(phk)
    dq = (da @ w).mul_(scale)
    dk = (db @ w).sub_(xks * db.sum(-1, keepdim=True)).mul_(scale)
    return dq, dk, dv, G.clone(), Zq.clone(), starts


_compiled: dict = {}


def use_compile(enabled: bool = True) -> None:
    """Run the block functions through ``torch.compile`` (Inductor fuses the elementwise work).
    Off by default: compiling costs tens of seconds per shape, needs a C++ compiler on CPU, and
    eager is the tested reference path."""
    _compiled.clear()
    if enabled:
        _compiled["forward"] = torch.compile(_block_forward, dynamic=False)
        _compiled["backward"] = torch.compile(_block_backward, dynamic=False)


def _block_rot(rot, sl, C):
    """The block's slice of the rotation table, chunk-major: `[nc, 1, C, m/2]` or `[nc, B, 1, C, m/2]`."""
    if rot is None:
        return None
    if rot.dim() == 2:
        r = rot[sl]
        return r.view(-1, 1, C, r.shape[-1])
    r = rot[:, sl]
    B, t, h = r.shape
    return r.view(B, t // C, C, h).transpose(0, 1).unsqueeze(2)


def _keep_plan(NC, BH, C, m, e, *, fused, rotary, like):
    """Buffers the forward fills for the backward, greedily while they fit ``KEEP_FEATURES_BYTES``,
    in order of GEMM work saved per byte: the masked intra-chunk products A `[NC, BH, C, C]`
    (2 m flops per element), the FAVOR+ features `[NC, BH, C, m]` each (two GEMMs and an exp),
    the states before every chunk `[NC + 1, BH, m, e (+1)]` (one GEMM and the prefix sums)."""
    want = {"A": (NC, BH, C, C)}
    if fused:
        want.update(phq=(NC, BH, C, m), phk=(NC, BH, C, m))
    want["S"] = (NC + 1, BH, m, e + (not rotary))
    if rotary:
        want["z"] = (NC + 1, BH, m)
    left, bufs = KEEP_FEATURES_BYTES, {}
    for group in (("A",), ("phq", "phk"), ("S", "z")):
        names = [n for n in group if n in want]
        size = sum(math.prod(want[n]) for n in names) * like.element_size()
        if names and size <= left:
            left -= size
            bufs.update({n: like.new_empty(want[n]) for n in names})
    return bufs


def _slices(bufs, c0, c1):
    """The slices of the kept buffers for the block of chunks [c0, c1) (states: c0 .. c1 inclusive)."""
    return {n: b[c0 : c1 + 1] if n in ("S", "z") else b[c0:c1] for n, b in bufs.items()}


class _ChunkCausal(torch.autograd.Function):
    """(q, k, v, S0, z0) -> (out, S, z): causal Eq. 19 from the states (S0, z0), blockwise.

    S0 `[D, BH, m, e]`, z0 `[D, BH, m]`: one initial state per packed document, which starts at
    chunk ``starts[d]`` (``starts[0] = 0``; one document, D = 1, when nothing is packed). The
    returned S, z are the states after each document, of the same shapes.
    """

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, km, w, wq, wk, scale, rot, C, T, starts):
        with torch.autocast(v.device.type, enabled=False):  # the math stays in float32 or wider
            BH, N, e = v.shape
            fwd = _compiled.get("forward", _block_forward)
            out = torch.empty_like(v)
            den = v.new_empty(N // C, BH, C)
            m = S0.shape[2]
            bufs = _keep_plan(N // C, BH, C, m, e, fused=w is not None, rotary=rot is not None, like=v)
            doc_at = {c: d for d, c in enumerate(starts)}
            S_end, z_end = torch.empty_like(S0), torch.empty_like(z0)
            S, z = S0[0], z0[0]
            starts_S, starts_z = [], []
            for b0 in range(0, N, T):
                sl = slice(b0, min(b0 + T, N))
                c0, c1 = b0 // C, sl.stop // C
                if c0 in doc_at and c0 > 0:  # a document starts with this block
                    d = doc_at[c0]
                    S_end[d - 1], z_end[d - 1] = S, z
                    S, z = S0[d], z0[d]
                starts_S.append(S), starts_z.append(z)
                kb = None if km is None else km[:, sl]
                resets = {c - c0: (S0[d], z0[d]) for c, d in doc_at.items() if c0 < c < c1}
                o, den[c0:c1], S, z, ends = fwd(
                    q[:, sl], k[:, sl], v[:, sl], kb, w, wq, wk, scale, _block_rot(rot, sl, C), S, z, C,
                    _slices(bufs, c0, c1), resets or None)
                for c, (Se, ze) in ends.items():
                    S_end[doc_at[c0 + c] - 1], z_end[doc_at[c0 + c] - 1] = Se, ze
                _cm(out[:, sl], C).copy_(o)
            S_end[-1], z_end[-1] = S, z
            ctx.save_for_backward(q, k, v, km, w, wq, wk, rot, out, den, torch.stack(starts_S), torch.stack(starts_z),
                                  S0, z0, *bufs.values())
            ctx.scale, ctx.C, ctx.T, ctx.starts, ctx.kept = scale, C, T, starts, list(bufs)
            return out, S_end, z_end

    @staticmethod
    def backward(ctx, g, gS, gz):
        if torch.is_grad_enabled():  # create_graph=True: the backward is hand-written, not differentiable
            raise RuntimeError("rotary_linear_attention: double backward (create_graph=True) is not supported")
        with torch.autocast(g.device.type, enabled=False):
            q, k, v, km, w, wq, wk, rot, out, den, starts_S, starts_z, S0, z0, *kept = ctx.saved_tensors
            bufs = dict(zip(ctx.kept, kept))
            scale, C, T = ctx.scale, ctx.C, ctx.T
            doc_at = {c: d for d, c in enumerate(ctx.starts)}
            BH, N, e = v.shape
            bwd = _compiled.get("backward", _block_backward)
            g, gS, gz = g.to(v.dtype), gS.to(v.dtype), gz.to(v.dtype)
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
                kb = None if km is None else km[:, sl]
                resets = {c - c0: ((S0[d], z0[d]), (gS[d - 1], gz[d - 1])) for c, d in doc_at.items() if c0 < c < c1}
                a, b, c, G, Zq, begun = bwd(
                    q[:, sl], k[:, sl], v[:, sl], kb, g[:, sl], out[:, sl], den[c0:c1], w, wq, wk, scale,
                    _block_rot(rot, sl, C), starts_S[i], starts_z[i], G, Zq, C, _slices(bufs, c0, c1), resets or None,
                )
                for cl, (dS, dz) in begun.items():
                    dS0[doc_at[c0 + cl]], dz0[doc_at[c0 + cl]] = dS, dz
                _cm(dq[:, sl], C).copy_(a), _cm(dk[:, sl], C).copy_(b), _cm(dv[:, sl], C).copy_(c)
            dS0[0], dz0[0] = G, Zq
            return dq, dk, dv, dS0, dz0, None, None, None, None, None, None, None, None, None
