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

from ..features import favor_features, pair_shift
from ..rotary import rotary_tables, rotate_with_tables, table_dtype, token_positions
from .utils import LinearAttentionState, check_args

__all__ = ["rotary_linear_attention", "CHUNK", "BLOCK", "use_compile"]

CHUNK = 64
BLOCK = 256  # tokens per block: small blocks stay in cache (measured best of 64..4096 on 2-core EPYC)


def _features(x, wq, wk, scale, is_query):
    """x `[BH, T, d]` -> (phi `[BH, T, m]`, x * scale).

    The shifts ride in the projection GEMM as extra input columns: queries
    ``[x', 1] @ [w, c]^T = w.x' + c`` (then minus the row max), keys
    ``[x', -|x'|^2/2, 1] @ [w, 1, -c]^T = w.x' - |x'|^2/2 - c``.
    """
    xs = x * scale
    one = torch.ones_like(xs[..., :1])
    if is_query:
        a = torch.cat((xs, one), dim=-1) @ wq.t()
        a -= a.amax(-1, keepdim=True)
    else:
        a = torch.cat((xs, (xs * xs).sum(-1, keepdim=True).mul_(-0.5), one), dim=-1) @ wk.t()
    return a.exp_(), xs


def _featurize(q, k, km, w, wq, wk, scale):
    """Block features: FAVOR+ of q, k when ``w`` is given, else q and k are the features.
    Masked keys (``km`` `[BH, t]` of 0/1) get zero features."""
    if w is None:
        phq, phk, xks = q, k, None
    else:
        phq, _ = _features(q, wq, wk, scale, True)
        phk, xks = _features(k, wq, wk, scale, False)
    if km is not None:
        phk = phk * km.unsqueeze(-1)
    return phq, phk, xks


