"""The chunk-parallel causal path: Eq. 19 in a fixed number of plain torch ops at any length.

What the GPU runs by default (``LINEAR_ROPE_BACKEND=auto`` on CUDA), and what any device runs
with ``LINEAR_ROPE_BACKEND=parallel``. The form of fla's naive chunk attention and Mamba-2's
``ssd_minimal``: the sequence is cut into chunks of C tokens, laid out `[B, H, nc, C, x]`, and

* every chunk's state ``rk^T v`` comes out of one batched GEMM `[B, H, nc, m, e]`;
* the states before each chunk are one exclusive prefix over chunks (a cumsum, from the
  initial state), in float32 or wider;
* the masked `[C, C]` products inside every chunk are two batched GEMMs (``tril(rq rk^T) v``),
  and ``rq S_before`` a third;
* Eq. 19's unrotated denominator runs alongside in float32 or wider: ``phi(q_t) . (z0 + sum_{n
  <= t} phi(k_n))``, one cumsum over the tokens (no rotation, no GEMM: it is a dot product per
  token with a running sum).

No op here reads a tensor's value into Python (no host sync), no Python loop runs over chunks,
rows or documents, and nothing is an opaque custom op: ``torch.compile`` sees every op, and the
gradients are plain autograd through them. The number of kernels of a call does not depend on
N or B, up to ``STATE_BYTES``: beyond it the sequence is walked in segments of a fixed number
of tokens carrying the state (``segment_tokens``), so the kernels per token stay fixed.

Precision. With bfloat16 inputs, or under a bfloat16 autocast, the chunk products take bf16
operands with float32 accumulation and float32 results (the tensor cores; ``_Bf16Matmul``), the
`[C, C]` scores as two bf16 parts (value and remainder) so that their rounding does not add to
the features'; the FAVOR+ exponents, the rotation, the sums over chunks, the denominator and
the division stay in float32. The backward's GEMMs take the upstream gradient rounded to bf16.
The contract (``tolerances.PARALLEL_BF16_CONTRACT``): the error of the output and final state
is within 2x of the float64 op's on the bf16-rounded features and values. float16 computes in
float32 (its range would not hold the states' sums); float64 stays float64.

Memory: the per-chunk states `[B, H, N / C, m, e]` (each chunk's and the prefix, in float32)
next to the features `[B, H, N, m]` (phi and R phi of q and k); with C = 64 and e = 64 the states
weigh about what one feature tensor does. Two budgets bound it: past ``STATE_BYTES`` of states
the sequence is walked in segments of whole chunks carrying the state (``block_size`` sets the
segment), and where a segment would keep more than ``KEEP_BYTES`` for the backward
(``kept_bytes``), it keeps its inputs only and recomputes the rest in the backward
(``torch.utils.checkpoint``: one more forward's launches per segment).

Keywords: ``mask`` (padding selected away, positions count real tokens), per-row ``offset``,
``initial_state`` / ``output_final_state``, ``rotary=False`` (Eq. 18), features in or FAVOR+
inside (``projection``), ``chunk_size`` (C) and ``block_size`` (the segment) run here.
``cu_seqlens`` does not: its values set the shapes of the chunk layout (every document padded
to whole chunks), and reading them is a host sync; the op sends such calls to the torch path and
records why (``PACKED_REASON``). The bidirectional closed form is plain ops already
(``chunk.bidirectional``).

Inputs come checked (``utils.check_args``), in the compute dtype, with padding selected away,
from ``prepare.run_torch``, which the op (``api.py``) calls; this module imports neither.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..checks import is_compiling
from ..features import favor_exp_, favor_inputs, favor_projection
from ..rotary import _LIMB, _turn_limbs, rope_turns, rotary_tables

__all__ = ["parallel_causal", "KEEP_BYTES", "kept_bytes", "rotate", "rope_pair_tables", "rope_tables", "CHUNK", "STATE_BYTES", "CHECKS_VAR", "PACKED_REASON", "checks_enabled",
           "compute_dtypes", "segment_tokens", "DOUBLE_BACKWARD"]

CHUNK = 64  # tokens per chunk: 64-row tiles for the tensor cores; intra-chunk work O(N C m)
STATE_BYTES = 4 << 30  # per-chunk states of one segment (float32), at most: 4 GiB
KEEP_BYTES = 16 << 30  # what one segment keeps for the backward, at most; above, it recomputes (16 GiB)
CHECKS_VAR = "LINEAR_ROPE_CHECKS"
DOUBLE_BACKWARD = ("rotary_linear_attention: double backward (create_graph=True) is not supported on the "
                   "chunk-parallel path's bf16 products (bf16 inputs or a bf16 autocast); run it in float32, or "
                   "under torch.func for the composite path")
PACKED_REASON = ("cu_seqlens: the documents' lengths set the shapes of the chunk layout, and reading them is a host "
                 "sync, so packed documents take the torch path")


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
    """About what autograd keeps of a segment of n tokens (x: d or m per token of q and k): the
    inputs, four float32 feature tensors and the running key sums, the bf16 (or float32)
    operands of the products, the `[C, C]` scores and the per-chunk states."""
    per_token = 4 * (2 * x + e) + 4 * 6 * m + 8 * C + 4 * e
    return B * H * (n * per_token + -(-n // C) * m * e * 12)


@functools.lru_cache(maxsize=32)
def _limb_tensors(dim: int, base: float, device: torch.device):
    """``rope_turns``' constants as float64 tensors on ``device``, made once (a list copied to a
    GPU on every call would be a host-to-device copy each time)."""
    a, b = _turn_limbs(dim, base)
    with torch.inference_mode(False):
        return tuple(torch.tensor(t, dtype=torch.float64).to(device) for t in (a, b))


def _turns(positions: torch.Tensor, dim: int, base: float, nonneg: bool = False) -> torch.Tensor:
    """``rotary.rope_turns`` with its constants cached per device (eager); the same under compile.
    ``nonneg``: the positions are known to lie in [0, MAX_POSITION] (no sign to carry)."""
    if is_compiling():
        return rope_turns(positions, dim, base, in_range=nonneg)
    a, b = _limb_tensors(dim, float(base), positions.device)
    p = positions.reshape(-1, 1)
    mag = p if nonneg else p.abs()
    limbs = torch.cat([(mag >> (_LIMB * j)) & ((1 << _LIMB) - 1) for j in range(3)], dim=1).to(torch.float64)
    if not nonneg:
        limbs = limbs * torch.where(p < 0, -1.0, 1.0).to(torch.float64)
    turns = limbs @ a
    turns -= turns.floor()
    turns = torch.addmm(turns, limbs, b)
    turns -= turns.floor()
    if not nonneg:  # past MAX_POSITION (a wrapped sum, -2**63): NaN, as rope_turns gives
        turns = turns.masked_fill((mag >> 62) != 0, float("nan"))
    return turns.view(*positions.shape, dim // 2)


CACHED_TABLE = 1 << 22  # entries of a cos / sin table kept between calls, at most (16 MiB in float32)


@functools.lru_cache(maxsize=8)
def _tables_at(n: int, dim: int, offset: int, base: float, device: torch.device, dtype: torch.dtype):
    """cos, sin `[n, dim / 2]` of positions offset .. offset + n - 1 (eager: made once per shape;
    plain tensors even when first asked for under ``torch.inference_mode``)."""
    with torch.inference_mode(False), torch.no_grad():
        return _tables(torch.arange(offset, offset + n, device=device), dim, base, dtype)


def _tables(positions, dim, base, dtype):
    angle = _turns(positions, dim, base) * (2 * torch.pi)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _pair_tables(positions, dim, base, dtype, nonneg=False):
    """The tables of ``rotate``: (cos, cos) and (-sin, sin) per pair, `[..., n, dim]`."""
    angle = (_turns(positions, dim, base, nonneg) * (2 * torch.pi)).to(dtype)  # in [0, 2 pi): exact to dtype
    cos, sin = angle.cos(), angle.sin()
    return torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (``rotary.rotate_with_tables``) as ``x cos2 + swap(x) sin2``,
    swap exchanging each pair: four elementwise kernels, and as many in the backward (no strided
    slices, whose backward writes zeros first)."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos2 + swapped * sin2


@functools.lru_cache(maxsize=8)
def _pair_tables_at(n: int, dim: int, offset: int, base: float, device: torch.device, dtype: torch.dtype):
    """``_pair_tables`` of positions offset .. offset + n - 1 (eager: made once per shape; plain
    tensors even when first asked for under ``torch.inference_mode``)."""
    with torch.inference_mode(False), torch.no_grad():
        return _pair_tables(torch.arange(offset, offset + n, device=device), dim, base, dtype, nonneg=True)


def rope_pair_tables(n: int, dim: int, offset: int, base: float, positions, device, dtype):
    """``rotate``'s tables `[n, dim]`, or `[B, 1, n, dim]` for per-row ``positions`` `[B, n]`."""
    if positions is not None:
        cos2, sin2 = _pair_tables(positions.long(), dim, base, dtype)
        return cos2[:, None], sin2[:, None]
    if is_compiling() or n * dim > CACHED_TABLE:
        return _pair_tables(torch.arange(offset, offset + n, device=device), dim, base, dtype, nonneg=True)
    return _pair_tables_at(n, dim, offset, float(base), torch.device(device), dtype)


