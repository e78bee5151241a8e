"""The chunk-parallel causal path: Eq. 19 in a fixed number of plain torch ops at any length.

What the GPU runs by default (``LINEAR_ROPE_BACKEND=auto`` on CUDA), and what any device runs
with ``LINEAR_ROPE_BACKEND=parallel``. The form of fla's naive chunk attention and Mamba-2's
``ssd_minimal``: the sequence is cut into chunks of C tokens, laid out `[B, H, nc, C, x]`, and

* phi(q), phi(k) (FAVOR+ inside: one GEMM each for the exponents), rotated, cast to the GEMM
  operand dtype and laid out in chunks in one pass (``_operands``: R phi and phi of each side);
* every chunk's state ``rk^T v`` comes out of one batched GEMM `[B, H, nc, m, e]`, its key sum
  out of one reduction;
* the states before each chunk are one exclusive prefix over chunks (a cumsum, from the
  initial state), in float32 or wider, rounded as it is written;
* the masked `[C, C]` products inside every chunk are batched GEMMs (``tril(rq rk^T) v``), and
  ``rq S_before`` one more;
* Eq. 19's unrotated denominator chunk by chunk from the same kind of GEMMs: ``tril(phi_q
  phi_k^T) 1 + phi_q . z_before`` (no running sum per token).

No op here reads a tensor's value into Python (no host sync), no Python loop runs over chunks,
rows or documents, and nothing is an opaque custom op: ``torch.compile`` sees every op. The
attention core of a segment is one ``torch.autograd.Function`` (``_ChunkAttention``) whose
forward and backward are plain ops (traced whole by ``torch.compile``); its backward is written
out (flash attention's and fla's form: the scores recomputed, the states' gradients a suffix over
chunks) and refuses double backward in one line. The number of kernels of a call does not
depend on N or B, up to ``STATE_BYTES``: beyond it the sequence is walked in segments of a
fixed number of tokens carrying the state (``segment_tokens``), so the kernels per token stay
fixed.

Precision. With bfloat16 inputs, or under a bfloat16 autocast, every GEMM takes bf16 operands
with float32 accumulation and float32 results (the tensor cores): the FAVOR+ projection as two
bf16 parts of w along K (the exponents as from the float32 w), the `[C, C]` scores of ``A v``
as two bf16 parts along K (one GEMM; their rounding does not add to the features'), the
features and the states before each chunk as single bf16 operands; the exponents, the sums over
chunks, the denominator's sums and the division stay in float32. The backward's GEMMs take the
upstream gradient rounded to bf16. The contract (``tolerances.PARALLEL_BF16_CONTRACT``): the
errors of the output and of the gradients of q, k, v within 5x of bf16 SDPA's on the same q,
k, v (measured up to 4.4x, as the design before this one). float16 computes in float32 (its
range would not hold the states' sums); float64 stays float64 (equal to the float64 reference).

Memory: the per-chunk states `[B, H, N / C, m, e]` (the prefix kept as bf16 operands) next to
the four feature operands `[B, H, N, m]` (bf16 under bf16); with C = 64 and e = 64 the states
weigh about what one feature tensor does. Two budgets bound it: past ``STATE_BYTES`` of states
the sequence is walked in segments of whole chunks carrying the state (``block_size`` sets the
segment), and where a segment would keep more than ``KEEP_BYTES`` for the backward
(``kept_bytes``), it keeps no features: the backward recomputes them from q and k.

Keywords: ``mask`` (padding selected away, positions count real tokens), per-row ``offset``,
``initial_state`` / ``output_final_state``, ``rotary=False`` (Eq. 18), features in or FAVOR+
inside (``projection``), ``chunk_size`` (C) and ``block_size`` (the segment) run here.
``cu_seqlens`` does not: its values set the shapes of the chunk layout (every document padded
to whole chunks), and reading them is a host sync; the op sends such calls to the torch path and
records why (``backend.PACKED_REASON``). The bidirectional closed form is plain ops already
(``chunk.bidirectional``).

Inputs come checked (``utils.check_args``), in the compute dtype, with padding selected away,
from ``prepare.run_torch``, which the op (``api.py``) calls; this module imports neither.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from ..checks import is_compiling
from ..features import key_exponent_floor, pair_shift
from .bf16 import bmm32, mm32, round_bf16
from .rope_tables import rope_pair_tables, rotate

__all__ = ["parallel_causal", "KEEP_BYTES", "kept_bytes", "CHUNK", "STATE_BYTES", "CHECKS_VAR", "checks_enabled",
           "compute_dtypes", "segment_tokens", "DOUBLE_BACKWARD"]

CHUNK = 64  # tokens per chunk: 64-row tiles for the tensor cores; intra-chunk work O(N C m)
STATE_BYTES = 4 << 30  # per-chunk states of one segment (float32), at most: 4 GiB
KEEP_BYTES = 16 << 30  # what one segment keeps for the backward, at most; above, it recomputes (16 GiB)
CHECKS_VAR = "LINEAR_ROPE_CHECKS"
def checks_enabled() -> bool:
    """``LINEAR_ROPE_CHECKS=1``: the checks that read tensor values (features >= 0, finite
    projection and states, offsets in range) run on this path too (each a host sync). Off by
    default: the GPU would wait for them on every call."""
    return os.environ.get(CHECKS_VAR, "0").strip() not in ("", "0")


def compute_dtypes(dtype: torch.dtype, device_type: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(sum dtype, GEMM operand dtype or None): float32 (float64 for float64) for sums; bf16
    operands for bf16 inputs or under a bf16 autocast on the device, else the sum dtype."""
    cdt = torch.promote_types(dtype, torch.float32)
    bf16 = dtype == torch.bfloat16 or (torch.is_autocast_enabled(device_type)
                                       and torch.get_autocast_dtype(device_type) == torch.bfloat16)
    return cdt, (torch.bfloat16 if bf16 and cdt == torch.float32 else None)


