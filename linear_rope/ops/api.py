"""The public op, ``rotary_linear_attention``: it checks the arguments once, picks a path, records
which, and calls it.

The paths are its siblings, and none of them imports this module:

* the torch path: the chunked custom op (``chunk.py``), the closed form without ``causal``;
* the chunk-parallel path (``parallel.py``): the default for a causal call on CUDA;
* the composite path (``composite.py``): the causal chunk form under ``torch.func`` transforms
  and forward-mode AD;
* the Triton kernels (``triton/``) and fla-core's (``fla_path.py``), for the eager causal calls
  ``LINEAR_ROPE_BACKEND`` sends them.

The torch ops' side (the compute dtype, padding, feature scale, empty calls and documents) is
``prepare.run_torch``. A Triton kernel that fails sends its call to the torch ops here: the
forward's by the ``KernelError`` it raises, the backward's through the torch path this module
hands the kernels (``_on_torch``).
"""
from __future__ import annotations

import torch

from ..checks import is_compiling, is_transformed
from .chunk import bidirectional, chunked_causal, documents
from .composite import composite_causal
from .parallel import PACKED_REASON, checks_enabled
from .prepare import check_sizes, parallel_path, run_torch
from .triton.dispatch import (
    ENV_VAR, KernelError, backend, fallback, record, should_use_triton, takes_parallel, use_backend,
)
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
        Double backward is not supported on the torch path nor through the chunk-parallel
        path's bf16 products (one-line RuntimeError; in float32 or wider the chunk-parallel
        path is plain autograd, and under ``torch.func`` the composite path below is
        differentiable to any order). Nor is ``torch.jit.trace`` of the causal path (use
        ``torch.compile``). A backward may run inside the autocast block of its forward. B = 0,
        H = 0, N = 0 or e = 0 give empty results (N = 0: the state passes through).

    Backends (``LINEAR_ROPE_BACKEND``): ``auto`` (the default) runs a causal call on CUDA
    tensors through the chunk-parallel path (``parallel.py``: plain torch ops, a fixed number of
    kernels at any N, no host sync, bf16 tensor-core products under a bf16 autocast), and on
    other devices through the torch path (the custom op's block walk, the fastest on a CPU).
    ``parallel`` takes the chunk-parallel path on any device; ``torch`` the torch path. On the
    chunk-parallel path the checks that read tensor values (features >= 0, a finite projection
    and state, offsets in range, a finite final key sum) are off unless ``LINEAR_ROPE_CHECKS=1``
    (each would make the GPU wait: unread, a token past ``MAX_POSITION`` gets NaN, never another
    position's angle); packed documents (``cu_seqlens``) go to the torch path there,
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
    opts = Options(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection, mask=mask,
                   key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                   allow_negative=allow_negative, output_final_state=output_final_state)
    par = isinstance(q, torch.Tensor) and takes_parallel(q)  # the chunk-parallel backend: no host syncs
    read = not par or checks_enabled()
    a = check_args(q, k, v, opts, read_values=read)
    check_sizes(chunk_size, block_size, causal)
    transformed = is_transformed(q, k, v, *(a.state or ()))
    par = par and not transformed and a.docs is None  # packed documents: the torch path (PACKED_REASON)
    if causal and torch.jit.is_tracing() and not par:
        raise RuntimeError("rotary_linear_attention: torch.jit.trace cannot record the causal path (a custom op "
                           "that walks blocks in Python); use torch.compile instead")
    eager = not is_compiling() and not transformed  # where the fla-core and Triton kernels may take the call
    if backend() == "fla" and eager:  # forced: fla-core's kernels or an error
        return _forced_fla(q, k, v, opts._asdict())
    if causal and eager:
        out = _triton(q, k, v, opts._asdict(), par, sized=chunk_size is not None or block_size is not None)
        if out is not None:
            return out
        if a.docs is not None and takes_parallel(q):
            record(f"torch path ({PACKED_REASON})", replace=True)
    if causal and par:
        path = parallel_path(q, block_size)
    elif causal:
        path = composite_causal if transformed else chunked_causal
    else:
        path = bidirectional if a.docs is None else documents
    return run_torch(path, q, k, v, a, opts, chunk_size, block_size, par=par, read=read)


def _triton(q, k, v, kw, par: bool, sized: bool):
    """The Triton kernels' result where ``should_use_triton`` picks them for the call, else None
    (the torch ops take it, with the reason recorded): explicit ``chunk_size`` / ``block_size``
    keep an ``auto`` call off them (a ValueError where they are forced), and so does a kernel that
    fails to build or launch (said once on stderr; raised where they are forced)."""
    if not should_use_triton(q, k, v, **kw):  # CUDA + Triton (or LINEAR_ROPE_BACKEND=triton)
        return None
    if sized:
        if backend() == "triton":
            raise ValueError(f"chunk_size / block_size: the Triton kernels pick their own chunk, so they have no "
                             f"effect with {ENV_VAR}=triton; leave them out, or set {ENV_VAR}=torch")
        if not par:  # auto: explicit sizes keep the call on the torch path, where they apply
            record("torch path (chunk_size / block_size given: they apply on the torch path)", replace=True)
        return None
    from .triton import rotary_linear_attention as triton_op

    try:
        return triton_op(q, k, v, **kw, torch_path=_on_torch)
    except KernelError as e:  # a kernel failed to build or launch: the torch ops, said once
        if backend() == "triton":
            raise
        fallback(str(e))
        record(f"{'parallel' if par else 'torch'} path ({e})", replace=True)
        return None


def _on_torch(q, k, v, **kw):
    """The op on the torch path: what the Triton kernels' backward recomputes the forward on when
    a backward kernel fails."""
    with use_backend("torch"):
        return rotary_linear_attention(q, k, v, **kw)


def _forced_fla(q, k, v, kw):
    """``LINEAR_ROPE_BACKEND=fla``: the fla-backed path (``fla_path.py``), or a one-line
    ValueError with the reason it cannot take the call (never a silent fallback)."""
    from . import fla_path

    ok, why = fla_path.supports_fla(q, k, v, **kw)
    if not ok:
        raise ValueError(f"backend 'fla' was forced, but {why}")
    record(f"fla path (fla-core chunk_linear_attn, tested with {fla_path.FLA_TESTED})")
    return fla_path.fla_rotary_linear_attention(q, k, v, **kw)
