"""The fast path of Eq. 19: chunked causal (hand-written backward) and closed-form bidirectional.

``rotary_linear_attention`` is the public op. It computes what ``naive.py`` writes out, with
O(N) time and memory:

* **Causal.** The sequence is walked in blocks of ``block_size`` tokens. Within a block,
  chunks of C tokens run as batched GEMMs: a masked `[C, C]` product inside each chunk plus an
  `[m, e]` state from the chunks before, for the rotated numerator and for the unrotated
  denominator alike. The state ``(S, z)`` goes from block to block (it starts from
  ``initial_state`` and is returned as the final state). No `[N, m]` tensor is saved for the
  backward pass: features are recomputed per block from q and k. Backward walks the blocks in
  reverse, carrying the suffix sums ``G = sum rq dnum^T`` and ``Zq = sum dden phi(q)``, which
  are also the gradients of the initial state.
* **FAVOR+ inside** (``projection``): the stabiliser shifts of ``features.favor_features`` are
  folded into the projection GEMM (an ``addmm`` with extra input columns); RoPE is one complex
  multiplication per tensor. Their gradient ignores the shifts, which cancel in the ratio.
* **Bidirectional**: ``R_t phi(q_t) . (sum_n R_n phi(k_n) v_n^T) / phi(q_t) . sum_n phi(k_n)``.
* **Keywords.** ``mask`` zeroes masked keys' features (so they add to neither sum) and masked
  queries' outputs; positions count real tokens only. ``cu_seqlens`` runs each packed document
  as its own sequence (positions and state restart), one call per document.

Inside, everything is float32 or wider with autocast off; the result has v's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..features import favor_features, pair_shift
from ..rotary import rotary_tables, rotate_with_tables, table_dtype, token_positions
from .utils import LinearAttentionState, check_args

__all__ = ["rotary_linear_attention", "CHUNK", "BLOCK", "use_compile"]

CHUNK = 64
BLOCK = 256  # tokens per block: small blocks stay in cache (measured best of 64..4096 on 2-core EPYC)
# FAVOR+ features are kept from the forward for the backward up to this size (both q and k),
# and recomputed block by block above it (the memory stays O(block) at any length).
KEEP_FEATURES_BYTES = 512 << 20


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


def _featurize(xq, xk, kmc, w, wq, wk, scale, keep=None, kept=None):
    """Chunk-major block features: FAVOR+ of q, k when ``w`` is given, else q and k are the
    features. Masked keys (``kmc`` `[nc, BH, C]` of 0/1) get zero features. ``keep``: buffers
    the forward writes them into for the backward; ``kept``: those buffers, in the backward."""
    if w is None:
        phk = xk if kmc is None else xk * kmc.unsqueeze(-1)
        return xq.contiguous(), phk.contiguous(), None
    if kept is not None:
        return kept[0], kept[1], xk * scale
    phq, _ = _phi(xq, wq, scale, True, None, None if keep is None else keep[0])
    phk, xks = _phi(xk, wk, scale, False, kmc, None if keep is None else keep[1])
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


def _prefix_(buf):
    """In place: buf[c] = buf[0] + ... + buf[c] over dim 0 (buf[0] the state before the block).

    Then buf[c] is the state before chunk c and buf[-1] the state after the block. Only
    additions, never ``inclusive - x``: round-off of a later chunk cannot reach an earlier one.
    """
    for c in range(1, buf.shape[0]):
        buf[c] += buf[c - 1]
    return buf


def _suffix_(buf):
    """In place: buf[c] = buf[c] + ... + buf[-1] (buf[-1] the sums after the block)."""
    for c in range(buf.shape[0] - 2, -1, -1):
        buf[c] += buf[c + 1]
    return buf


def _block_forward(q, k, v, km, w, wq, wk, scale: float, rot, S, z, C: int, keep=None):
    """One block: q, k `[BH, t, d or m]`, v `[BH, t, e]`, state S `[BH, m, e]`, z `[BH, m]` before it,
    km `[BH, t]` 0/1 or None, rot chunk-major (see ``_rotate``) or None.

    Returns the block's output and denominator, chunk-major `[nc, BH, C, e]` / `[nc, BH, C]`,
    and the state after it.

    Without rotation (Eq. 18) the denominator rides in the numerator's GEMMs: v gets a column
    of ones and S the column z. With rotation the numerator uses R phi, the denominator phi,
    so the denominator has GEMMs of its own.
    """
    BH, t, e = v.shape
    m, nc = S.shape[1], t // C
    kmc = None if km is None else _cm(km.unsqueeze(-1), C).squeeze(-1)  # (nc, BH, C)
    phq, phk, _ = _featurize(_cm(q, C), _cm(k, C), kmc, w, wq, wk, scale, keep)  # (nc, BH, C, m)
    if rot is None:
        va = v.new_empty(nc, BH, C, e + 1)
        va[..., :e] = _cm(v, C)
        va[..., e] = 1.0
        Sb = v.new_empty(nc + 1, BH, m, e + 1)  # [S | z] before each chunk, then after the block
        Sb[0, ..., :e], Sb[0, ..., e] = S, z
        torch.bmm(_b(phk).transpose(1, 2), _b(va), out=_b(Sb[1:]))
        _prefix_(Sb)
        A = torch.bmm(_b(phq), _b(phk).transpose(1, 2)).tril_()
        numa = torch.bmm(_b(phq), _b(Sb[:nc])).baddbmm_(A, _b(va)).view(nc, BH, C, e + 1)
        num, den = numa[..., :e], numa[..., e]
        S, z = Sb[nc, ..., :e], Sb[nc, ..., e]
    else:
        vc = _cm(v, C).contiguous()
        rq, rk = _rotate(phq, rot), _rotate(phk, rot)
        Sb = v.new_empty(nc + 1, BH, m, e)
        Sb[0] = S
        torch.bmm(_b(rk).transpose(1, 2), _b(vc), out=_b(Sb[1:]))
        _prefix_(Sb)
        zb = v.new_empty(nc + 1, BH, m)
        zb[0] = z
        torch.sum(phk, 2, out=zb[1:])
        _prefix_(zb)
        A = torch.bmm(_b(rq), _b(rk).transpose(1, 2)).tril_()
        num = torch.bmm(_b(rq), _b(Sb[:nc])).baddbmm_(A, _b(vc)).view(nc, BH, C, e)
        Ad = torch.bmm(_b(phq), _b(phk).transpose(1, 2)).tril_()
        den = torch.bmm(_b(phq), zb[:nc].reshape(-1, m, 1)).view(nc, BH, C).add_(Ad.sum(-1).view(nc, BH, C))
        S, z = Sb[nc], zb[nc]
    # A query that sees no real key (left padding) has num = den = 0: the guard gives 0.
    den = den.clamp_min(torch.finfo(den.dtype).tiny)
    out = num / den.unsqueeze(-1)
    if kmc is not None:
        out *= kmc.unsqueeze(-1)
    return out, den, S.clone(), z.clone()


def _block_backward(q, k, v, km, g, out, den, w, wq, wk, scale: float, rot, S0, z0, G, Zq, C: int, kept=None):
    """Gradients of one block, given the state before it (S0, z0) and the suffix sums after it
    (G = sum rq dnum^T, Zq = sum dden phi(q)). g, out `[BH, t, e]`, den chunk-major `[nc, BH, C]`.
    Returns dq, dk, dv chunk-major and the suffix sums before the block."""
    BH, t, e = v.shape
    m, nc = S0.shape[1], t // C
    kmc = None if km is None else _cm(km.unsqueeze(-1), C).squeeze(-1)
    gc = _cm(g, C)
    if kmc is not None:
        gc = gc * kmc.unsqueeze(-1)
    dnum = gc / den.unsqueeze(-1)  # (nc, BH, C, e)
    dden = (gc * _cm(out, C)).sum(-1).div_(den).neg_().contiguous()  # (nc, BH, C)
    phq, phk, xks = _featurize(_cm(q, C), _cm(k, C), kmc, w, wq, wk, scale, kept=kept)
    if rot is None:  # Eq. 18: the denominator is the ones column of v, as in the forward
        va = v.new_empty(nc, BH, C, e + 1)
        va[..., :e] = _cm(v, C)
        va[..., e] = 1.0
        dna = torch.cat((dnum, dden.unsqueeze(-1)), -1)  # (nc, BH, C, e+1)
        Sb = v.new_empty(nc + 1, BH, m, e + 1)
        Sb[0, ..., :e], Sb[0, ..., e] = S0, z0
        torch.bmm(_b(phk).transpose(1, 2), _b(va), out=_b(Sb[1:]))
        _prefix_(Sb)
        Gb = v.new_empty(nc + 1, BH, m, e + 1)  # suffix sums after each chunk: G[c+1]
        Gb[nc, ..., :e], Gb[nc, ..., e] = G, Zq
        torch.bmm(_b(phq).transpose(1, 2), _b(dna), out=_b(Gb[:nc]))
        _suffix_(Gb)
        P = torch.bmm(_b(dna), _b(va).transpose(1, 2)).tril_()  # P[n, j] = dna_n . va_j, j <= n
        A = torch.bmm(_b(phq), _b(phk).transpose(1, 2)).tril_()
        dphq = torch.bmm(_b(dna), _b(Sb[:nc]).transpose(1, 2)).baddbmm_(P, _b(phk))
        dphk = torch.bmm(_b(va), _b(Gb[1:]).transpose(1, 2)).baddbmm_(P.transpose(1, 2), _b(phq))
        dv = torch.bmm(_b(phk), _b(Gb[1:, ..., :e])).baddbmm_(A.transpose(1, 2), _b(dnum.contiguous()))
        G, Zq = Gb[0, ..., :e], Gb[0, ..., e]
    else:
        vc = _cm(v, C).contiguous()
        # denominator den_n = phq_n . (z0 + sum_{j <= n} phk_j), chunked
        zb = v.new_empty(nc + 1, BH, m)
        zb[0] = z0
        torch.sum(phk, 2, out=zb[1:])
        _prefix_(zb)
        Zb = v.new_empty(nc + 1, BH, m)
        Zb[nc] = Zq
        torch.bmm(dden.view(-1, 1, C), _b(phq), out=Zb[:nc].view(-1, 1, m))
        _suffix_(Zb)
        Md = dden.view(-1, C, 1).expand(-1, C, C).tril()  # Md[n, j] = dden_n for j <= n
        dfq = torch.bmm(Md, _b(phk)).addcmul_(dden.view(-1, C, 1), zb[:nc].reshape(-1, 1, m))
        dfk = torch.bmm(Md.transpose(1, 2), _b(phq)).add_(Zb[1:].reshape(-1, 1, m))
        # numerator: chunked linear attention on the rotated features
        rq, rk = _rotate(phq, rot), _rotate(phk, rot)
        Sb = v.new_empty(nc + 1, BH, m, e)
        Sb[0] = S0
        torch.bmm(_b(rk).transpose(1, 2), _b(vc), out=_b(Sb[1:]))
        _prefix_(Sb)
        dnum = dnum.contiguous()
        Gb = v.new_empty(nc + 1, BH, m, e)
        Gb[nc] = G
        torch.bmm(_b(rq).transpose(1, 2), _b(dnum), out=_b(Gb[:nc]))
        _suffix_(Gb)
        P = torch.bmm(_b(dnum), _b(vc).transpose(1, 2)).tril_()  # P[n, j] = dnum_n . v_j, j <= n
        A = torch.bmm(_b(rq), _b(rk).transpose(1, 2)).tril_()
        drq = torch.bmm(_b(dnum), _b(Sb[:nc]).transpose(1, 2)).baddbmm_(P, _b(rk))
        drk = torch.bmm(_b(vc), _b(Gb[1:]).transpose(1, 2)).baddbmm_(P.transpose(1, 2), _b(rq))
        dv = torch.bmm(_b(rk), _b(Gb[1:])).baddbmm_(A.transpose(1, 2), _b(dnum))
        conj = rot.conj()
        drq, drk = _rotate(drq.view(nc, BH, C, m), conj), _rotate(drk.view(nc, BH, C, m), conj)
        dphq, dphk = dfq.view(nc, BH, C, m).add_(drq), dfk.view(nc, BH, C, m).add_(drk)
        G, Zq = Gb[0], Zb[0]
    dphq, dphk, dv = dphq.view(nc, BH, C, m), dphk.view(nc, BH, C, m), dv.view(nc, BH, C, e)
    if w is None:  # q and k were the features
        return dphq, (dphk if kmc is None else dphk.mul_(kmc.unsqueeze(-1))), dv, G.clone(), Zq.clone()
    # phi = exp(a), so da = dphi * phi (masked keys have phi = 0); then back through the GEMM
    da, db = dphq.mul_(phq), dphk.mul_(phk)
    dq = (da @ w).mul_(scale)
    dk = (db @ w).sub_(xks * db.sum(-1, keepdim=True)).mul_(scale)
    return dq, dk, dv, G.clone(), Zq.clone()


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


class _ChunkCausal(torch.autograd.Function):
    """(q, k, v, S0, z0) -> (out, S, z): causal Eq. 19 from the state (S0, z0), blockwise."""

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, km, w, wq, wk, scale, rot, C, T):
        with torch.autocast(v.device.type, enabled=False):  # the math stays in float32 or wider
            BH, N, e = v.shape
            fwd = _compiled.get("forward", _block_forward)
            out = torch.empty_like(v)
            den = v.new_empty(N // C, BH, C)
            m = S0.shape[1]
            # FAVOR+ features kept for the backward when they fit the budget, else recomputed
            keep = w is not None and 2 * N * BH * m * v.element_size() <= KEEP_FEATURES_BYTES
            feats = v.new_empty(2, N // C, BH, C, m) if keep else None
            S, z = S0, z0
            starts_S, starts_z = [], []
            for b0 in range(0, N, T):
                sl = slice(b0, min(b0 + T, N))
                cs = slice(b0 // C, sl.stop // C)
                starts_S.append(S), starts_z.append(z)
                kb = None if km is None else km[:, sl]
                o, den[cs], S, z = fwd(q[:, sl], k[:, sl], v[:, sl], kb, w, wq, wk, scale, _block_rot(rot, sl, C),
                                       S, z, C, None if feats is None else (feats[0, cs], feats[1, cs]))
                _cm(out[:, sl], C).copy_(o)
            ctx.save_for_backward(q, k, v, km, w, wq, wk, rot, out, den, torch.stack(starts_S), torch.stack(starts_z),
                                  feats)
            ctx.scale, ctx.C, ctx.T = scale, C, T
            return out, S, z

    @staticmethod
    @once_differentiable
    def backward(ctx, g, gS, gz):
        with torch.autocast(g.device.type, enabled=False):
            q, k, v, km, w, wq, wk, rot, out, den, starts_S, starts_z, feats = ctx.saved_tensors
            scale, C, T = ctx.scale, ctx.C, ctx.T
            BH, N, e = v.shape
            bwd = _compiled.get("backward", _block_backward)
            g = g.to(v.dtype)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            # suffix sums after the last block: the gradient of the final state
            G, Zq = gS.to(v.dtype).clone(), gz.to(v.dtype).clone()
            for i, b0 in reversed(list(enumerate(range(0, N, T)))):
                sl = slice(b0, min(b0 + T, N))
                cs = slice(b0 // C, sl.stop // C)
                kb = None if km is None else km[:, sl]
                a, b, c, G, Zq = bwd(
                    q[:, sl], k[:, sl], v[:, sl], kb, g[:, sl], out[:, sl], den[cs], w, wq, wk, scale,
                    _block_rot(rot, sl, C), starts_S[i], starts_z[i], G, Zq, C,
                    None if feats is None else (feats[0, cs], feats[1, cs]),
                )
                _cm(dq[:, sl], C).copy_(a), _cm(dk[:, sl], C).copy_(b), _cm(dv[:, sl], C).copy_(c)
            return dq, dk, dv, G, Zq, None, None, None, None, None, None, None, None


def _causal(q, k, v, w, km, rot, state, C, T):
    """q, k `[B, H, N, x]`, v `[B, H, N, e]` in the compute dtype; km `[B, N]` or None; rot complex
    `[N, m/2]` or `[B, N, m/2]` or None. Returns out `[B, H, N, e]`, S, z."""
    B, H, N, e = v.shape
    m = q.shape[-1] if w is None else w.shape[0]
    C = min(C, N)
    T = max(C, T // C * C)
    pad = (-N) % C
    if pad:  # trailing tokens to fill the last chunk: masked, so they change no output or state
        km = torch.ones(B, N, dtype=v.dtype, device=v.device) if km is None else km
        km = F.pad(km, (0, pad))
        if rot is not None:  # (complex tensors have no F.pad)
            rot = torch.cat((rot, rot.new_ones(rot.shape[:-2] + (pad, rot.shape[-1]))), dim=-2)

    def flat(t):  # (B*H, N+pad, .), contiguous; a copy only where a pad or layout needs one
        if pad:
            t = F.pad(t, (0, 0, 0, pad))
        return t.reshape(B * H, N + pad, -1).contiguous()

    q, k, v = flat(q), flat(k), flat(v)
    if km is not None:
        km = km[:, None].expand(B, H, N + pad).reshape(B * H, N + pad)
    if state is None:
        S0, z0 = v.new_zeros(B * H, m, e), v.new_zeros(B * H, m)
    else:
        S0, z0 = state.S.to(v.dtype).reshape(B * H, m, e), state.z.to(v.dtype).reshape(B * H, m)
    wq = wk = None
    scale = 1.0
    if w is not None:
        d = w.shape[1]
        c = pair_shift(w)
        one = torch.ones_like(c[:, None])
        wq, wk = torch.cat((w, c[:, None]), dim=1), torch.cat((w, one, -c[:, None]), dim=1)  # (m, d+1), (m, d+2)
        scale = d**-0.25
    out, S, z = _ChunkCausal.apply(q, k, v, S0, z0, km, w, wq, wk, scale, rot, C, T)
    return out.view(B, H, N + pad, e)[:, :, :N], S.view(B, H, m, e), z.view(B, H, m)


def _bidirectional(q, k, v, w, qmask, kmask, tables, state):
    """Closed form: every query sees every (real) key."""
    fq = q if w is None else favor_features(q, w, is_query=True)
    fk = k if w is None else favor_features(k, w, is_query=False)
    if kmask is not None:
        fk = fk * kmask[:, None, :, None]
    rq, rk = (fq, fk) if tables is None else (rotate_with_tables(fq, *tables), rotate_with_tables(fk, *tables))
    S = rk.transpose(-1, -2) @ v  # (B, H, m, e)
    z = fk.sum(-2)  # (B, H, m)
    if state is not None:
        S, z = S + state.S.to(S.dtype), z + state.z.to(z.dtype)
    den = (fq * z.unsqueeze(-2)).sum(-1)
    out = (rq @ S) / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)
    if qmask is not None:
        out = out * qmask[:, None, :, None]
    return out, S, z


def _one(q, k, v, *, causal, rotary, base, w, positions, offset, qmask, kmask, state, C, T):
    """One sequence batch (no packing), in the compute dtype."""
    cdt = v.dtype
    N = q.shape[2]
    m = q.shape[-1] if w is None else w.shape[0]
    tables = None
    if rotary:
        tables = rotary_tables(N, m, offset=offset, base=base, dtype=cdt, device=q.device, positions=positions)
    if not causal:
        if tables is not None and tables[0].dim() == 3:  # per row: broadcast over heads
            tables = (tables[0][:, None], tables[1][:, None])
        return _bidirectional(q, k, v, w, qmask, kmask, tables, state)
    rot = None if tables is None else torch.complex(*tables)
    km = None if kmask is None else kmask.to(cdt)
    return _causal(q, k, v, w, km, rot, state, C, T)


def rotary_linear_attention(
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
    chunk_size: int = CHUNK,
    block_size: int = BLOCK,
):
    """Linear attention with RoPE in the numerator only (RoFormer Eq. 19), fast path.

    Args:
        q, k: `[B, H, N, m]` non-negative features; or, with ``projection``, raw queries and
            keys `[B, H, N, d]` whose FAVOR+ features are computed inside (fused: never stored).
        v: `[B, H, N, e]` values.
        causal: token t sees tokens n <= t; otherwise every token (bidirectional).
        rotary: RoPE on the features in the numerator (Eq. 19); False gives Eq. 18.
        offset: position of token 0: an int, or a LongTensor `[B]` per row (`[D]` per document).
        base: RoPE base.
        projection: `[m, d]` FAVOR+ projection (``FavorFeatures.projection``); a fixed random
            draw, so it gets no gradient.
        mask: `[B, N]` bool, True = real token. Masked keys add nothing to the numerator or the
            denominator; masked queries output 0. A token's position is ``offset`` plus the
            number of real tokens before it, so a padded row (left or right) gives what the row
            gives alone.
        key_mask: `[B, M]` bool, for cross-attention: k, v of length M (any M) from another
            sequence; needs ``causal=False, rotary=False``. ``mask`` then masks the queries.
        cu_seqlens: int32 `[D+1]` cumulative lengths of D documents packed in one row
            (B = 1): each gets what it gets alone (positions and state restart).
        initial_state: ``LinearAttentionState`` of the tokens before these (`[B, ...]`, or
            `[D, ...]` with ``cu_seqlens``), e.g. from ``output_final_state``.
        output_final_state: also return the state after the last token.
        allow_negative: skip the check that feature inputs are >= 0 (without ``projection``).
        chunk_size, block_size: the chunk of the masked products and the block walked at once
            (memory is O(block_size * m) plus O(N / block_size * m * e)); any values work.

    Returns:
        `[B, H, N, e]` in v's dtype, or ``(out, state)`` with ``output_final_state``.
        Double backward is not supported (one-line RuntimeError).
    """
    a = check_args(q, k, v, causal=causal, rotary=rotary, offset=offset, base=base, projection=projection,
                   mask=mask, key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                   allow_negative=allow_negative)
    for name, val in (("chunk_size", chunk_size), ("block_size", block_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    out_dtype = v.dtype
    cdt = table_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
        w = None if projection is None else projection.detach().to(cdt)
        kw = dict(causal=causal, rotary=rotary, base=base, w=w, C=chunk_size, T=block_size)
        if a.docs is None:
            out, S, z = _one(q, k, v, positions=a.positions, offset=a.offset, qmask=a.qmask, kmask=a.kmask,
                             state=a.state, **kw)
        else:
            outs, Ss, zs = [], [], []
            for d, (s, e) in enumerate(a.docs):
                off = a.offset[d : d + 1] if isinstance(a.offset, torch.Tensor) else a.offset
                dmask = None if a.qmask is None else a.qmask[:, s:e]
                st = None if a.state is None else LinearAttentionState(a.state.S[d : d + 1], a.state.z[d : d + 1])
                pos = token_positions(off, e - s, dmask, device=q.device) if rotary else None
                o, S, z = _one(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], positions=pos, offset=off if pos is None else 0,
                               qmask=dmask, kmask=dmask, state=st, **kw)
                outs.append(o), Ss.append(S), zs.append(z)
            out, S, z = torch.cat(outs, dim=2), torch.cat(Ss), torch.cat(zs)
    out = out.to(out_dtype)
    return (out, LinearAttentionState(S, z)) if output_final_state else out
