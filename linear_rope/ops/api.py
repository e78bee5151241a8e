"""The public op, ``rotary_linear_attention``: it checks the arguments once, asks ``backend.py``
which path takes the call (recorded there), and calls it.

The paths are its siblings, and none of them imports this module:

* the torch path: the chunked custom op (``chunk.py``), the closed form without ``causal``;
* the chunk-parallel path (``parallel.py``): the default for a causal call on CUDA;
* the composite path (``composite.py``): the causal chunk form under ``torch.func`` transforms
  and forward-mode AD;
* fla-core's kernels (``fla_path.py``), for the eager calls ``LINEAR_ROPE_BACKEND=fla`` sends;
* the fused path (``fused/``): Triton kernels with the FAVOR+ features made on chip, for the
  causal calls on CUDA tensors it takes (``auto``), or every causal call (``fused``: a refusal is
  a ValueError).

The torch ops' side (the compute dtype, padding, feature scale, empty calls and documents) is
``prepare.run_torch``.

Feature scale: Eq. 19 is invariant to scaling phi(q_t) per query and all phi(k) of a row (or
packed document) with its state, and so is this op for finite features anywhere in the float32
range (see ``utils.normalise_scale``); a final state whose key sum overflows is a ValueError (a
RuntimeError from ``torch._assert_async`` under ``torch.compile``).
"""
from __future__ import annotations

import torch

from ..checks import is_compiling, is_transformed
from .backend import backend, choose, record, takes_parallel
from .chunk import bidirectional, chunked_causal, documents
from .composite import composite_causal
from .fused import fused_refusal
from .fused.selfcheck import spec_of, verdict
from .parallel import checks_enabled, compute_dtypes
from .prepare import check_sizes, run_torch
from .utils import LinearAttentionState, Options, check_args

__all__ = ["rotary_linear_attention"]


