"""The chunked causal path as a PyTorch custom op, with its fake (shape-only) implementation and
its backward.

``torch.compile`` sees ``linear_rope::chunk_causal`` as one node: a model holding the layer
compiles to one graph (no break), and the node's shapes follow the sequence length
symbolically, so new lengths do not recompile (``dynamic``). The forward and the backward run
the block walks of ``chunk_fwd`` and ``chunk_bwd`` eagerly inside the node, on whatever device
the tensors live on.

The forward returns, after ``[out, S, z]``, what the backward reads (``SAVED``): the
denominators, the states before every block, the RoPE tables in the walk's layout and the
buffers of ``chunk_fwd.keep_plan`` (empty where the plan keeps nothing).
"""
from __future__ import annotations

import torch

from ..features import favor_projection
from . import chunk_fwd
from .chunk_bwd import causal_backward
from .chunk_fwd import KEPT, Favor, Walk, causal_forward
from .layout import OpConfig, block_size, chunk_layout, flat, padded_length, unflat

__all__ = ["chunk_causal", "SAVED"]

SAVED = ("den", "block_S", "block_z", "cos", "sin") + KEPT


def _walk(lay, w):
    favor = None if w is None else Favor(w, *favor_projection(w))
    rot = None if lay.cos_sin is None else torch.complex(*lay.cos_sin)
    return Walk(lay.C, lay.T, favor, rot, lay.km, lay.starts)


def _empty(like):
    return like.new_empty(0)


def _given(aux):
    """aux [mask, projection, positions] with an empty tensor for each one not given -> None there."""
    return [t if t.numel() else None for t in aux]