def _rotate(phi, rot):
    """Interleaved pairs of phi `[BH, T, m]` times the complex table rot `[T, m/2]` (shared) or
    `[B, T, m/2]` (per row).

    Eager: one complex multiplication (4x faster than strided real arithmetic). Under
    torch.compile, which has no complex codegen, the real form that Inductor fuses into one loop.
    """
    BH, T, m = phi.shape
    if rot.dim() == 3:
        shape, rot = (rot.shape[0], BH // rot.shape[0], T, m // 2), rot[:, None]
    else:
        shape = (BH, T, m // 2)
    if torch.compiler.is_compiling():
        x = phi.view(*shape, 2)
        x1, x2, cos, sin = x[..., 0], x[..., 1], rot.real, rot.imag
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).view(BH, T, m)
    return torch.view_as_real(torch.view_as_complex(phi.view(*shape, 2)) * rot).view(BH, T, m)


def _chunks(t, C):
    """`[BH, T, x]` -> `[BH * T/C, C, x]` (batched over chunks for bmm)."""
    BH, T, x = t.shape
    return t.reshape(BH * (T // C), C, x)


def _excl_cumsum(x, start):
    """x `[BH, nc, ...]`: prefix sums before each chunk, starting from ``start``; and the total.

    Built by shifting an inclusive sum, never as ``inclusive - x``: the subtraction would let
    round-off of a chunk's later tokens reach its earlier ones (about 1e-15 in float64).
    """
    inc = x.cumsum(1).add_(start.unsqueeze(1))
    return torch.cat((start.unsqueeze(1), inc[:, :-1]), dim=1), inc[:, -1]


def _excl_suffix(x, end):
    """x `[BH, nc, ...]`: sums after each chunk, plus ``end``; and the total."""
    total = x.sum(1) + end
    return x.cumsum(1).neg_().add_(total.unsqueeze(1)), total


def _block_forward(q, k, v, km, w, wq, wk, scale: float, rot, S, z, C: int):
    """One block: q, k `[BH, t, d or m]`, v `[BH, t, e]`, state S `[BH, m, e]`, z `[BH, m]` before it.

    Returns the block's output `[BH, t, e]`, denominator `[BH, t]` and the state after it.
    """
    BH, t, e = v.shape
    m, nc = S.shape[1], t // C
    phq, phk, _ = _featurize(q, k, km, w, wq, wk, scale)
    fq, fk = _chunks(phq, C), _chunks(phk, C)  # unrotated, (BH*nc, C, m)
    zx, z = _excl_cumsum(fk.sum(1).view(BH, nc, m), z)
    den = torch.bmm(fq, zx.view(-1, m, 1)).squeeze(-1).add_(torch.bmm(fq, fk.transpose(1, 2)).tril_().sum(-1))
    if rot is not None:
        rq, rk = _chunks(_rotate(phq, rot), C), _chunks(_rotate(phk, rot), C)
    else:
        rq, rk = fq, fk
    vb = _chunks(v, C)
    Sx, S = _excl_cumsum(torch.bmm(rk.transpose(1, 2), vb).view(BH, nc, m, e), S)
    num = torch.bmm(rq, Sx.view(-1, m, e)).baddbmm_(torch.bmm(rq, rk.transpose(1, 2)).tril_(), vb)
    # A query that sees no real key (left padding) has num = den = 0: the guard gives 0.
    den = den.view(BH, t).clamp_min_(torch.finfo(den.dtype).tiny)
    out = num.view(BH, t, e) / den.unsqueeze(-1)
    if km is not None:
        out *= km.unsqueeze(-1)
    return out, den, S, z


def _block_backward(q, k, v, km, g, out, den, w, wq, wk, scale: float, rot, S0, z0, G, Zq, C: int):
    """Gradients of one block, given the state before it (S0, z0) and the suffix sums after it
    (G = sum rq dnum^T, Zq = sum dden phi(q)). Returns dq, dk, dv and the suffix sums before it."""
    BH, t, e = v.shape
    m, nc = S0.shape[1], t // C
    if km is not None:
        g = g * km.unsqueeze(-1)
    dnum = g / den.unsqueeze(-1)  # (BH, t, e)
    dden = (g * out).sum(-1).div_(den).neg_()  # (BH, t)
    phq, phk, xks = _featurize(q, k, km, w, wq, wk, scale)
    fq, fk = _chunks(phq, C), _chunks(phk, C)
    # denominator den_n = phq_n . (z0 + sum_{j <= n} phk_j), chunked
    Md = dden.view(-1, C, 1).expand(-1, C, C).tril()  # Md[n, j] = dden_n for j <= n
    zx, _ = _excl_cumsum(fk.sum(1).view(BH, nc, m), z0)
    Zx, Zq = _excl_suffix(torch.bmm(dden.view(-1, 1, C), fq).view(BH, nc, m), Zq)
    dfq = torch.bmm(Md, fk).addcmul_(dden.view(-1, C, 1), zx.view(-1, 1, m))
    dfk = torch.bmm(Md.transpose(1, 2), fq).add_(Zx.view(-1, 1, m))
    # numerator: chunked linear attention on the rotated features
    if rot is not None:
        rq, rk = _chunks(_rotate(phq, rot), C), _chunks(_rotate(phk, rot), C)
    else:
        rq, rk = fq, fk
    vb, dnb = _chunks(v, C), _chunks(dnum, C)
    Sx, _ = _excl_cumsum(torch.bmm(rk.transpose(1, 2), vb).view(BH, nc, m, e), S0)
    Gx, G = _excl_suffix(torch.bmm(rq.transpose(1, 2), dnb).view(BH, nc, m, e), G)
    Sx, Gx = Sx.view(-1, m, e), Gx.view(-1, m, e)
    P = torch.bmm(dnb, vb.transpose(1, 2)).tril_()  # P[n, j] = dnum_n . v_j, j <= n
    A = torch.bmm(rq, rk.transpose(1, 2)).tril_()
    drq = torch.bmm(dnb, Sx.transpose(1, 2)).baddbmm_(P, rk).view(BH, t, m)
    drk = torch.bmm(vb, Gx.transpose(1, 2)).baddbmm_(P.transpose(1, 2), rq).view(BH, t, m)
    dv = torch.bmm(rk, Gx).baddbmm_(A.transpose(1, 2), dnb).view(BH, t, e)
    if rot is not None:
        drq, drk = _rotate(drq, rot.conj()), _rotate(drk, rot.conj())
    dphq, dphk = dfq.view(BH, t, m).add_(drq), dfk.view(BH, t, m).add_(drk)
    if w is None:  # q and k were the features
        return dphq, (dphk if km is None else dphk.mul_(km.unsqueeze(-1))), dv, G, Zq
    # phi = exp(a), so da = dphi * phi (masked keys have phi = 0); then back through the GEMM
    da, db = dphq.mul_(phq), dphk.mul_(phk)
    dq = (da @ w).mul_(scale)
    dk = (db @ w).sub_(xks * db.sum(-1, keepdim=True)).mul_(scale)
    return dq, dk, dv, G, Zq


_compiled: dict = {}


def use_compile(enabled: bool = True) -> None:
    """Run the block functions through ``torch.compile`` (Inductor fuses the elementwise work).
    Off by default: compiling costs tens of seconds per shape, needs a C++ compiler on CPU, and
    eager is the tested reference path."""
    _compiled.clear()
    if enabled:
        _compiled["forward"] = torch.compile(_block_forward, dynamic=False)
        _compiled["backward"] = torch.compile(_block_backward, dynamic=False)


def _block_rot(rot, sl):
    if rot is None:
        return None
    return rot[sl] if rot.dim() == 2 else rot[:, sl]


class _ChunkCausal(torch.autograd.Function):
    """(q, k, v, S0, z0) -> (out, S, z): causal Eq. 19 from the state (S0, z0), blockwise."""

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, km, w, wq, wk, scale, rot, C, T):
        with torch.autocast(v.device.type, enabled=False):  # the math stays in float32 or wider
            BH, N, e = v.shape
            fwd = _compiled.get("forward", _block_forward)
            out = torch.empty_like(v)
            den = torch.empty(BH, N, dtype=v.dtype, device=v.device)
            S, z = S0, z0
            starts_S, starts_z = [], []
            for b0 in range(0, N, T):
                sl = slice(b0, min(b0 + T, N))
                starts_S.append(S), starts_z.append(z)
                kb = None if km is None else km[:, sl]
                out[:, sl], den[:, sl], S, z = fwd(q[:, sl], k[:, sl], v[:, sl], kb, w, wq, wk, scale,
                                                   _block_rot(rot, sl), S, z, C)
            ctx.save_for_backward(q, k, v, km, w, wq, wk, rot, out, den, torch.stack(starts_S), torch.stack(starts_z))
            ctx.scale, ctx.C, ctx.T = scale, C, T
            return out, S, z

    @staticmethod
    def backward(ctx, g, gS, gz):
        if torch.is_grad_enabled():  # create_graph=True: the backward is hand-written, not differentiable
            raise RuntimeError("rotary_linear_attention: double backward (create_graph=True) is not supported")
        with torch.autocast(g.device.type, enabled=False):
            q, k, v, km, w, wq, wk, rot, out, den, starts_S, starts_z = ctx.saved_tensors
            scale, C, T = ctx.scale, ctx.C, ctx.T
            BH, N, e = v.shape
            bwd = _compiled.get("backward", _block_backward)
            g = g.to(v.dtype).contiguous()
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            # suffix sums after the last block: the gradient of the final state
            G, Zq = gS.to(v.dtype).clone(), gz.to(v.dtype).clone()
            for i, b0 in reversed(list(enumerate(range(0, N, T)))):
                sl = slice(b0, min(b0 + T, N))
                kb = None if km is None else km[:, sl]
                dq[:, sl], dk[:, sl], dv[:, sl], G, Zq = bwd(
                    q[:, sl], k[:, sl], v[:, sl], kb, g[:, sl], out[:, sl], den[:, sl], w, wq, wk, scale,
                    _block_rot(rot, sl), starts_S[i], starts_z[i], G, Zq, C,
                )
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
