"""The forward of the chunked causal path: one block's kernels, and the walk over the blocks.

A block of ``walk.T`` tokens is laid out chunk-major, `[nc, BH, C, x]`, and every step is one
batched GEMM over all its chunks and rows at once:

* the features (FAVOR+ inside: ``favor_inputs`` @ ``favor_projection``, then ``favor_exp_``);
* the per-chunk states ``rk^T v``, written by one bmm straight into a buffer whose slot 0 is
  the state before the block, then summed over the chunks in place (additions only);
* the masked `[C, C]` products inside each chunk, and ``rq @ S`` for every chunk;
* the denominator: Eq. 18 rides in the numerator's GEMMs (a column of ones on v, the column z
  on S); Eq. 19's unrotated one is ``tril(phi(q) phi(k)^T)`` summed over its rows plus
  ``phi(q) . z``, one more bmm per block instead of a running sum over the features.

``Walk`` holds what every block of a call shares; ``causal_forward`` walks the blocks, carrying
the state, with resets where packed documents start, and fills the buffers the backward reuses
(``keep_plan``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..features import favor_exp_, favor_inputs
from . import workspace

__all__ = ["Walk", "Favor", "KEEP_FEATURES_BYTES", "KEPT", "keep_plan", "causal_forward", "block_features",
           "chunk_major", "bmm_batch", "rotate", "prefix_", "block_rot", "safe_den", "select"]

# What the forward keeps for the backward (see ``keep_plan``) stays under this size; the rest
# is recomputed block by block (the memory stays O(block) at any length).
KEEP_FEATURES_BYTES = 512 << 20


class Favor(NamedTuple):
    """FAVOR+ inside: the projection `[m, d]` and its stabilised forms (``features.favor_projection``)."""

    w: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor


class Walk(NamedTuple):
    """What every block of one call shares. Rows are flattened: BH = B * H."""

    C: int  # chunk: the masked products are [C, C]
    T: int  # block: tokens walked at once, a multiple of C
    favor: Favor | None  # FAVOR+ inside, or None: q and k are the features
    rot: torch.Tensor | None  # complex RoPE table [Np, m/2] (shared) or [B, Np, m/2] (per row), or None
    km: torch.Tensor | None  # [BH, Np] 0/1 real keys (queries at 0 output 0), or None: all real
    starts: tuple[int, ...]  # the chunk each packed document starts at; (0,) when nothing is packed


def safe_den(den):
    """The divisor for a denominator kept as 0 where it was <= 0 (see ``block_forward``); a NaN
    stays NaN (it is not "<= 0": a NaN input never turns into a finite output)."""
    return torch.where(den <= 0, 1, den)


def chunk_major(x, C):
    """`[BH, t, x]` -> `[nc, BH, C, x]`, chunk-major (a view; ``.contiguous()`` copies it).

    Chunk-major makes every per-chunk batch one contiguous run: the chunk states of a block
    are written by one bmm straight into a buffer with a slot in front for the state before
    the block, and the sums over chunks run in place over whole slabs.
    """
    BH, t, n = x.shape
    return x.view(BH, t // C, C, n).transpose(0, 1)


def bmm_batch(t):
    """`[nc, BH, C, x]` -> `[nc*BH, C, x]`: one batch entry per (chunk, row) for bmm."""
    return t.view(-1, *t.shape[-2:])


def block_rot(walk, sl):
    """The block's slice of the rotation table, chunk-major: `[nc, 1, C, m/2]` or `[nc, B, 1, C, m/2]`."""
    rot, C = walk.rot, walk.C
    if rot is None:
        return None
    if rot.dim() == 2:
        r = rot[sl]
        return r.view(-1, 1, C, r.shape[-1])
    r = rot[:, sl]
    B, t, h = r.shape
    return r.view(B, t // C, C, h).transpose(0, 1).unsqueeze(2)


def rotate(phi, rot):
    """Interleaved pairs of phi `[nc, BH, C, m]` times the complex table of ``block_rot``: one
    complex multiplication (4x faster than strided real arithmetic in eager)."""
    nc, BH, C, m = phi.shape
    shape = (nc, rot.shape[1], BH // rot.shape[1], C, m // 2) if rot.dim() == 5 else (nc, BH, C, m // 2)
    return torch.view_as_real(torch.view_as_complex(phi.reshape(*shape, 2)) * rot).view(nc, BH, C, m)


def prefix_(buf, resets=None):
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
        if c in resets:
            ends[c] = buf[c - 1] + buf[c]
            buf[c] = resets[c]
        else:
            buf[c] += buf[c - 1]
    return ends


def select(x, kmc):
    """x `[nc, BH, C, x]` (a chunk-major view) as a contiguous copy, padding (kmc 0) replaced by 0:
    selected, never multiplied (0 * NaN is NaN), in the copy the layout needs anyway."""
    if kmc is None:
        return x.contiguous()
    return torch.where(kmc.unsqueeze(-1) > 0, x, 0).contiguous()


def block_features(walk, q, k, kmc, keep=None):
    """Chunk-major features of one block: q, k `[nc, BH, C, d or m]`, kmc `[nc, BH, C]` 0/1 or
    None -> phi(q), phi(k) `[nc, BH, C, m]` (padded tokens 0: selected, whatever q and k held
    there), written into ``keep`` {"phq", "phk"} when given."""
    if walk.favor is None:
        return select(q, kmc), select(k, kmc)
    keep = keep or {}
    f = walk.favor
    phq = favor_exp_(torch.matmul(favor_inputs(q, is_query=True, key_mask=kmc), f.wq.t(), out=keep.get("phq")),
                     is_query=True)
    km = None if kmc is None else kmc.unsqueeze(-1)
    phk = torch.matmul(favor_inputs(k, is_query=False, key_mask=kmc), f.wk.t(), out=keep.get("phk"))
    return phq, favor_exp_(phk, is_query=False, key_mask=km)


def _put(dst, src):
    """dst[...] = src, unless src already is dst (a state kept in place between blocks)."""
    if not (dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride()):
        dst.copy_(src)


def _chunk_states(phk, vals, state, buf, resets):
    """buf `[nc+1, BH, m, x]`: the state before each chunk of the block, then after it.
    Returns {c: the state after the packed document that ends before chunk c}."""
    _put(buf[0], state)
    torch.bmm(bmm_batch(phk).transpose(1, 2), bmm_batch(vals), out=bmm_batch(buf[1:]))
    return prefix_(buf, resets)


def block_forward(walk, blk, state, keep, resets):
    """One block. blk: (q, k, v, km, sl) with q, k `[BH, t, d or m]`, v `[BH, t, e]`, km
    `[BH, t]` 0/1 or None, sl its slice of the sequence; state (S `[BH, m, e]`, z `[BH, m]`)
    before it. ``keep``: its slices of the buffers of ``keep_plan`` ("S" and "z": the state
    before every chunk, slot 0 shared with the previous block's last). ``resets`` {c: (S0, z0)}:
    packed documents starting at its chunks c >= 1.

    Returns out `[nc, BH, C, e]`, den `[nc, BH, C]`, the state after the block and {c: (S, z)}
    after each packed document that ends inside it.
    """
    q, k, v, km, sl = blk
    C, (S, z) = walk.C, state
    BH, t, e = v.shape
    m, nc = S.shape[1], t // C
    kmc = None if km is None else chunk_major(km.unsqueeze(-1), C).squeeze(-1)  # (nc, BH, C)
    phq, phk = block_features(walk, chunk_major(q, C), chunk_major(k, C), kmc, keep)  # (nc, BH, C, m)
    A_out = bmm_batch(keep["A"]) if "A" in keep else None
    rot = block_rot(walk, sl)
    if rot is None:  # Eq. 18: [S | z] before each chunk, v with a ones column
        va = v.new_empty(nc, BH, C, e + 1)
        va[..., :e] = chunk_major(v, C)
        if kmc is not None:  # padded values selected away
            va[..., :e].masked_fill_(kmc.unsqueeze(-1) == 0, 0.0)
        va[..., e] = 1.0
        Sb = keep["S"] if "S" in keep else v.new_empty(nc + 1, BH, m, e + 1)
        _put(Sb[0, ..., :e], S), _put(Sb[0, ..., e], z)
        torch.bmm(bmm_batch(phk).transpose(1, 2), bmm_batch(va), out=bmm_batch(Sb[1:]))
        ends = prefix_(Sb, resets and {c: torch.cat((a, b.unsqueeze(-1)), -1) for c, (a, b) in resets.items()})
        ends = {c: (x[..., :e], x[..., e]) for c, x in ends.items()}
        A = torch.bmm(bmm_batch(phq), bmm_batch(phk).transpose(1, 2), out=A_out).tril_()
        numa = torch.bmm(bmm_batch(phq), bmm_batch(Sb[:nc])).baddbmm_(A, bmm_batch(va)).view(nc, BH, C, e + 1)
        num, den = numa[..., :e], numa[..., e]
        S, z = Sb[nc, ..., :e], Sb[nc, ..., e]
    else:
        vc = select(chunk_major(v, C), kmc)
        zb = keep["z"] if "z" in keep else v.new_empty(nc + 1, BH, m)
        _put(zb[0], z)
        torch.sum(phk, 2, out=zb[1:])
        ends_z = prefix_(zb, resets and {c: b for c, (_, b) in resets.items()})
        # the unrotated denominator: phi(q_n) . (z before the chunk + the chunk's keys j <= n)
        Ad = torch.bmm(bmm_batch(phq), bmm_batch(phk).transpose(1, 2)).tril_()
        den = torch.bmm(bmm_batch(phq), zb[:nc].reshape(-1, m, 1)).squeeze(-1).add_(Ad.sum(-1)).view(nc, BH, C)
        rq, rk = rotate(phq, rot), rotate(phk, rot)
        Sb = keep["S"] if "S" in keep else v.new_empty(nc + 1, BH, m, e)
        ends_S = _chunk_states(rk, vc, S, Sb, resets and {c: a for c, (a, _) in resets.items()})
        ends = {c: (ends_S[c], ends_z[c]) for c in ends_S}
        A = torch.bmm(bmm_batch(rq), bmm_batch(rk).transpose(1, 2), out=A_out).tril_()
        num = torch.bmm(bmm_batch(rq), bmm_batch(Sb[:nc])).baddbmm_(A, bmm_batch(vc)).view(nc, BH, C, e)
        S, z = Sb[nc], zb[nc]
    # A query that sees no real key (left padding) has num = den = 0: the guard gives 0. As in
    # naive, a denominator <= 0 (relu features with disjoint supports, allow_negative) divides by
    # 1 and passes no gradient to den: den is kept as 0 there, for the backward.
    den = torch.where(den <= 0, 0, den)
    out = num / safe_den(den).unsqueeze(-1)
    if kmc is not None:
        out *= kmc.unsqueeze(-1)
    if "S" not in keep:
        S, z = S.clone(), z.clone()
    return out, den, (S, z), ends


KEPT = ("A", "phq", "phk", "S", "z")  # the buffers ``keep_plan`` may fill, in this order


def keep_plan(sizes, fused: bool, rotary: bool, like, sizes_only: bool = False):
    """Buffers the forward fills for the backward, greedily while they fit ``KEEP_FEATURES_BYTES``,
    in order of GEMM work saved per byte: the masked intra-chunk products A `[NC, BH, C, C]`
    (2 m flops per element), the FAVOR+ features `[NC, BH, C, m]` each (two GEMMs and an exp),
    the states before every chunk `[NC + 1, BH, m, e (+1)]` (one GEMM and the sums).

    sizes (NC, BH, C, m, e); ``fused``: FAVOR+ inside. Returns {name: empty buffer} (or, with
    ``sizes_only``, {name: shape})."""
    NC, BH, C, m, e = sizes
    want = {"A": (NC, BH, C, C)}
    if fused:
        want.update(phq=(NC, BH, C, m), phk=(NC, BH, C, m))
    want["S"] = (NC + 1, BH, m, e + (not rotary))
    if rotary:
        want["z"] = (NC + 1, BH, m)
    left, plan = KEEP_FEATURES_BYTES, {}
    for group in (("A",), ("phq", "phk"), ("S", "z")):
        names = [n for n in group if n in want]
        size = sum(math.prod(want[n]) for n in names) * like.element_size()
        if names and size <= left:
            left -= size
            plan.update({n: want[n] for n in names})
    return plan if sizes_only else {n: workspace.empty(s, like) for n, s in plan.items()}


def block_slices(bufs, c0, c1):
    """The slices of the kept buffers for the block of chunks [c0, c1) (states: c0 .. c1 inclusive)."""
    return {n: b[c0 : c1 + 1] if n in ("S", "z") else b[c0:c1] for n, b in bufs.items()}


def causal_forward(walk, qkv, state0, bufs):
    """qkv: q, k `[BH, Np, x]`, v `[BH, Np, e]` (Np a multiple of C); state0: S0 `[D, BH, m, e]`,
    z0 `[D, BH, m]`, one initial state per packed document. ``bufs``: from ``keep_plan``, filled here.

    Returns out `[BH, Np, e]`, the final states (S, z) per document, den `[Np/C, BH, C]` and the
    states before every block (`[nb, BH, m, e]`, `[nb, BH, m]`) for the backward."""
    (q, k, v), (S0, z0) = qkv, state0
    BH, N, e = v.shape
    C, T = walk.C, walk.T
    out = torch.empty_like(v)
    den = v.new_empty(N // C, BH, C)
    doc_at = {c: d for d, c in enumerate(walk.starts)}
    S_end, z_end = torch.empty_like(S0), torch.empty_like(z0)
    S, z = S0[0], z0[0]
    block_S, block_z = [], []
    for b0 in range(0, N, T):
        sl = slice(b0, min(b0 + T, N))
        c0, c1 = b0 // C, sl.stop // C
        if c0 in doc_at and c0 > 0:  # a document starts with this block
            d = doc_at[c0]
            S_end[d - 1], z_end[d - 1] = S, z
            S, z = S0[d], z0[d]
        block_S.append(S), block_z.append(z)
        km = None if walk.km is None else walk.km[:, sl]
        resets = {c - c0: (S0[d], z0[d]) for c, d in doc_at.items() if c0 < c < c1}
        o, den[c0:c1], (S, z), ends = block_forward(walk, (q[:, sl], k[:, sl], v[:, sl], km, sl), (S, z),
                                                    block_slices(bufs, c0, c1), resets or None)
        for c, (Se, ze) in ends.items():
            S_end[doc_at[c0 + c] - 1], z_end[doc_at[c0 + c] - 1] = Se, ze
        chunk_major(out[:, sl], C).copy_(o)
    S_end[-1], z_end[-1] = S, z
    return out, (S_end, z_end), den, (torch.stack(block_S), torch.stack(block_z))