@torch.library.custom_op("linear_rope::chunk_causal", mutates_args=())
def chunk_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: list[torch.Tensor],
    aux: list[torch.Tensor], cfg: list[int], base: float,
) -> list[torch.Tensor]:
    """Causal Eq. 19 (Eq. 18 without ``rotary``) in the compute dtype.

    q, k `[B, H, N, d or m]`, v `[B, H, N, e]`; state [S0 `[rows, H, m, e]`, z0 `[rows, H, m]`]
    (rows: B, or the packed documents); aux [mask `[B, N]` bool, projection `[m, d]`, positions
    `[B, N]` long], each empty when not given; cfg ``OpConfig.to_list()``; base the RoPE base.
    Returns [out `[B, H, N, e]`, S, z (as the state)] + the tensors named in ``SAVED``.
    """
    c = OpConfig.from_list(cfg, base)
    mask, w, positions = _given(aux)
    B, H, N, e = v.shape
    S0, z0 = state
    m = S0.shape[2]
    lay = chunk_layout(c, (B, H, N), mask, positions, m, v)
    walk = _walk(lay, w)
    D = len(lay.starts)
    bufs = chunk_fwd.keep_plan((lay.Np // lay.C, B * H, lay.C, m, e), w is not None, c.rotary, v)
    out, (S, z), den, (bS, bz) = causal_forward(walk, (flat(q, lay), flat(k, lay), flat(v, lay)),
                                                (S0.reshape(D, B * H, m, e), z0.reshape(D, B * H, m)), bufs)
    cos, sin = lay.cos_sin if lay.cos_sin is not None else (_empty(v), _empty(v))
    kept = [bufs[n] if n in bufs else _empty(v) for n in KEPT]
    return [unflat(out, lay, (B, H, N)), S.view(S0.shape), z.view(z0.shape), den, bS, bz, cos, sin, *kept]


@chunk_causal.register_fake
def _(q, k, v, state, aux, cfg, base):
    c = OpConfig.from_list(cfg, base)
    mask, w, positions = _given(aux)
    B, H, N, e = v.shape
    S0, z0 = state
    m = S0.shape[2]
    C, T = block_size(c, N)
    Np = padded_length(c, N)
    nb = -(-Np // T)
    if not c.rotary:
        tables = [_empty(v), _empty(v)]
    elif positions is not None and B > 1:
        tables = [v.new_empty(B, Np, m // 2) for _ in range(2)]
    else:
        tables = [v.new_empty(Np, m // 2) for _ in range(2)]
    plan = chunk_fwd.keep_plan((Np // C, B * H, C, m, e), w is not None, c.rotary, v, sizes_only=True)
    kept = [v.new_empty(plan[n]) if n in plan else _empty(v) for n in KEPT]
    return [v.new_empty(B, H, N, e), S0.new_empty(S0.shape), z0.new_empty(z0.shape), v.new_empty(Np // C, B * H, C),
            v.new_empty(nb, B * H, m, e), v.new_empty(nb, B * H, m), *tables, *kept]


@torch.library.custom_op("linear_rope::chunk_causal_backward", mutates_args=())
def chunk_causal_backward(
    grads: list[torch.Tensor], inputs: list[torch.Tensor], saved: list[torch.Tensor],
    aux: list[torch.Tensor], cfg: list[int], base: float,
) -> list[torch.Tensor]:
    """The gradients of ``chunk_causal``: grads [g_out, g_S, g_z], inputs [q, k, v, S0, z0, out],
    saved the tensors named in ``SAVED``; aux, cfg, base as given to the forward.
    Returns [dq, dk, dv, dS0, dz0]."""
    c = OpConfig.from_list(cfg, base)._replace(rotary=False)  # the tables come saved
    mask, w, positions = _given(aux)
    q, k, v, S0, z0, out = inputs
    g, gS, gz = grads
    den, bS, bz, cos, sin, *kept = saved
    B, H, N, e = v.shape
    m = S0.shape[2]
    lay = chunk_layout(c, (B, H, N), mask, None, m, v)
    if cos.numel():
        lay = lay._replace(cos_sin=(cos, sin))
    walk = _walk(lay, w)
    D = len(lay.starts)
    bufs = {n: t for n, t in zip(KEPT, kept) if t.numel()}
    fl = lambda t: flat(t, lay)  # noqa: E731
    with torch.autocast(v.device.type, enabled=False):  # a backward called inside an autocast block: these dtypes
        (dq, dk, dv), (dS0, dz0) = causal_backward(
            walk, (fl(q), fl(k), fl(v), fl(out), den, bS, bz), fl(g),
            (gS.reshape(D, B * H, m, e), gz.reshape(D, B * H, m)),
            (S0.reshape(D, B * H, m, e), z0.reshape(D, B * H, m)), bufs)
    shape = (B, H, N)
    grads = [unflat(t, lay, shape) for t in (dq, dk, dv)]
    return grads + [dS0.view(S0.shape), dz0.view(z0.shape)]


@chunk_causal_backward.register_fake
def _(grads, inputs, saved, aux, cfg, base):
    return [t.new_empty(t.shape) for t in inputs[:5]]


def _setup_context(ctx, inputs, output):
    q, k, v, state, aux, cfg, base = inputs
    ctx.mark_non_differentiable(*output[3:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, *state, output[0], *output[3:], *aux)
    ctx.cfg, ctx.base, ctx.n_saved = cfg, base, len(output) - 3


def _backward(ctx, grads):
    if torch.is_grad_enabled():  # create_graph=True: the backward is hand-written, not differentiable
        raise RuntimeError("rotary_linear_attention: double backward (create_graph=True) is not supported")
    t = ctx.saved_tensors
    inputs, saved, aux = list(t[:6]), list(t[6 : 6 + ctx.n_saved]), list(t[6 + ctx.n_saved :])
    like = (inputs[5], inputs[3], inputs[4])  # out, S0, z0: the shapes of out, S, z
    g, gS, gz = (torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads[:3], like))
    dq, dk, dv, dS0, dz0 = chunk_causal_backward([g, gS, gz], inputs, saved, aux, ctx.cfg, ctx.base)
    return dq, dk, dv, [dS0, dz0], [None] * len(aux), None, None


chunk_causal.register_autograd(_backward, setup_context=_setup_context)
