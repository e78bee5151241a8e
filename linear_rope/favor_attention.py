"""Fused causal FAVOR+ -> RoPE -> Eq. 19, with a hand-written backward. Memory-lean and fast.

``favor_rotary_attention(q, k, v, projection)`` computes exactly what the two-step path

    rotary_linear_attention(FavorFeatures(q, is_query=True), FavorFeatures(k, is_query=False), v)

computes (readable form: ``reference.linear_attention_ref`` over ``reference.favor_features_ref``),
but it never stores a `[N, m]` tensor for the backward pass, and does most of its work as GEMMs:

* The sequence is walked in blocks of ``block_size`` tokens. Within a block, chunks of C
  tokens run as batched GEMMs: a masked `[C, C]` product inside each chunk plus an `[m, d]`
  state from the chunks before. The state ``S`` and the key sum ``z`` go from block to block.
* The denominator is chunked the same way (a masked `[C, C]` product of the unrotated
  features plus ``phi(q) . z``), so it is GEMMs too, never an N x N matrix or an `[N, m]` cumsum.
* The stabiliser shifts are folded into the projection GEMM (``addmm`` with an extra input
  column), and RoPE is one complex multiplication per tensor.
* Backward walks the blocks in reverse, carrying the suffix sums ``G = sum rq dnum^T`` and
  ``Zq = sum dden phi(q)``, and recomputes each block's features from q and k. Saved for
  backward: q, k, v, the output, the denominator and one `[m, d]` state per block.

Gradient of the stabiliser shifts: the per-token query max and the data-independent key shift
cancel in the ratio, so the gradient ignores them (it equals the unstabilised reference's).
Unlike ``FavorFeatures``, no clamp is applied to the key exponent: it is <= 0 up to round-off.
"""
from __future__ import annotations

import torch

from .features import pair_shift
from .ops import check_qkv
from .rotary import check_offset, rotary_tables, table_dtype

__all__ = ["favor_rotary_attention"]

CHUNK = 64
BLOCK = 256  # tokens per block: small blocks stay in cache (measured best of 64..4096 on 2-core EPYC)


def _features(x, wq, wk, scale, is_query):
    """x `[BH, T, d]` -> (phi `[BH, T, m]`, x * scale).

    The shifts ride in the projection GEMM as extra input columns: queries
    ``[x', 1] @ [w, c]^T = w.x' + c`` (then minus the row max), keys
    ``[x', -|x'|^2/2, 1] @ [w, 1, -c]^T = w.x' - |x'|^2/2 - c``.
    """
    BH, T, d = x.shape
    xs = x * scale
    one = torch.ones_like(xs[..., :1])
    if is_query:
        a = (torch.cat((xs, one), dim=-1) @ wq.t())
        a -= a.amax(-1, keepdim=True)
    else:
        a = torch.cat((xs, (xs * xs).sum(-1, keepdim=True).mul_(-0.5), one), dim=-1) @ wk.t()
    return a.exp_(), xs


