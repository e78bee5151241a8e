"""The Triton path of ``rotary_linear_attention``: causal Eq. 19 / Eq. 18 in chunk-parallel kernels.

``rotary_linear_attention`` here has the public op's signature and return type for the subset
that ``supports`` accepts (``causal=True``, FAVOR+ inside or features in, int or per-row
``offset``, ``mask``, ``initial_state``, ``output_final_state``); the kernels are in
``kernels.py``, the choice of path in ``dispatch.py``. Import this module only where Triton is
installed.
"""
from __future__ import annotations

import functools

import torch

from ...features import key_exponent_floor, pair_shift
from ...rotary import rotary_tables, table_dtype
from ..utils import LinearAttentionState, Options, check_args
from . import chunk_kernels as CK
from . import kernels as K
from .dispatch import KernelError, backend, fallback, pick_config, supports

__all__ = ["rotary_linear_attention"]


def _launch(name, kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; a failure to build or launch it (shared memory,
    registers, a compiler or driver error) becomes a ``KernelError`` naming the kernel."""
    try:
        kernel[grid](*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - Triton raises its own types, RuntimeError, AssertionError, ...
        msg = str(e).strip().splitlines()
        raise KernelError(f"{name} failed to build or launch ({type(e).__name__}: {msg[0][:200] if msg else ''})") from e

@functools.lru_cache(maxsize=None)
def _triangles(C: int, device: torch.device) -> torch.Tensor:
    """The chunk's causal matrices of ones `[2, C, C]` in bf16, lower then upper triangular
    (``gemm._tri``): made once per chunk size and device, not in every backward."""
    L = torch.ones(C, C, device=device, dtype=torch.bfloat16).tril_()
    return torch.stack([L, L.T]).contiguous()


def _acc(cdt):
    import triton.language as tl

    return tl.float64 if cdt == torch.float64 else tl.float32


def _safe(den):
    """den where > 0, else 1 (no gradient flows there); NaN stays NaN, as on the torch path."""
    return torch.where(den <= 0, torch.ones_like(den), den)


def _ptrs(meta, names, like, *more):
    """The kernels' optional tensors ``meta[name]`` for ``names``, then ``more``, with a
    one-element stand-in for each absent one (never read: its flag is off), so the kernels'
    pointer arithmetic always has a pointer."""
    ts = [meta[n] for n in names] + list(more)
    stub = like.new_zeros(1, dtype=meta["cdt"])
    return [stub if t is None else t for t in ts]


def _flags(meta, has_state, out_state):
    # rotary, mask, initial state, final state (forward: stored; backward: its gradient given)
    """The kernels' runtime switches (see ``kernels._flags``)."""
    bits = (meta["cos"] is not None) | (meta["km"] is not None) << 1 | has_state << 2 | out_state << 3
    return 3 + 4 * bits


class _TritonCausal(torch.autograd.Function):
    """(q, k, v, S0, z0) -> (out, S, z) in the compute dtype; ``meta`` holds the rest (no grads).

    Forward: the query stabiliser, the state pass (the state before every chunk, h `[BH, NT, m,
    e]` and hz `[BH, NT, m]`), then the chunk-parallel outputs. Saved for the backward: q, k, v,
    the initial state, out, den and the chunk states (the features are recomputed). Backward:
    the reverse state pass (dh, dhz), then dq, dk and dv chunk-parallel (for bf16 tensor cores
    dnum reaches them split into two bf16 pieces, once, here)."""

    @staticmethod
    def forward(ctx, q, k, v, S0, z0, meta):
        BH, N, e = v.shape
        cfg, m, cdt = meta["cfg"], meta["m"], meta["cdt"]
        C, P = cfg["chunk"]["C"], meta["dims"][5]
        NT = -(-N // C)
        favor = meta["w"] is not None
        h = v.new_empty(BH, NT, m, e, dtype=cdt)
        hz = v.new_empty(BH, NT, m, dtype=cdt)
        has_state = S0 is not None
        ST = v.new_empty(BH, m, e, dtype=cdt) if meta["store_state"] else None
        zT = v.new_empty(BH, m, dtype=cdt) if meta["store_state"] else None
        sc = cfg["state"]
        _launch("the state kernel", K._state_kernel, (-(-P // sc["BP"]), -(-e // sc["BV"]), BH),
                k, v, *_ptrs(meta, ("w", "wp", "c", "km", "cos", "sin"), v, S0, z0, h, hz, ST, zT),
                *meta["dims"], _flags(meta, has_state, ST is not None), FAVOR=favor, ACC=_acc(cdt), **sc)
        out = v.new_empty(BH, N, e, dtype=cdt)
        den = v.new_empty(BH, N, dtype=cdt)
        _launch("the output kernel", CK._out_kernel, (NT, BH),
                q, k, v, *_ptrs(meta, ("w", "wp", "c", "km", "qmax", "cos", "sin"), v, h, hz, out, den),
                *meta["dims"], _flags(meta, False, False), FAVOR=favor, ACC=_acc(cdt), **cfg["chunk"])
        if meta["qmask"] is not None:
            out = out * meta["qmask"].unsqueeze(-1)
        ctx.save_for_backward(q, k, v, S0, z0, out, den, h, hz)
        ctx.meta = meta
        return out, ST, zT

    @staticmethod
    def backward(ctx, g, gS, gz):
        if torch.is_grad_enabled():
            raise RuntimeError("rotary_linear_attention: double backward (create_graph=True) is not supported")
        q, k, v, S0, z0, out, den, h, hz = ctx.saved_tensors
        meta = ctx.meta
        cfg, m, cdt = meta["cfg"], meta["m"], meta["cdt"]
        BH, N, e = v.shape
        NT, P = h.shape[1], meta["dims"][5]
        g = g.to(cdt)
        if meta["qmask"] is not None:
            g = g * meta["qmask"].unsqueeze(-1)
        dnum = (g / _safe(den).unsqueeze(-1)).contiguous()
        dden = ((g * out).sum(-1) / _safe(den)).neg_().mul_(den > 0).contiguous()
        favor = meta["w"] is not None
        dq, dk = torch.empty_like(q, dtype=cdt), torch.empty_like(k, dtype=cdt)
        dv = torch.empty_like(v, dtype=cdt)
        has_state = S0 is not None
        dS0 = torch.empty_like(S0) if has_state else None
        dz0 = torch.empty_like(z0) if has_state else None
        has_g = meta["store_state"] and gS is not None
        gS = gS.to(cdt).contiguous() if has_g else None
        gz = gz.to(cdt).contiguous() if has_g else None
        dh, dhz = torch.empty_like(h), torch.empty_like(hz)
        sc, cc = cfg["state"], cfg["chunk"]
        names = ("w", "wp", "c", "km", "qmax", "cos", "sin")
        dn = dnum  # the chunk kernels' dnum: for bf16 tensor cores its two bf16 pieces [2, BH, N, e]
        if cc["SPREC"] == "bf16x3":
            hi = dnum.to(torch.bfloat16)
            dn = torch.stack([hi, (dnum - hi.to(dnum.dtype)).to(torch.bfloat16)])
        tri = _triangles(cc["C"], v.device)
        try:
            _launch("the state-gradient kernel", K._state_grad_kernel, (-(-P // sc["BP"]), -(-e // sc["BV"]), BH),
                    q, *_ptrs(meta, names, v, dnum, dden, gS, gz, dh, dhz, dS0, dz0), *meta["dims"],
                    _flags(meta, has_state, has_g), FAVOR=favor, ACC=_acc(cdt), **sc)
            _launch("the dq kernel", CK._dq_kernel, (NT, BH),
                    q, k, v, *_ptrs(meta, names, v, h, hz, dn, dden, tri, dq), *meta["dims"],
                    _flags(meta, False, False), FAVOR=favor, ACC=_acc(cdt), **cc)
            _launch("the dk kernel", CK._dk_kernel, (NT, BH),
                    q, k, v, *_ptrs(meta, names, v, dh, dhz, dn, dden, tri, dk), *meta["dims"],
                    _flags(meta, False, False), FAVOR=favor, ACC=_acc(cdt), **cc)
            _launch("the dv kernel", CK._dv_kernel, (NT, BH),
                    q, k, v, *_ptrs(meta, names, v, dh, dhz, dn, dden, dv), *meta["dims"],
                    _flags(meta, False, False), FAVOR=favor, ACC=_acc(cdt), **cc)
        except KernelError as err:
            if meta["forced"] or meta["torch_fn"] is None:
                raise
            fallback(str(err))
            return _torch_backward(ctx, g, gS if has_g else None, gz if has_g else None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dS0, dz0, None


def _torch_backward(ctx, g, gS, gz):
    """The backward on the torch path, when the backward kernel cannot run: recompute the forward
    there from the saved inputs and differentiate it (same maths, same results to round-off)."""
    q, k, v, S0, z0 = ctx.saved_tensors[:5]
    meta = ctx.meta
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (q, k, v, S0, z0)]
    with torch.enable_grad():
        out, S, z = meta["torch_fn"](*leaves)
    outs, ups = [out], [g.to(out.dtype)]
    if gS is not None:
        outs += [S, z]
        ups += [gS.to(S.dtype), gz.to(z.dtype)]
    used = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(outs, used, ups, allow_unused=True))
    res = [next(grads) if t is not None else None for t in leaves]
    res = [torch.zeros_like(t) if r is None and t is not None else r for r, t in zip(res, leaves)]
    return (*res, None)


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
    torch_path=None,
):
    """``linear_rope.ops.rotary_linear_attention`` on the Triton kernels (see ``supports``).

    q, k: `[B, H, N, d]` raw queries / keys with ``projection`` `[m, d]` (FAVOR+ inside), or
    `[B, H, N, m]` non-negative features; v: `[B, H, N, e]`. Returns `[B, H, N, e]` in v's
    dtype, or ``(out, state)`` with ``output_final_state`` (state in float32, or float64 for
    float64 inputs, as the torch path). The projection gets no gradient (a fixed random draw,
    as in the torch path). ``chunk_size`` / ``block_size`` are refused (the kernel's chunk comes
    from ``dispatch.pick_config``): a ValueError with the reason, as for every call ``supports``
    refuses.

    A kernel that fails to build or launch raises ``KernelError``. ``torch_path``: the op on
    the torch path, ``(q, k, v, **keywords) -> (out, state)``, which the backward recomputes the
    forward on when one of its kernels fails (the public op passes it; without it, and where
    ``LINEAR_ROPE_BACKEND=triton`` forces the kernels, that backward raises).
    """
    kw = dict(causal=causal, rotary=rotary, offset=offset, base=base, projection=projection, mask=mask,
              key_mask=key_mask, cu_seqlens=cu_seqlens, initial_state=initial_state, allow_negative=allow_negative)
    a = check_args(q, k, v, Options(**kw))
    ok, why = supports(q, k, v, output_final_state=output_final_state, chunk_size=chunk_size, block_size=block_size,
                       **kw)
    if not ok:
        raise ValueError(f"rotary_linear_attention (triton): {why}")
    B, H, N, x = q.shape
    e = v.shape[-1]
    m = a.m
    cdt = table_dtype(q.dtype)
    cfg = pick_config(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        q3, k3, v3 = (t.reshape(B * H, N, t.shape[-1]).contiguous() for t in (q, k, v))
        w = wp = c = qmax = cos = sin = km = qm = None
        if projection is not None:
            w = projection.detach().to(device=q.device, dtype=cdt).contiguous()
            c = pair_shift(w)[0::2].contiguous()  # (P,): one shift per rotation pair
            if cfg["chunk"]["XPREC"] == "bf16w3":  # w d^(-1/4) in three bf16 pieces (favor._exponent)
                ws = w.float() * (1.0 / (x ** 0.5) ** 0.5)
                w1 = ws.bfloat16()
                w2 = (ws - w1.float()).bfloat16()
                wp = torch.stack([w1, w2, (ws - w1.float() - w2.float()).bfloat16()]).contiguous()
            qmax = q.new_empty(B * H, N, dtype=cdt)
            _launch("the query-stabiliser kernel", K._qmax_kernel, (-(-N // cfg["qmax"]["C"]), B * H),
                    q3, w, c, qmax, N, m, x, (m + 1) // 2, ACC=_acc(cdt), **cfg["qmax"])
        if rotary:
            cos, sin = rotary_tables(N, m, offset=a.offset if a.positions is None else 0, base=base, dtype=cdt,
                                     device=q.device, positions=a.positions)
            cos, sin = cos.contiguous(), sin.contiguous()
        if a.kmask is not None:
            km = a.kmask.to(cdt).contiguous()  # (B, N)
            qm = a.qmask.to(cdt)[:, None].expand(B, H, N).reshape(B * H, N)
        S0 = z0 = None
        if a.state is not None:
            S0 = a.state.S.to(cdt).reshape(B * H, m, e).contiguous()
            z0 = a.state.z.to(cdt).reshape(B * H, m).contiguous()
        tab_rows = 1 if cos is None or cos.dim() == 2 else cos.shape[0]
        dims = (N, H, m, x if projection is not None else m, e, (m + 1) // 2, x, tab_rows,
                key_exponent_floor(cdt))
        shape = (B, H, N, x, m, e)
        meta = dict(cfg=cfg, m=m, cdt=cdt, w=w, wp=wp, c=c, km=km, qmask=qm, qmax=qmax, cos=cos, sin=sin, dims=dims,
                    store_state=output_final_state, forced=backend() == "triton",
                    torch_fn=None if torch_path is None else lambda *t: _torch_path(torch_path, t, shape, kw))
        out, S, z = _TritonCausal.apply(q3, k3, v3, S0, z0, meta)
    out = out.view(B, H, N, e).to(v.dtype)
    if not output_final_state:
        return out
    return out, LinearAttentionState(S.view(B, H, m, e), z.view(B, H, m))



def _torch_path(op, tensors, shape, kw):
    """``op`` (the torch path) on the kernels' flattened inputs (q3, k3, v3, S0, z0): (out, S, z)
    flattened like the kernels' outputs, in the compute dtype."""
    B, H, N, x, m, e = shape
    q3, k3, v3, S0, z0 = tensors
    kw = dict(kw, initial_state=None if S0 is None else LinearAttentionState(S0.view(B, H, m, e), z0.view(B, H, m)))
    out, st = op(q3.view(B, H, N, x), k3.view(B, H, N, x), v3.view(B, H, N, e), output_final_state=True, **kw)
    return out.reshape(B * H, N, e), st.S.reshape(B * H, m, e), st.z.reshape(B * H, m)
