"""The fast path of Eq. 19: chunked causal (hand-written backward) and closed-form bidirectional.

The causal path is the custom op ``linear_rope::chunk_causal`` (``chunk_op.py``: one node under
``torch.compile``, any sequence length), whose forward and backward walks live in
``chunk_fwd.py`` and ``chunk_bwd.py``, over the layout of ``layout.py``. On CUDA (and
anywhere with ``LINEAR_ROPE_BACKEND=parallel``) a causal call takes the chunk-parallel path of
``parallel.py`` instead: plain torch ops, no host sync.

``rotary_linear_attention`` is the public op. It computes what ``naive.py`` writes out, with
O(N) time and memory:

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

import functools
import os

import torch
import torch.nn.functional as F

from ..checks import is_compiling, is_transformed
from .triton.dispatch import ENV_VAR, KernelError, backend, fallback, record, should_use_triton, takes_parallel
from ..rotary import rotate_with_tables
from .chunk_op import chunk_causal
from .composite import composite_causal, features
from .parallel import PACKED_REASON, checks_enabled, compute_dtypes, parallel_causal, rope_tables, segment_tokens
from .layout import OpConfig
from .utils import LinearAttentionState, Options, check_args, check_final_state, normalise_scale

__all__ = ["rotary_linear_attention", "CHUNK", "BLOCK"]

CHUNK = 64
BLOCK = 256  # tokens per block: small blocks stay in cache (measured best of 64..4096 on 2-core EPYC)


def _causal(q, k, v, w, a, cfg: OpConfig):
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


def _parallel(q, k, v, w, a, cfg: OpConfig, C: int, lowp, segment: int):
    """The chunk-parallel path (``parallel.py``) on the checked arguments."""
    return parallel_causal(q, k, v, w, a, C, cfg.rotary, cfg.offset, cfg.base, lowp=lowp, segment=segment)


def _bidirectional(q, k, v, w, a, cfg: OpConfig):
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


def _documents(q, k, v, w, a, cfg: OpConfig):
    """Bidirectional packed documents: one closed form per document (positions already resolved)."""
    outs, Ss, zs = [], [], []
    for d, (s, e) in enumerate(a.docs):
        sl = lambda t: None if t is None else t[:, s:e]  # noqa: E731
        st = None if a.state is None else LinearAttentionState(a.state.S[d : d + 1], a.state.z[d : d + 1])
        ad = a._replace(positions=sl(a.positions), qmask=sl(a.qmask), kmask=sl(a.kmask), docs=None, state=st)
        o, S, z = _bidirectional(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], w, ad, cfg)
        outs.append(o), Ss.append(S), zs.append(z)
    return torch.cat(outs, dim=2), torch.cat(Ss), torch.cat(zs)


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
    chunk_size: int | None = None,
    block_size: int | None = None,
):
    """Linear attention with RoPE in the numerator only (RoFormer Eq. 19), fast path.

    Args:
        q, k: `[B, H, N, m]` non-negative features; or, with ``projection``, raw queries and
            keys `[B, H, N, d]` whose FAVOR+ features are computed inside (fused: never stored).
        v: `[B, H, N, e]` values.
        causal: token t sees tokens n <= t; otherwise every token (bidirectional).
        rotary: RoPE on the features in the numerator (Eq. 19); False gives Eq. 18.
        offset: position of token 0: an int, or a LongTensor `[B]` per row (`[D]` per document).
            Positions are integers up to ``linear_rope.rotary.MAX_POSITION`` = 2**62 - 1 (a
            ValueError beyond); every angle is reduced modulo 2 pi exactly, so position 2**62 - 1
            is as accurate as position 0.
        base: RoPE base, a finite number > 0.
        projection: `[m, d]` FAVOR+ projection (``FavorFeatures.projection``), m >= 1; a fixed
            random draw, so it gets no gradient (in either AD mode).
        mask: `[B, N]` bool, True = real token. Masked keys add nothing to the numerator or the
            denominator; masked queries output 0. A token's position is ``offset`` plus the
            number of real tokens before it, so a padded row (left or right) gives what the row
            gives alone. Padding is selected away, never multiplied by 0: whatever a masked
            token holds (NaN, inf, huge), the real tokens' outputs, states and gradients are
            exactly those of the same call with zeros there.
        key_mask: `[B, M]` bool, for cross-attention: k, v of length M (any M) from another
            sequence; needs ``causal=False, rotary=False``. In cross-attention (``key_mask``
            given, or M != N) ``key_mask`` alone masks the keys (None: all real) and ``mask``
            the queries only; k of q's length without ``key_mask`` is self-attention, where
            ``mask`` masks both.
        cu_seqlens: int32 `[D+1]` cumulative lengths of D documents packed in one row
            (B = 1), never decreasing (an empty document keeps its state): each gets what it
            gets alone (positions, state and feature scale restart).
        initial_state: ``LinearAttentionState`` of the tokens before these (`[B, ...]`, or
            `[D, ...]` with ``cu_seqlens``), e.g. from ``output_final_state``; S and z finite.
        output_final_state: also return the state after the last token.
        allow_negative: skip the check that feature inputs are >= 0 (without ``projection``).
            The check holds in eager (ValueError) and under ``torch.compile`` (the same message
            from ``torch._assert_async``, a RuntimeError when the graph runs).
        chunk_size, block_size: the chunk of the masked products and the block walked at once
            by the causal torch path (memory is O(block_size * m) plus O(N / block_size * m * e));
            any values work. Default ``CHUNK`` and ``BLOCK``. On the chunk-parallel path
            ``block_size`` is the segment (tokens whose per-chunk states are held at once;
            default: all while they fit ``parallel.STATE_BYTES``).

    A keyword that would have no effect in the call is refused (ValueError naming it), not
    dropped: ``offset`` or a ``base`` other than the default with ``rotary=False``,
    ``allow_negative`` with ``projection``, ``chunk_size`` / ``block_size`` with
    ``causal=False`` or where the Triton kernels are forced (``LINEAR_ROPE_BACKEND=triton``; on
    ``auto`` they keep the call on the torch path). Flags must be True or False.

    Returns:
        `[B, H, N, e]` in v's dtype, or ``(out, state)`` with ``output_final_state``.
        Double backward of the fast path is not supported (one-line RuntimeError; under
        ``torch.func`` the composite path below is differentiable to any order); nor is
        ``torch.jit.trace`` of the causal path (use ``torch.compile``). B = 0, H = 0, N = 0 or
        e = 0 give empty results (N = 0: the state passes through).

    Backends (``LINEAR_ROPE_BACKEND``): ``auto`` (the default) runs a causal call on CUDA
    tensors through the chunk-parallel path (``parallel.py``: plain torch ops, a fixed number of
    kernels at any N, no host sync, bf16 tensor-core products under a bf16 autocast), and on
    other devices through the torch path (the custom op's block walk, the fastest on a CPU).
    ``parallel`` takes the chunk-parallel path on any device; ``torch`` the torch path. On the
    chunk-parallel path the checks that read tensor values (features >= 0, a finite projection
    and state, offsets in range, a finite final key sum) are off unless ``LINEAR_ROPE_CHECKS=1``
    (each would make the GPU wait); packed documents (``cu_seqlens``) go to the torch path there,
    with the reason recorded (``record_paths``). ``triton`` takes the fused Triton kernels
    (``linear_rope.ops.triton``; raises with the reason for a call they do not take), which
    ``auto`` picks only once a GPU run in this process has measured them faster than the
    chunk-parallel path (``dispatch.note_triton_measured``). ``fla`` forces the fla-core path
    (``fla_path.py``, causal only, CUDA, ``pip install 'linear_rope[fla]'``; ValueError with the
    reason otherwise). Inside ``torch.compile`` the op is the chunk-parallel path's plain ops
    where the backend picks it, else the custom op ``linear_rope::chunk_causal``. Under the
    ``torch.func`` transforms and forward-mode AD the causal path is ``composite_causal``
    (correct tangents, batching and higher derivatives).

    Feature scale: Eq. 19 is invariant to scaling phi(q_t) per query and all phi(k) of a row
    (or packed document) with its state, and so is this op for finite features anywhere in the
    float32 range (see ``utils.normalise_scale``); a final state whose key sum overflows is a
    ValueError (a RuntimeError from ``torch._assert_async`` under ``torch.compile``).
    """
    par = isinstance(q, torch.Tensor) and takes_parallel(q)  # the chunk-parallel backend: no host syncs
    read = not par or checks_enabled()
    a = check_args(q, k, v, Options(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection,
                   mask=mask, key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                   allow_negative=allow_negative, output_final_state=output_final_state), read_values=read)
    sizes = chunk_size is not None or block_size is not None
    for name, val in (("chunk_size", chunk_size), ("block_size", block_size)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if sizes and not causal:
        raise ValueError("chunk_size / block_size: the bidirectional closed form walks no chunks, so they have no "
                         "effect with causal=False; leave them out")
    transformed = is_transformed(q, k, v, *(a.state or ()))
    par = par and not transformed and a.docs is None  # packed documents: the torch path (PACKED_REASON)
    if causal and torch.jit.is_tracing() and not par:
        raise RuntimeError("rotary_linear_attention: torch.jit.trace cannot record the causal path (a custom op "
                           "that walks blocks in Python); use torch.compile instead")
    if backend() == "fla" and not is_compiling() and not transformed:  # forced: fla-core's kernels or an error
        return _forced_fla(q, k, v, dict(causal=causal, rotary=rotary, offset=offset, base=base,
                                         projection=projection, mask=mask, key_mask=key_mask, cu_seqlens=cu_seqlens,
                                         initial_state=initial_state, output_final_state=output_final_state,
                                         allow_negative=allow_negative))
    if causal and not is_compiling() and not transformed:
        kw = dict(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection, mask=mask,
                  key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                  output_final_state=output_final_state, allow_negative=allow_negative)
        if should_use_triton(q, k, v, **kw):  # CUDA + Triton (or LINEAR_ROPE_BACKEND=triton)
            if not sizes:
                from .triton import rotary_linear_attention as triton_op

                try:
                    return triton_op(q, k, v, **kw)
                except KernelError as e:  # a kernel failed to build or launch: the torch path, said once
                    if backend() == "triton":
                        raise
                    fallback(str(e))
                    record(f"{'parallel' if par else 'torch'} path ({e})", replace=True)
            elif backend() == "triton":
                raise ValueError(f"chunk_size / block_size: the Triton kernels pick their own chunk, so they have no "
                                 f"effect with {ENV_VAR}=triton; leave them out, or set {ENV_VAR}=torch")
            elif not par:  # auto: explicit sizes keep the call on the torch path, where they apply
                record("torch path (chunk_size / block_size given: they apply on the torch path)", replace=True)
        if a.docs is not None and takes_parallel(q):
            record(f"torch path ({PACKED_REASON})", replace=True)
    out_dtype = v.dtype
    cdt, lowp = compute_dtypes(q.dtype, q.device.type)
    B, H, N, e = q.shape[:3] + v.shape[-1:]
    if B * H == 0 or N == 0:
        return _empty(q, k, v, a, cdt, output_final_state)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
        if not causal or transformed or par:  # (the custom op selects padding away block by block, in its copies)
            q, k, v = _drop_padding(q, k, v, a)
        state, sk = a.state, None
        if projection is None:  # FAVOR+ features inside are stabilised already
            q, k, state, sk = normalise_scale(q, k, a.kmask, state, a.docs, sync=not par)
        if e == 0:  # no value columns: one zero column keeps every path's shapes, z stays right
            v = F.pad(v, (0, 1))
            state = None if state is None else LinearAttentionState(F.pad(state.S, (0, 1)), state.z)
        full = a._replace(state=state)
        a = _without_empty_documents(full)
        w = None if projection is None else projection.detach().to(cdt)
        cu = () if a.docs is None else (0, *(end for _, end in a.docs))
        cfg = OpConfig(chunk_size or CHUNK, block_size or BLOCK, a.offset if isinstance(a.offset, int) else 0, rotary,
                       cu, float(base))
        if causal and par:
            C = min(chunk_size or CHUNK, N)
            seg = segment_tokens(B, H, N, a.m, v.shape[-1], C, block_size)
            path = functools.partial(_parallel, C=C, lowp=lowp, segment=seg)
        elif causal:
            path = composite_causal if transformed else _causal
        else:
            path = _bidirectional if a.docs is None else _documents
        out, S, z = path(q, k, v, w, a, cfg)
        if a is not full:
            S, z = _with_empty_documents(S, z, full, v)
    out = out[..., :e].to(out_dtype)
    if not output_final_state:
        return out
    S = S[..., :e]
    return out, (LinearAttentionState(S, z) if sk is None else check_final_state(S, z, sk, read_values=read))


def _forced_fla(q, k, v, kw):
    """``LINEAR_ROPE_BACKEND=fla``: the fla-backed path (``fla_path.py``), or a one-line
    ValueError with the reason it cannot take the call (never a silent fallback)."""
    from . import fla_path

    ok, why = fla_path.supports_fla(q, k, v, **kw)
    if not ok:
        raise ValueError(f"backend 'fla' was forced, but {why}")
    record(f"fla path (fla-core chunk_linear_attn, tested with {fla_path.FLA_TESTED})")
    return fla_path.fla_rotary_linear_attention(q, k, v, **kw)


def _drop_padding(q, k, v, a):
    """Padded tokens' q, k, v replaced by 0: selected, never multiplied (0 * NaN is NaN), so that
    whatever they hold, the real tokens' outputs, states and gradients are what they are
    without it (the paths then mask what the zeros would still add)."""
    if a.qmask is not None:
        q = torch.where(a.qmask[:, None, :, None], q, 0)
    if a.kmask is not None:
        k, v = (torch.where(a.kmask[:, None, :, None], t, 0) for t in (k, v))
    return q, k, v


def _without_empty_documents(a):
    """The arguments without the packed documents of no tokens (and their state rows); ``a``
    itself where there are none."""
    if a.docs is None or all(e > s for s, e in a.docs):
        return a
    keep = [d for d, (s, e) in enumerate(a.docs) if e > s]
    st = a.state
    if st is not None:
        st = LinearAttentionState(st.S[keep], st.z[keep])
    return a._replace(docs=[a.docs[d] for d in keep], state=st)


def _with_empty_documents(S, z, full, like):
    """The final states of every document of ``full``: a computed one, or, for an empty document,
    its initial state (zeros without one)."""
    Ss, zs, i = [], [], 0
    m, e = S.shape[2], S.shape[3]
    for d, (s, t) in enumerate(full.docs):
        if t > s:
            Ss.append(S[i : i + 1]), zs.append(z[i : i + 1])
            i += 1
        elif full.state is not None:
            Ss.append(full.state.S[d : d + 1].to(S.dtype)), zs.append(full.state.z[d : d + 1].to(z.dtype))
        else:
            Ss.append(like.new_zeros(1, S.shape[1], m, e)), zs.append(like.new_zeros(1, S.shape[1], m))
    return torch.cat(Ss), torch.cat(zs)


def _empty(q, k, v, a, cdt, output_final_state):
    """B = 0, H = 0 or N = 0: empty outputs of the right shapes, as ``nn.Linear`` gives, still
    connected to q, k, v (and the state), so that their gradients come back (empty, or the
    state's own: with no tokens the final state is the initial one)."""
    B, H, N, e = q.shape[:3] + v.shape[-1:]
    link = sum(t[..., :0].sum() for t in (q, k, v)).to(cdt)  # exactly 0, and connected to q, k, v
    out = v.new_zeros(B, H, N, e) + link.to(v.dtype)
    if not output_final_state:
        return out
    if a.state is not None:
        return out, LinearAttentionState(a.state.S.to(cdt) + link, a.state.z.to(cdt) + link)
    rows = B if a.docs is None else len(a.docs)
    return out, LinearAttentionState(v.new_zeros(rows, H, a.m, e, dtype=cdt) + link,
                                     v.new_zeros(rows, H, a.m, dtype=cdt) + link)