def _rotate(phi, rot):
    """Interleaved pairs of phi `[BH, T, m]` times the complex table rot `[T, m/2]`.

    Eager: one complex multiplication (4x faster than strided real arithmetic). Under
    torch.compile, which has no complex codegen, the real form that Inductor fuses into one loop.
    """
    BH, T, m = phi.shape
    if torch.compiler.is_compiling():
        x = phi.view(BH, T, m // 2, 2)
        x1, x2, cos, sin = x[..., 0], x[..., 1], rot.real, rot.imag
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).view(BH, T, m)
    return torch.view_as_real(torch.view_as_complex(phi.view(BH, T, m // 2, 2)) * rot).view(BH, T, m)


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


def _block_forward(q, k, v, w, wq, wk, scale: float, rot, S, z, C: int):
    """One block: q, k `[BH, t, d]`, v `[BH, t, e]`, state S `[BH, m, e]`, z `[BH, m]` before it.

    Returns the block's output `[BH, t, e]`, denominator `[BH, t]` and the state after it.
    """
    BH, t, e = v.shape
    m, nc = w.shape[0], t // C
    phq, _ = _features(q, wq, wk, scale, True)
    phk, _ = _features(k, wq, wk, scale, False)
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
    den = den.view(BH, t)
    return num.view(BH, t, e) / den.unsqueeze(-1), den, S, z


def _block_backward(q, k, v, g, out, den, w, wq, wk, scale: float, rot, S0, z0, G, Zq, C: int):
    """Gradients of one block, given the state before it (S0, z0) and the suffix sums after it
    (G = sum rq dnum^T, Zq = sum dden phi(q)). Returns dq, dk, dv and the suffix sums before it."""
    BH, t, e = v.shape
    m, nc = w.shape[0], t // C
    dnum = g / den.unsqueeze(-1)  # (BH, t, e)
    dden = (g * out).sum(-1).div_(den).neg_()  # (BH, t)
    phq, _ = _features(q, wq, wk, scale, True)
    phk, xks = _features(k, wq, wk, scale, False)
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
    # phi = exp(a), so da = dphi * phi; then back through the projection GEMM
    da = dfq.view(BH, t, m).add_(drq).mul_(phq)
    db = dfk.view(BH, t, m).add_(drk).mul_(phk)
    dq = (da @ w).mul_(scale)
    dk = (db @ w).sub_(xks * db.sum(-1, keepdim=True)).mul_(scale)
    return dq, dk, dv, G, Zq


_compiled: dict = {}


def use_compile(enabled: bool = True) -> None:
    """Run the block functions through ``torch.compile`` (Inductor fuses the elementwise work;
    about 2x on the feature maps on CPU). Off by default: compiling costs tens of seconds per
    shape, needs a C++ compiler on CPU, and eager is the tested reference path."""
    _compiled.clear()
    if enabled:
        _compiled["forward"] = torch.compile(_block_forward, dynamic=False)
        _compiled["backward"] = torch.compile(_block_backward, dynamic=False)


class _FavorRotaryCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, w, wq, wk, scale, rot, C, T):
        with torch.autocast(v.device.type, enabled=False):  # the math stays in float32 or wider
            return _FavorRotaryCausal._forward(ctx, q, k, v, w, wq, wk, scale, rot, C, T)

    @staticmethod
    def _forward(ctx, q, k, v, w, wq, wk, scale, rot, C, T):
        BH, N, e = v.shape
        m = w.shape[0]
        fwd = _compiled.get("forward", _block_forward)
        out = torch.empty_like(v)
        den = torch.empty(BH, N, dtype=v.dtype, device=v.device)
        S, z = v.new_zeros(BH, m, e), v.new_zeros(BH, m)
        S0, z0 = [], []
        for b0 in range(0, N, T):
            b1 = min(b0 + T, N)
            S0.append(S), z0.append(z)
            rb = None if rot is None else rot[b0:b1]
            out[:, b0:b1], den[:, b0:b1], S, z = fwd(q[:, b0:b1], k[:, b0:b1], v[:, b0:b1], w, wq, wk, scale, rb, S, z, C)
        ctx.save_for_backward(q, k, v, w, wq, wk, rot, out, den, torch.stack(S0), torch.stack(z0))
        ctx.scale, ctx.C, ctx.T = scale, C, T
        return out

    @staticmethod
    def backward(ctx, g):
        with torch.autocast(g.device.type, enabled=False):
            return _FavorRotaryCausal._backward(ctx, g.to(ctx.saved_tensors[2].dtype))

    @staticmethod
    def _backward(ctx, g):
        q, k, v, w, wq, wk, rot, out, den, S0, z0 = ctx.saved_tensors
        scale, C, T = ctx.scale, ctx.C, ctx.T
        BH, N, e = v.shape
        m = w.shape[0]
        bwd = _compiled.get("backward", _block_backward)
        g = g.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        G, Zq = v.new_zeros(BH, m, e), v.new_zeros(BH, m)  # suffix sums after the block
        for i, b0 in reversed(list(enumerate(range(0, N, T)))):
            b1 = min(b0 + T, N)
            sl = slice(b0, b1)
            rb = None if rot is None else rot[sl]
            dq[:, sl], dk[:, sl], dv[:, sl], G, Zq = bwd(
                q[:, sl], k[:, sl], v[:, sl], g[:, sl], out[:, sl], den[:, sl], w, wq, wk, scale, rb, S0[i], z0[i], G, Zq, C
            )
        return dq, dk, dv, None, None, None, None, None, None, None


def favor_rotary_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    *,
    rotary: bool = True,
    offset: int = 0,
    base: float = 10000.0,
    chunk_size: int = CHUNK,
    block_size: int = BLOCK,
) -> torch.Tensor:
    """Causal FAVOR+ attention with RoPE on the features, numerator only (Eq. 19), fused.

    Args:
        q, k: `[B, H, N, d]` queries and keys (before the feature map).
        v: `[B, H, N, e]` values.
        projection: `[m, d]` FAVOR+ projection (``FavorFeatures.projection``), m even if rotary.
        rotary: Eq. 19 (True) or plain FAVOR+ linear attention, Eq. 18 (False).
        offset: position of token 0.
        chunk_size, block_size: the chunk of the masked products and the block walked at once
            (memory is O(block_size * m) plus O(N / block_size * m * e)).

    Returns:
        `[B, H, N, e]` in v's dtype; float32 or wider inside.
    """
    check_qkv(q, k, v, rotary=False)
    check_offset(offset)
    m, d = projection.shape
    if d != q.shape[-1]:
        raise ValueError(f"projection must be [m, d={q.shape[-1]}], got {tuple(projection.shape)}")
    if rotary and m % 2:
        raise ValueError(f"projection: rotary needs an even number of features m, got m={m}")
    if chunk_size < 1 or block_size < 1:
        raise ValueError(f"chunk_size and block_size must be positive, got {chunk_size}, {block_size}")
    B, H, N, e = v.shape
    out_dtype = v.dtype
    cdt = table_dtype(q.dtype)
    C = min(chunk_size, N)
    T = max(C, block_size // C * C)
    pad = (-N) % C  # trailing zero tokens only affect their own (dropped) outputs
    def flat(t):  # (B*H, N+pad, .), contiguous; a copy only where a cast, pad or layout needs one
        t = t.to(cdt)
        if pad:
            t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape(B * H, N + pad, -1).contiguous()

    q, k, v = flat(q), flat(k), flat(v)
    w = projection.to(cdt)
    c = pair_shift(w)
    one = torch.ones_like(c[:, None])
    wq, wk = torch.cat((w, c[:, None]), dim=1), torch.cat((w, one, -c[:, None]), dim=1)  # (m, d+1), (m, d+2)
    rot = None
    if rotary:
        cos, sin = rotary_tables(N + pad, m, offset=offset, base=base, dtype=cdt, device=q.device)
        rot = torch.complex(cos, sin)  # (N, m/2)
    out = _FavorRotaryCausal.apply(q, k, v, w, wq, wk, d**-0.25, rot, C, T)
    return out.view(B, H, N + pad, e)[:, :, :N].to(out_dtype)