def rotary_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, rotary: bool = True,
    offset: int | torch.Tensor = 0, base: float = 10000.0, projection: torch.Tensor | None = None,
    mask: torch.Tensor | None = None, key_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None, output_final_state: bool = False,
    allow_negative: bool = False, chunk_size: int | None = None, block_size: int | None = None,
):
    """Linear attention with RoPE in the numerator only (RoFormer Eq. 19), fast path.

    Args:
        q, k: `[B, H, N, m]` non-negative features; or, with ``projection``, raw queries and
            keys `[B, H, N, d]` whose FAVOR+ features are computed inside (fused: never stored).
        v: `[B, H, N, e]` values.
        causal: token t sees tokens n <= t; otherwise every token (bidirectional).
        rotary: RoPE on the features in the numerator (Eq. 19); False gives Eq. 18.
        offset: position of token 0: an int, or a LongTensor `[B]` per row (`[D]` per document);
            positions up to ``rotary.MAX_POSITION`` = 2**62 - 1 (a ValueError beyond), every
            angle reduced modulo 2 pi exactly.
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
        allow_negative: skip the check that feature inputs are >= 0 (without ``projection``;
            under ``torch.compile`` the check is ``torch._assert_async``'s RuntimeError).
        chunk_size, block_size: the chunk of the masked products and the block walked at once
            by the causal torch path (any values; memory O(block_size * m + N / block_size * m * e));
            on the chunk-parallel path ``block_size`` is the segment of per-chunk states held at once.

    A keyword that would have no effect in the call is refused (ValueError naming it): ``offset``
    or a non-default ``base`` with ``rotary=False``, ``allow_negative`` with ``projection``,
    ``chunk_size`` / ``block_size`` with ``causal=False``. Flags must be True or False.

    Returns:
        `[B, H, N, e]` in v's dtype, or ``(out, state)`` with ``output_final_state``. B, H, N
        or e = 0 give empty results (N = 0: the state passes through). Double backward is a
        one-line RuntimeError on the torch and chunk-parallel paths (hand-written backwards;
        ``torch.func``'s composite path differentiates to any order); so is ``torch.jit.trace``
        of a causal call, on every path (use ``torch.compile``).

    Paths (``LINEAR_ROPE_BACKEND``, chosen and recorded by ``backend.py``): ``auto`` takes the
    fused Triton kernels (``fused/``) for the causal calls on CUDA tensors that they take
    (``fused.fused_refusal``) and whose specialization passed its one self-check against the
    chunk-parallel path (``fused/selfcheck.py``), the chunk-parallel path (``parallel.py``) for
    the other causal calls on CUDA tensors, and the torch path elsewhere; ``parallel``, ``torch``, ``fla`` and
    ``fused`` force one. On the chunk-parallel path the
    checks that read tensor values are off unless ``LINEAR_ROPE_CHECKS=1`` (each would make the
    GPU wait; unread, a position past ``MAX_POSITION`` gets NaN, never another's angle).
    """
    opts = Options(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection, mask=mask,
                   key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                   allow_negative=allow_negative, output_final_state=output_final_state)
    # The chunk-parallel backend stands for the GPU: its checks read no tensor value (no host sync)
    # unless LINEAR_ROPE_CHECKS=1 (compiled: torch._assert_async); every other path reads them.
    read = not (isinstance(q, torch.Tensor) and takes_parallel(q)) or checks_enabled()
    a = check_args(q, k, v, opts, read_values=read)
    check_sizes(chunk_size, block_size, causal)
    transformed = is_transformed(q, k, v, *(a.state or ()))
    name = backend()
    refusal = "not asked"
    if causal and name in ("auto", "fused") and (q.is_cuda or name == "fused"):
        lowp = compute_dtypes(q.dtype, q.device.type)[1] is not None
        refusal = fused_refusal(q, k, v, projection, a, causal, lowp, forced=name == "fused",
                                sizes=chunk_size is not None or block_size is not None)
        if refusal is None and not transformed:  # each specialization checks itself once (fused/selfcheck.py)
            refusal = verdict(spec_of(q, v, projection, a, rotary, lowp), q.device, forced=name == "fused")
    path = choose(q, causal=causal, packed=a.docs is not None, transformed=transformed,
                  eager=not is_compiling() and not transformed, fused_refusal=refusal)
    if path == "fla":  # forced: fla-core's kernels or an error
        return _forced_fla(q, k, v, opts._asdict())
    if path == "fused":
        if refusal is not None:
            raise ValueError(f"backend 'fused' was forced, but {refusal}")
        return _fused(q, k, v, a, opts, lowp)
    par = path == "parallel"
    if causal and torch.jit.is_tracing():  # every causal path: the same refusal
        raise RuntimeError("rotary_linear_attention: torch.jit.trace cannot record the causal paths (their "
                           "backwards are written by hand, the torch path walks blocks in Python); use "
                           "torch.compile instead")
    return run_torch(_PATHS.get(path), q, k, v, a, opts, chunk_size, block_size, par=par, read=read)


_PATHS = {"torch": chunked_causal, "composite": composite_causal, "bidirectional": bidirectional,
          "documents": documents}


def _fused(q, k, v, a, opts, lowp: bool):
    """The fused path (``fused/op.py``) on a call it takes: out in v's dtype (and the final state
    S, z in float32)."""
    from .fused.op import fused_causal

    with torch.autocast(q.device.type, enabled=False):
        out, S, z = fused_causal(q, k, v, opts.projection, a, opts.rotary, a.offset if isinstance(a.offset, int) else 0,
                                 float(opts.base), lowp)
    return (out, LinearAttentionState(S, z)) if opts.output_final_state else out


def _forced_fla(q, k, v, kw):
    """``LINEAR_ROPE_BACKEND=fla``: the fla-backed path (``fla_path.py``), or a one-line
    ValueError with the reason it cannot take the call (never a silent fallback)."""
    from . import fla_path

    ok, why = fla_path.supports_fla(q, k, v, **kw)
    if not ok:
        raise ValueError(f"backend 'fla' was forced, but {why}")
    record(f"fla path (fla-core chunk_linear_attn, tested with {fla_path.FLA_TESTED})")
    return fla_path.fla_rotary_linear_attention(q, k, v, **kw)