def segment_tokens(B: int, H: int, N: int, m: int, e: int, C: int, block_size: int | None) -> int:
    """Tokens per segment: ``block_size`` rounded up to whole chunks, else the whole sequence
    while its per-chunk states fit ``STATE_BYTES`` (float32), else as many chunks as do."""
    if block_size is not None:
        return -(-block_size // C) * C
    per_chunk = max(1, B * H * m * e * 4)
    chunks = max(1, STATE_BYTES // per_chunk)
    return chunks * C


def kept_bytes(B: int, H: int, n: int, x: int, m: int, e: int, C: int) -> int:
    """About what autograd keeps of a segment of n tokens (x: d or m per token of q and k), at
    4 bytes an element (2 under bf16): q, k, v, the output and the denominator, the four
    feature operands (``_ChunkAttention``), and per chunk the state and key sum before it."""
    per_token = 4 * (2 * x + 2 * e + 1 + 4 * m)
    return B * H * (n * per_token + -(-n // C) * (m * e + m) * 4)


@functools.lru_cache(maxsize=16)
def _above_diagonal(C: int, device: torch.device) -> torch.Tensor:
    """`[C, C]` bool, True above the diagonal: the keys a query of the chunk does not see."""
    with torch.inference_mode(False):
        return torch.ones(C, C, dtype=torch.bool, device=device).triu(1)


def _upper(C: int, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).triu(1) if is_compiling() else _above_diagonal(C, device)


def _chunks(t: torch.Tensor, C: int) -> torch.Tensor:
    """`[..., n, x]` -> `[..., n / C, C, x]`."""
    return t.reshape(*t.shape[:-2], -1, C, t.shape[-1])


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _proj(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[..., K]` @ w `[K, P]` for a shared 2-D ``w``: one GEMM over all rows (bf16 operands:
    float32 result), never w copied per batch and head."""
    if x.dtype != torch.bfloat16:
        return x @ w
    return bmm32(x.reshape(1, -1, x.shape[-1]), w[None]).view(*x.shape[:-1], w.shape[-1])


def _features(q16, k16, w16, c, kmask):
    """phi(q), phi(k) in the sum dtype from the GEMM operands q16, k16. The FAVOR+ exponents of
    ``features.py`` as one GEMM each against ``w16``, the operand of ``w d^(-1/4)`` (under bf16
    its two bf16 parts along K, value and remainder: the exponents as from the float32 w, with
    float32 accumulation); the pair shifts ``c`` and the keys' ``-|k'|^2 / 2`` added in the sum
    dtype (c cancels between queries and keys exactly: it is never rounded). The query max and
    the key clamp of ``features.favor_exp_``; masked keys' features 0. Without ``w16``: q, k as
    given (padded keys 0 already)."""
    if w16 is None:
        return q16, k16
    d = q16.shape[-1]
    twice = w16.shape[-1] != d  # (value, remainder) parts of w: the input twice along K
    aq = _proj(torch.cat((q16, q16), -1) if twice else q16, w16.t()) + c
    fq = (aq - aq.amax(-1, keepdim=True)).exp()
    ak = _proj(torch.cat((k16, k16), -1) if twice else k16, w16.t()) - c \
        - (0.5 / math.sqrt(d)) * (k16 * k16).sum(-1, keepdim=True, dtype=aq.dtype)
    fk = ak.clamp(key_exponent_floor(ak.dtype), 0).exp()
    return fq, (fk if kmask is None else fk.masked_fill(~kmask[:, None, :, None], 0))


def _operands(fq, fk, cos2, sin2, rd, C: int):
    """The GEMM operands (R phi_q, phi_q, R phi_k, phi_k) `[B, H, n / C, C, m]`: rotation, cast
    and chunk layout in one pass of plain ops over each side's features (Inductor fuses them
    with the exponential into one kernel writing both of the side's operands)."""
    rq, rk = (fq, fk) if cos2 is None else (rotate(fq, cos2, sin2), rotate(fk, cos2, sin2))
    return tuple(_chunks(rd(t), C) for t in (rq, fq, rk, fk))


def _projection_operands(w, lowp):
    """(w16, c): the FAVOR+ projection scaled by d^(-1/4) as a GEMM operand (under bf16 its two
    bf16 parts along K, value and remainder: the exponents as from the float32 w, one GEMM) and
    the pair shifts (``features.pair_shift``)."""
    w16, c = w * w.shape[-1] ** -0.25, pair_shift(w)
    if lowp is not None:
        hi = round_bf16(w16)
        w16 = torch.cat((hi, round_bf16(w16 - hi.float())), 1)
    return w16, c  # made at every call: no cache to go stale (a `[m, d]` cast costs nothing next to a step)


def _rotate_t(x, cos2, sin2):
    """The transpose of ``rotate`` (RoPE by minus the angle): ``x cos2 - swap(x) sin2``."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(x * cos2, swapped, sin2, value=-1)


def _inclusive(x, x0):
    """Inclusive prefix over chunks (dim 2) from ``x0`` (None: zeros), one entry more than x: the
    sums before each chunk, then the total."""
    if x0 is None:
        return F.pad(x, (0, 0) * (x.dim() - 3) + (1, 0)).cumsum(2)
    return torch.cat((x0[:, :, None], x), dim=2).cumsum(2)


def _suffix(x, xn):
    """Exclusive suffix over chunks (dim 2) plus ``xn`` at every chunk: sum_{c' > c} x_c' + xn,
    summed from the end (never as total - prefix). (Not a cat of x and xn before the cumsum:
    Inductor writes the cat out.)"""
    s = F.pad(x[:, :, 1:], (0, 0) * (x.dim() - 3) + (0, 1)).flip(2).cumsum(2).flip(2)
    return s if xn is None else s + xn[:, :, None]


DOUBLE_BACKWARD = ("rotary_linear_attention: double backward (create_graph=True) is not supported on the "
                   "chunk-parallel path (its backward is written by hand); torch.func's transforms take the "
                   "composite path, which differentiates to any order")


class _ChunkAttention(torch.autograd.Function):
    """One segment of whole chunks, features included: q, k `[B, H, n, d or m]`, v `[B, H, n, e]`
    and the state before it (None: zeros) -> out, S, z after it, all in the sum dtype.

    Forward: phi(q), phi(k) (``_features``), rotated (``_operands``); with ``lowp`` every GEMM
    operand rounded to bf16 (``rd``: float32 accumulation, float32 results). Per chunk of C
    tokens:

    * ``A = tril(Rq Rk^T)`` and ``D = tril(phi_q phi_k^T)``, two `[C, C]` GEMMs;
    * the chunk's state ``Rk^T v`` (one GEMM) and key sum ``sum phi_k`` (one reduction), and
      the ones before the chunk (an exclusive prefix over chunks from S0, z0, in float32);
    * Eq. 19: ``out = (A v + Rq S_before) / (D 1 + phi_q . z_before)`` (<= 0 divides by 1, as
      naive; NaN stays NaN): the unrotated denominator chunk by chunk, no running sum per
      token. Under bf16, A enters ``A v`` as two bf16 parts (value and remainder) along K:
      one GEMM, and A's rounding does not add to the features'.

    Keeps for the backward: q, k, v, the output and the scores A as GEMM operands, the
    denominator, the states before each chunk (as operands) and the key sums; and the four
    feature operands (bf16 under bf16), or with ``recompute`` not those: the backward then
    recomputes them from q, k (two K = d GEMMs and an exp). Double backward: a one-line
    RuntimeError (``DOUBLE_BACKWARD``)."""

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, w16, c, kmask, cos2, sin2, C: int, lowp, recompute: bool):
        rd = _same if lowp is None else round_bf16
        B, H, n, _ = q.shape
        q16, k16 = (rd(q), rd(k)) if w16 is not None else (q, k)
        fq, fk = _features(q16, k16, w16, c, kmask)
        Qr, Qf, Kr, Kf = _operands(fq, fk, cos2, sin2, rd, C)
        vc = _chunks(rd(v), C)
        upper = _upper(C, v.device)
        A = mm32(Qr, Kr.transpose(-1, -2)).masked_fill(upper, 0)  # (B, H, nc, C, C): scores in chunks
        D = mm32(Qf, Kf.transpose(-1, -2)).masked_fill(upper, 0)  # the denominator's, unrotated
        Sc = mm32(Kr.transpose(-1, -2), vc)  # (B, H, nc, m, e): every chunk's state, one GEMM
        zc = Kf.sum(-2, dtype=fq.dtype)  # (B, H, nc, m): every chunk's key sum
        if S0 is None:  # the state before each chunk: an exclusive prefix over chunks, from S0
            Sb = F.pad(Sc[:, :, :-1], (0, 0, 0, 0, 1, 0)).cumsum(2)
        else:
            Sb = torch.cat((S0[:, :, None], Sc[:, :, :-1]), dim=2).cumsum(2)
        zi = _inclusive(zc, z0)  # (B, H, nc + 1, m): the key sums before each chunk, then after the last
        zb = zi[:, :, :-1]
        Sb16 = rd(Sb)
        A16 = rd(A)
        if lowp is not None:  # A in two bf16 parts (value, remainder) along K: one GEMM
            A2, vc2 = torch.cat((A16, rd(A - A16.float())), -1), torch.cat((vc, vc), -2)
        num = mm32(A16, vc) if lowp is None else mm32(A2, vc2)
        num = num + mm32(Qr, Sb16)  # (B, H, nc, C, e)
        den = D.sum(-1, keepdim=True) + (Qf * zb[..., None, :]).sum(-1, keepdim=True, dtype=fq.dtype)
        out = (num / den.masked_fill(den <= 0, 1)).reshape(B, H, n, -1)
        kept = (None,) * 4 if recompute else (Qr, Qf, Kr, Kf)
        ctx.save_for_backward(q16, k16, vc, w16, c, kmask, cos2, sin2, rd(out), den, Sb16, zb, A16, *kept)
        ctx.set_materialize_grads(False)  # unused outputs (the final state) send no zeros back
        ctx.C, ctx.lowp, ctx.recompute = C, lowp, recompute
        return out, Sb[:, :, -1] + Sc[:, :, -1], zi[:, :, -1]

    @staticmethod
    def backward(ctx, dout, dS, dz):
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD)
        with torch.autocast(dout.device.type, enabled=False):  # a backward run under autocast: these dtypes
            return _ChunkAttention._backward(ctx, dout, dS, dz)

    @staticmethod
    def _backward(ctx, dout, dS, dz):
        q16, k16, vc, w16, c, kmask, cos2, sin2, out, den, Sb16, zb, A, Qr, Qf, Kr, Kf = ctx.saved_tensors
        if dout is None:  # only the final state used
            dout = torch.zeros(out.shape, dtype=den.dtype, device=den.device)
        C, rd = ctx.C, (_same if ctx.lowp is None else round_bf16)
        if ctx.recompute:  # the features again, from q and k
            fq, fk = _features(q16, k16, w16, c, kmask)
            Qr, Qf, Kr, Kf = _operands(fq, fk, cos2, sin2, rd, C)
        B, H, nc, _, m = Qr.shape
        n = nc * C
        upper = _upper(C, vc.device)
        dc = _chunks(dout, C)
        pos = den > 0
        dnum = dc / torch.where(pos, den, 1)  # (B, H, nc, C, e)
        dden = -(dnum * _chunks(out, C)).sum(-1, keepdim=True) * pos  # (B, H, nc, C, 1): -dout . out / den
        dnum = rd(dnum)
        # the numerator: the masked products and the states, as flash attention's and fla's backward
        dSb = mm32(Qr.transpose(-1, -2), dnum)  # (B, H, nc, m, e)
        dSc = _suffix(dSb, dS)
        dSc16 = rd(dSc)
        dv = mm32(A.transpose(-1, -2), dnum) + mm32(Kr, dSc16)
        dA = rd(mm32(dnum, vc.transpose(-1, -2)).masked_fill(upper, 0))
        drq = mm32(dA, Kr) + mm32(dnum, Sb16.transpose(-1, -2))
        drk = mm32(dA.transpose(-1, -2), Qr) + mm32(vc, dSc16.transpose(-1, -2))
        # the denominator: D's gradient is dden along each row (j <= i), the key sums' a suffix over chunks
        dD = rd(dden.expand(*dden.shape[:-1], C).masked_fill(upper, 0))
        dzb = (Qf * dden).sum(-2, dtype=dden.dtype)  # (B, H, nc, m)
        dzc = _suffix(dzb, dz) if dz is None else \
            torch.cat((dzb[:, :, 1:], dz[:, :, None]), 2).flip(2).cumsum(2).flip(2)  # (small: the cat is cheap)
        dfq = mm32(dD, Kf) + dden * zb[..., None, :]
        dfk = mm32(dD.transpose(-1, -2), Qf) + dzc[..., None, :]
        drq, drk, dfq, dfk = (t.reshape(B, H, n, m) for t in (drq, drk, dfq, dfk))
        if cos2 is not None:
            drq, drk = _rotate_t(drq, cos2, sin2), _rotate_t(drk, cos2, sin2)
        dfq, dfk = dfq + drq, dfk + drk
        if w16 is None:
            dq, dk = dfq, dfk
        else:  # the exponents' gradients (the query max cancels), then one GEMM each
            if not ctx.recompute:
                fq, fk = Qf.reshape(B, H, n, m), Kf.reshape(B, H, n, m)
            daq, dak = dfq * fq, dfk * fk
            d = q16.shape[-1]
            dq = _proj(rd(daq), w16[:, :d])  # the projection's bf16 value part
            dk = _proj(rd(dak), w16[:, :d]) - (1 / math.sqrt(d)) * k16 * dak.sum(-1, keepdim=True)
        dS0 = None if not ctx.needs_input_grad[3] else dSb[:, :, 0] + dSc[:, :, 0]
        dz0 = None if not ctx.needs_input_grad[4] else dzb[:, :, 0] + dzc[:, :, 0]
        return dq, dk, dv.reshape(B, H, n, -1), dS0, dz0, None, None, None, None, None, None, None, None


def parallel_causal(q, k, v, w, a, C: int, rotary: bool, offset: int, base: float, lowp=None, segment=None):
    """Causal Eq. 19 (Eq. 18 without ``rotary``) on the checked arguments ``a`` (no packed
    documents): q, k `[B, H, N, d or m]` (d with the projection ``w``) in the sum dtype, v
    `[B, H, N, e]` in the sum dtype or ``lowp``, padding selected away -> out `[B, H, N, e]`,
    S, z in the sum dtype.

    ``lowp``: the GEMM operand dtype (bf16) or None; ``segment``: tokens per segment (rounded
    up to whole chunks; None: all)."""
    B, H, N, e = v.shape
    cdt = q.dtype
    C = max(1, min(C, N))
    Np = -(-N // C) * C
    kmask = a.kmask
    if Np != N:  # whole chunks: zero tokens at the end (FAVOR+: their keys masked, features exactly 0)
        q, k, v = (F.pad(t, (0, 0, 0, Np - N)) for t in (q, k, v))
        if w is not None:
            kmask = F.pad(torch.ones(B, N, dtype=torch.bool, device=v.device) if kmask is None else kmask,
                          (0, Np - N), value=False)
    w16, c = (None, None) if w is None else _projection_operands(w, lowp)
    tables = (None, None)
    if rotary:
        pos = a.positions
        if pos is not None and Np != N:
            pos = F.pad(pos, (0, Np - N))  # the padded tokens' positions: 0 (their keys are 0)
        tables = rope_pair_tables(Np, a.m, offset, base, pos, v.device, cdt)
    S = z = None
    if a.state is not None:
        S, z = a.state.S.to(cdt), a.state.z.to(cdt)
    seg = Np if segment is None else min(Np, -(-segment // C) * C)
    recompute = torch.is_grad_enabled() and kept_bytes(B, H, seg, q.shape[-1], a.m, e, C) > KEEP_BYTES

    def step(q, k, v, kmask, cos2, sin2, S, z):  # above KEEP_BYTES the backward recomputes the features
        return _ChunkAttention.apply(q, k, v, S, z, w16, c, kmask, cos2, sin2, C, lowp, recompute)

    if seg == Np:  # one segment (no slices: their backward would copy)
        out, S, z = step(q, k, v, kmask, *tables, S, z)
    else:  # segments of whole chunks, the state carried: the kernels per token stay fixed
        outs = []
        for s in range(0, Np, seg):
            sl = slice(s, min(s + seg, Np))
            cut = [None if t is None else t[..., sl, :] for t in (q, k, v, *tables)]
            o, S, z = step(*cut[:3], None if kmask is None else kmask[:, sl], *cut[3:], S, z)
            outs.append(o)
        out = torch.cat(outs, dim=2)
    if Np != N:
        out = out[:, :, :N]
    if a.qmask is not None:
        out = out.masked_fill(~a.qmask[:, None, :, None], 0)
    return out, S, z
