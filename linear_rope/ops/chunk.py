"""The fast path of Eq. 19: chunked causal (hand-written backward) and closed-form bidirectional.

The causal path is the custom op ``linear_rope::chunk_causal`` (``chunk_op.py``: one node under
``torch.compile``, any sequence length), whose forward and backward walks live in
``chunk_fwd.py`` and ``chunk_bwd.py``, over the layout of ``layout.py``. On CUDA (and
anywhere with ``LINEAR_ROPE_BACKEND=parallel``) a causal call takes the chunk-parallel path of
``parallel.py`` instead: plain torch ops, no host sync.

Here are the torch path's pieces that the public op (``api.py``) calls, in the one signature of
``prepare.run_torch``: ``chunked_causal``, and ``bidirectional`` / ``documents`` without
``causal``. They compute what ``naive.py`` writes out, with O(N) time and memory:

* **Causal, chunk form.** The sequence is walked in blocks of ``block_size`` tokens (small
  enough to stay in cache). A block is laid out chunk-major, `[nc, BH, C, x]`, and every step is
  one batched GEMM over all its chunks and rows at once: the masked `[C, C]` products inside
  each chunk, the per-chunk states ``rk^T v`` (written by one bmm straight into a buffer whose
  slot 0 is the state before the block), their prefix sums (in place, additions only), and
  ``rq @ S`` for every chunk. The backward has the same shape, with suffix sums ``G = sum
  rq dnum^T`` and ``Zq = sum dden phi(q)`` that are also the gradients of the initial state.
* **Denominator.** Eq. 18 (no rotation): a column of ones on v and the column z on S, so the
  numerator's GEMMs give it for free. Eq. 19: phi(q) . z + the rows of tril(phi(q) phi(k)^T),
  GEMMs of its own.
* **FAVOR+ inside** (``projection``): the stabiliser shifts of ``features.favor_features`` are
  folded into the projection GEMM (extra input columns); a masked key's ``-|k|^2/2`` column
  holds -1e30, so its features are exactly 0 out of the same exp. The features are kept for
  the backward while both fit ``chunk_fwd.KEEP_FEATURES_BYTES``, and recomputed per block
  above that.
  RoPE is one complex multiplication per tensor. Their gradient ignores the shifts, which
  cancel in the ratio.
* **Bidirectional**: ``R_t phi(q_t) . (sum_n R_n phi(k_n) v_n^T) / phi(q_t) . sum_n phi(k_n)``.
* **Keywords.** ``mask``: padded tokens' q, k, v are replaced by 0 (selected, never multiplied:
  0 * NaN is NaN; on the causal path block by block, in the copies the walk makes anyway),
  masked keys' features are 0 (so they add to neither sum) and masked queries output 0;
  positions count real tokens only. ``cu_seqlens`` (causal) runs all
  packed documents in one call: each is padded to whole chunks, and the prefix / suffix sums
  restart at its first chunk from its own initial state; an empty document keeps its state.
* **Transforms.** Under ``torch.func`` (``vmap``, ``grad``, ``jacrev``, ``jvp``, ``jacfwd``) and
  with forward-mode AD the causal path is ``composite.composite_causal``, the same chunk form in
  plain differentiable ops (the custom op's backward is hand-written, and it has no forward-mode
  rule); the bidirectional path is plain ops already.

Inside, everything is float32 or wider with autocast off (the chunk-parallel path: bf16 GEMM
operands with float32 results for bf16 inputs or under a bf16 autocast); the result has v's dtype.
"""
from __future__ import annotations

import torch

from ..rotary import rotate_with_tables
from .chunk_op import chunk_causal
from .composite import features
from .layout import OpConfig
from .rope_tables import rope_tables
from .utils import LinearAttentionState

__all__ = ["chunked_causal", "bidirectional", "documents", "CHUNK", "BLOCK"]

CHUNK = 64
BLOCK = 256  # tokens per block: small blocks stay in cache (measured best of 64..4096 on 2-core EPYC)


def chunked_causal(q, k, v, w, a, cfg: OpConfig):
    """The custom op on the checked arguments ``a``, in the compute dtype -> out, S, z."""
    B, H, N, e = v.shape
    rows = B if a.docs is None else len(a.docs)
    if a.state is None:
        S0, z0 = v.new_zeros(rows, H, a.m, e), v.new_zeros(rows, H, a.m)
    else:
        S0, z0 = a.state.S.to(v.dtype), a.state.z.to(v.dtype)
    none = v.new_empty(0)
    aux = [none if t is None else t for t in (a.kmask, w, a.positions)]
    out, S, z = chunk_causal(q, k, v, [S0, z0], aux, cfg.to_list(), float(cfg.base))[:3]
    return out, S, z


def bidirectional(q, k, v, w, a, cfg: OpConfig):
    """Closed form: every query sees every (real) key of its row."""
    fq, fk = features(q, k, w, a.kmask)
    rq, rk = fq, fk
    if cfg.rotary:
        tables = rope_tables(q.shape[2], a.m, cfg.offset, cfg.base, a.positions, v.device, v.dtype)
        rq, rk = rotate_with_tables(fq, *tables), rotate_with_tables(fk, *tables)
    S = rk.transpose(-1, -2) @ v  # (B, H, m, e)
    z = fk.sum(-2)  # (B, H, m)
    if a.state is not None:
        S, z = S + a.state.S.to(S.dtype), z + a.state.z.to(z.dtype)
    den = (fq * z.unsqueeze(-2)).sum(-1)
    out = (rq @ S) / torch.where(den <= 0, 1, den).unsqueeze(-1)  # as naive: NaN stays NaN
    if a.qmask is not None:
        out = torch.where(a.qmask[:, None, :, None], out, 0)
    return out, S, z


def documents(q, k, v, w, a, cfg: OpConfig):
    """Bidirectional packed documents: one closed form per document (positions already resolved)."""
    outs, Ss, zs = [], [], []
    for d, (s, e) in enumerate(a.docs):
        sl = lambda t: None if t is None else t[:, s:e]  # noqa: E731
        st = None if a.state is None else LinearAttentionState(a.state.S[d : d + 1], a.state.z[d : d + 1])
        ad = a._replace(positions=sl(a.positions), qmask=sl(a.qmask), kmask=sl(a.kmask), docs=None, state=st)
        o, S, z = bidirectional(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], w, ad, cfg)
        outs.append(o), Ss.append(S), zs.append(z)
    return torch.cat(outs, dim=2), torch.cat(Ss), torch.cat(zs)
