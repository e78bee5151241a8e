"""Causal Eq. 19 on fla-core's chunk kernels (``LINEAR_ROPE_BACKEND=fla``): an optional GPU path.

fla's own normaliser builds the denominator from the same q and k as the numerator, so fla
alone cannot compute Eq. 19 (RoPE in the numerator only). Here, in `[B, H, N, x]` like the
other paths:

1. **Features and RoPE, one torch pass.** FAVOR+ (``features.favor_features``, with
   ``projection``) or the given features; masked keys' features are set to 0 (they add to
   neither sum); the rotated copies use the positions ``utils.check_args`` resolves (per row,
   per packed document, real tokens only), through ``rotary.rotary_tables``.
2. **Numerator.** fla's ``chunk_linear_attn(normalize=False, scale=1)`` on the rotated
   features and v, in fla's `[B, T, H, K]` layout, split into feature blocks of at most
   ``MAX_K`` columns (each block's outputs are summed; its state is that block's rows of S).
   Its ``initial_state`` / final state `[B or D, H, K, V]` is our S's rows of that block.
3. **Denominator.** The same kernel on the *unrotated* features with a value of ones (two
   columns: fla's 16-bit backward wants an even V), whose state column is our z.
4. ``out = num / den`` with the reference's guard (den <= 0 -> 1), masked queries 0.

``cu_seqlens`` goes to fla as is (its kernels restart the sums and take one state per
document). The inputs fla sees are the GPU dtype for float16 / bfloat16 (its kernels'
operands, fp32 accumulation) and float32 or wider otherwise; the result has v's dtype.

fla-core is imported only when a call takes this path (``pip install 'linear_rope[fla]'``,
tested with fla-core 0.6.0). The CPU tests replace ``_kernel`` with fla's naive references.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from ..features import favor_features
from ..rotary import rotary_tables, rotate_with_tables, table_dtype
from .utils import LinearAttentionState, Options, check_args, check_final_state, normalise_scale

__all__ = ["fla_rotary_linear_attention", "supports_fla", "fla_available", "feature_blocks", "MAX_K", "FLA_TESTED"]

FLA_TESTED = "0.6.0"
# fla's chunk kernels tile K (chunk_h / chunk_o loop over BK-wide tiles), so any K runs; 256 keeps
# every block within the head sizes fla's own tests cover. m = 266 is two blocks of 134 and 132.
MAX_K = 256
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fla_available() -> bool:
    """fla-core is installed (not imported here: it warns at import on a machine without CUDA)."""
    return importlib.util.find_spec("fla") is not None


def _kernel():
    """fla's ``chunk_linear_attn`` (the CPU tests replace this function with a reference)."""
    from fla.ops.linear_attn import chunk_linear_attn

    return chunk_linear_attn


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def supports_fla(q, k, v, *, causal=True, key_mask=None, **_) -> tuple[bool, str]:
    """(True, "") if this path computes the call, else (False, the reason). Argument errors are
    the op's checks' to raise."""
    if not _on_cuda(q):
        return False, f"tensors on {q.device.type}: the fla path needs CUDA (fla-core's Triton kernels)"
    if not fla_available():
        return False, "fla-core is not installed (pip install 'linear_rope[fla]')"
    if key_mask is not None or k.shape[2] != q.shape[2] or not causal:
        return False, "the fla path is causal self-attention only (torch path for causal=False)"
    if q.dtype not in GPU_DTYPES:
        return False, f"dtype {q.dtype}: the fla path takes float16, bfloat16 and float32"
    if q.numel() == 0 or v.numel() == 0:
        return False, "an empty batch or head dim: nothing for a kernel to do (torch path)"
    return True, ""


