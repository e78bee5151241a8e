"""The torch ops' side of the op: the arguments prepared for a path, and its result finished.

``run_torch`` takes the checked arguments (``utils.check_args``) and a path ``(q, k, v, w, a,
cfg) -> (out, S, z)``: the chunked custom op or the closed form (``chunk.py``), the composite
form (``composite.py``) or the chunk-parallel path (``_parallel``, for ``par``). Around the path it does
what every one of them needs: the compute dtype with autocast off, empty calls, padding selected
away, the feature scale (``utils.normalise_scale``), a zero value column for e = 0, packed
documents of no tokens, and the output back in v's dtype with the final state.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .chunk import BLOCK, CHUNK, chunked_causal
from .layout import OpConfig
from .parallel import compute_dtypes, parallel_causal, segment_tokens
from .utils import LinearAttentionState, check_final_state, normalise_scale

__all__ = ["check_sizes", "run_torch"]


def check_sizes(chunk_size, block_size, causal: bool) -> None:
    """``chunk_size`` / ``block_size``: None or a positive int, and only for a causal call."""
    for name, val in (("chunk_size", chunk_size), ("block_size", block_size)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if (chunk_size is not None or block_size is not None) and not causal:
        raise ValueError("chunk_size / block_size: the bidirectional closed form walks no chunks, so they have no "
                         "effect with causal=False; leave them out")


def _parallel(q, k, v, w, a, cfg: OpConfig, lowp, block_size: int | None):
    B, H, N, e = v.shape
    C = min(cfg.C, N)
    seg = segment_tokens(B, H, N, a.m, e, C, block_size)
    return parallel_causal(q, k, v, w, a, C, cfg.rotary, cfg.offset, cfg.base, lowp=lowp, segment=seg)


def run_torch(path, q, k, v, a, opts, chunk_size: int | None, block_size: int | None, *, par: bool, read: bool):
    """``path`` on the checked arguments ``a`` of the call (``opts``: its keywords) -> what the op
    returns. ``par``: the chunk-parallel path (``path`` None), which syncs with the host nowhere,
    its GEMM operand dtype read here, outside the autocast-free block (bf16 for bf16 inputs or
    under a bf16 autocast) and ``block_size`` its segment; ``read``: the checks that read tensor
    values are on (for the final state's)."""
    out_dtype = v.dtype
    cdt, lowp = compute_dtypes(q.dtype, q.device.type)
    if par:
        path = functools.partial(_parallel, lowp=lowp, block_size=block_size)
    B, H, N, e = q.shape[:3] + v.shape[-1:]
    if B * H == 0 or N == 0:
        return _empty(q, k, v, a, cdt, opts.output_final_state)
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
        if path is not chunked_causal:  # (the custom op selects padding away block by block, in its copies)
            q, k, v = _drop_padding(q, k, v, a)
        state, sk = a.state, None
        if opts.projection is None:  # FAVOR+ features inside are stabilised already
            q, k, state, sk = normalise_scale(q, k, a.kmask, state, a.docs, sync=not par)
        if e == 0:  # no value columns: one zero column keeps every path's shapes, z stays right
            v = F.pad(v, (0, 1))
            state = None if state is None else LinearAttentionState(F.pad(state.S, (0, 1)), state.z)
        full = a._replace(state=state)
        a = _without_empty_documents(full)
        w = None if opts.projection is None else opts.projection.detach().to(cdt)
        cu = () if a.docs is None else (0, *(end for _, end in a.docs))
        cfg = OpConfig(chunk_size or CHUNK, block_size or BLOCK, a.offset if isinstance(a.offset, int) else 0,
                       opts.rotary, cu, float(opts.base))
        out, S, z = path(q, k, v, w, a, cfg)
        if a is not full:
            S, z = _with_empty_documents(S, z, full, v)
    out = out[..., :e].to(out_dtype)
    if not opts.output_final_state:
        return out
    S = S[..., :e]
    return out, (LinearAttentionState(S, z) if sk is None else check_final_state(S, z, sk, read_values=read))


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