def rope_tables(n: int, dim: int, offset: int, base: float, positions, device, dtype):
    """cos, sin `[n, dim / 2]`, or `[B, 1, n, dim / 2]` for per-row ``positions`` `[B, n]`."""
    if torch.jit.is_tracing():  # sizes are traced tensors there: the uncached tables
        cos, sin = rotary_tables(int(n), int(dim), offset=offset, base=base, dtype=dtype, device=device,
                                 positions=positions)
        return (cos[:, None], sin[:, None]) if positions is not None else (cos, sin)
    if positions is not None:
        cos, sin = _tables(positions.long(), dim, base, dtype)
        return cos[:, None], sin[:, None]
    if is_compiling() or n * dim // 2 > CACHED_TABLE:
        return _tables(torch.arange(offset, offset + n, device=device), dim, base, dtype)
    return _tables_at(n, dim, offset, float(base), torch.device(device), dtype)


def _features(q, k, wqk, kmask):
    """phi(q), phi(k) in the compute dtype: FAVOR+ with ``wqk = features.favor_projection(w)``
    (fp32 exponents, the stabiliser of ``features.py``), else q, k as given (padded keys are 0
    already: selected away by the op); masked keys' features exactly 0."""
    if wqk is None:
        return q, k
    wq, wk = wqk
    fq = favor_exp_(favor_inputs(q, is_query=True) @ wq.t(), is_query=True)
    fk = favor_exp_(favor_inputs(k, is_query=False) @ wk.t(), is_query=False)
    return fq, (fk if kmask is None else fk.masked_fill(~kmask[:, None, :, None], 0))