def feature_blocks(m: int, limit: int = MAX_K) -> list[tuple[int, int]]:
    """[start, end) of the feature blocks fla gets: as few as ``limit`` allows, of near-equal
    even widths (the last may be odd when m is)."""
    n = -(-m // limit)
    width = -(-m // n)
    width += width % 2
    return [(s, min(s + width, m)) for s in range(0, m, width)]


def _fla(x, y, vals, init, cu, want_state):
    """One ``chunk_linear_attn`` call from our layout: x, y `[B, H, N, K]`, vals `[B, H, N, V]`,
    init `[rows, H, K, V]` or None -> out `[B, H, N, V]`, final state or None."""
    t = lambda a: a.transpose(1, 2).contiguous()  # noqa: E731 - [B, H, N, .] -> fla's [B, T, H, .]
    o, S = _kernel()(t(x), t(y), t(vals), scale=1.0, initial_state=init, output_final_state=want_state,
                     normalize=False, cu_seqlens=cu)
    return o.transpose(1, 2), S


def fla_rotary_linear_attention(
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
):
    """Causal Eq. 19 through fla's chunk kernels: ``rotary_linear_attention``'s signature and
    result (q, k, v `[B, H, N, .]`), for the calls ``supports_fla`` accepts."""
    a = check_args(q, k, v, Options(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection,
                   mask=mask, key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                   allow_negative=allow_negative))
    if not causal or key_mask is not None:
        raise ValueError("fla path: causal self-attention only (causal=True, no key_mask)")
    out_dtype, cdt = v.dtype, table_dtype(q.dtype)
    fdt = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else cdt  # what fla's kernels get
    B, H, N, e = q.shape[:3] + v.shape[-1:]
    with torch.autocast(q.device.type, enabled=False):
        q, k, state, sk = q.to(cdt), k.to(cdt), a.state, None
        if projection is None:
            q, k, state, sk = normalise_scale(q, k, a.kmask, state)
        fq = q if projection is None else favor_features(q, projection.detach().to(cdt), is_query=True)
        fk = k if projection is None else favor_features(k, projection.detach().to(cdt), is_query=False)
        if a.kmask is not None:  # masked keys add nothing to either sum
            fk = fk * a.kmask[:, None, :, None].to(fk.dtype)
        rq, rk = fq, fk
        if rotary:
            off = a.offset if isinstance(a.offset, int) else 0  # (None: offset .. offset+N-1 for every row)
            cos, sin = rotary_tables(N, a.m, offset=off, base=base, dtype=cdt, device=q.device, positions=a.positions)
            if cos.dim() == 3:  # (B, N, m/2) per row: over heads
                cos, sin = cos[:, None], sin[:, None]
            rq, rk = rotate_with_tables(fq, cos, sin), rotate_with_tables(fk, cos, sin)
        cu = None if a.docs is None else torch.tensor([0] + [end for _, end in a.docs], dtype=torch.long,
                                                      device=q.device)
        ev = e + (e % 2) if fdt != cdt else max(e, 1)  # 16-bit: an even V for fla's backward
        vv = F.pad(v.to(fdt), (0, ev - e))
        num, S_blocks, z_blocks = 0, [], []
        ones = torch.ones(B, H, N, 2, dtype=fdt, device=q.device)
        den = 0
        for s, t in feature_blocks(a.m):
            pad = (0, (t - s) % 2) if fdt != cdt else (0, 0)  # 16-bit: an even K too (a zero feature)
            S0 = z0 = None
            if state is not None:
                S0 = F.pad(state.S[:, :, s:t].to(torch.float32 if fdt != cdt else cdt), (0, ev - e, 0, pad[1]))
                z0 = F.pad(state.z[:, :, s:t, None].expand(-1, -1, -1, 2).to(S0.dtype), (0, 0, 0, pad[1]))
            o, S = _fla(F.pad(rq[..., s:t], pad).to(fdt), F.pad(rk[..., s:t], pad).to(fdt), vv, S0, cu,
                        output_final_state)
            d, z = _fla(F.pad(fq[..., s:t], pad).to(fdt), F.pad(fk[..., s:t], pad).to(fdt), ones, z0, cu,
                        output_final_state)
            num, den = num + o.to(cdt), den + d[..., 0].to(cdt)
            if output_final_state:
                S_blocks.append(S[:, :, : t - s, :e].to(cdt)), z_blocks.append(z[:, :, : t - s, 0].to(cdt))
        out = num[..., :e] / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1)  # as naive
        if a.qmask is not None:
            out = out * a.qmask[:, None, :, None].to(out.dtype)
    out = out.to(out_dtype)
    if not output_final_state:
        return out
    S, z = torch.cat(S_blocks, dim=2), torch.cat(z_blocks, dim=2)
    return out, (LinearAttentionState(S, z) if sk is None else check_final_state(S, z, sk))