def _bmm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b `[..., M, K] x [..., K, P]` of bf16 operands with a float32 result (float32
    accumulation, never rounded to bf16): cuBLAS's bf16 GEMM with a float32 output."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return torch.bmm(a3, b3, out_dtype=torch.float32).view(*lead, a.shape[-2], b.shape[-1])


@functools.lru_cache(maxsize=None)
def _has_bf16_f32_gemm(device: torch.device) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` takes bf16 operands on ``device``
    (CUDA builds of recent PyTorch); asked once per device, with a tiny product."""
    if device.type != "cuda":
        return False
    try:
        x = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
        return torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _native(t: torch.Tensor) -> bool:
    return t.is_cuda and (is_compiling() or _has_bf16_f32_gemm(t.device))


def _round(t: torch.Tensor) -> torch.Tensor:
    """The GEMM operand: bf16 where the GEMM takes bf16 with a float32 result (CUDA); elsewhere
    the bf16-rounded values in float32, whose float32 products are what the tensor cores compute."""
    t16 = t.to(torch.bfloat16)
    return t16 if _native(t) else t16.float()


def _mm32(a, b):
    return _bmm32(a, b) if a.dtype == torch.bfloat16 else a @ b


class _Bf16Matmul(torch.autograd.Function):
    """``a @ b`` for float32 a, b on the bf16 tensor cores: operands rounded to bf16, products
    accumulated and returned in float32 (a sum over chunks or a division comes next). The
    backward's two GEMMs take the saved bf16 operands and the upstream gradient rounded to
    bf16 (as flash attention's and fla's do), and return float32 gradients."""

    @staticmethod
    def forward(ctx, a, b, split: bool = False):
        a16, b16 = _round(a), _round(b)
        ctx.save_for_backward(a16, b16)
        out = _mm32(a16, b16)
        if split:  # a = a16 + its bf16 remainder: a's rounding leaves the product (for the scores)
            out = out + _mm32(_round(a - a16.float()), b16)
        return out

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():  # create_graph=True: this backward is not itself differentiated
            raise RuntimeError(DOUBLE_BACKWARD)
        a16, b16 = ctx.saved_tensors
        with torch.autocast(g.device.type, enabled=False):  # a backward run under autocast: these dtypes
            g16 = _round(g)
            da = _mm32(g16, b16.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
            db = _mm32(a16.transpose(-1, -2), g16) if ctx.needs_input_grad[1] else None
        return da, db, None


def _matmul(a, b, lowp, split: bool = False):
    return a @ b if lowp is None else _Bf16Matmul.apply(a, b, split)


@functools.lru_cache(maxsize=16)
def _above_diagonal(C: int, device: torch.device) -> torch.Tensor:
    """`[C, C]` bool, True above the diagonal: the keys a query of the chunk does not see."""
    with torch.inference_mode(False):
        return torch.ones(C, C, dtype=torch.bool, device=device).triu(1)


def _segment(fq, fk, rq, rk, v, S0, z0, C: int, lowp):
    """One segment of whole chunks: features `[B, H, n, m]` (n a multiple of C; padded keys'
    features 0), v `[B, H, n, e]`, and the state before it (None: zeros) -> out, S, z after it."""
    B, H, n, m = fq.shape
    nc = n // C

    def chunks(t):
        return t.reshape(B, H, nc, C, t.shape[-1])

    rqc, rkc, vc = chunks(rq), chunks(rk), chunks(v)
    upper = torch.ones(C, C, dtype=torch.bool, device=v.device).triu(1) if is_compiling() else \
        _above_diagonal(C, v.device)
    A = _matmul(rqc, rkc.transpose(-1, -2), lowp).masked_fill(upper, 0)  # (B, H, nc, C, C): scores in chunks
    Sc = _matmul(rkc.transpose(-1, -2), vc, lowp)  # (B, H, nc, m, e): every chunk's state, one GEMM
    if S0 is None:  # the state before each chunk: an exclusive prefix over chunks, from S0
        Sb = F.pad(Sc[:, :, :-1], (0, 0, 0, 0, 1, 0)).cumsum(2)
    else:
        Sb = torch.cat((S0[:, :, None], Sc[:, :, :-1]), dim=2).cumsum(2)
    num = _matmul(A, vc, lowp, split=True) + _matmul(rqc, Sb, lowp)  # (B, H, nc, C, e)
    zt = fk.cumsum(2)  # (B, H, n, m): z0 + phi(k) of every key up to each token
    if z0 is not None:
        zt = zt + z0[:, :, None]
    den = (fq.unsqueeze(-2) @ zt.unsqueeze(-1)).reshape(B, H, n, 1)  # Eq. 19's unrotated denominator
    out = num.reshape(B, H, n, -1) / den.masked_fill(den <= 0, 1)  # as naive: <= 0 divides by 1, NaN stays NaN
    return out, Sb[:, :, -1] + Sc[:, :, -1], zt[:, :, -1]


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
    wqk = None if w is None else favor_projection(w)
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

    def run(q, k, v, kmask, cos2, sin2, S, z):
        fq, fk = _features(q, k, wqk, kmask)
        rq, rk = (fq, fk) if cos2 is None else (rotate(fq, cos2, sin2), rotate(fk, cos2, sin2))
        return _segment(fq, fk, rq, rk, v, S, z, C, lowp)

    def step(*args):  # above KEEP_BYTES a segment keeps its inputs only, and recomputes in the backward
        return checkpoint(run, *args, use_reentrant=False) if recompute else run(*args)

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
