"""One token's step of a ``Decoder``: its work, and its compiled form.

``forward_step(dec, token)`` is the step: the token through every layer on the ``Decoder``'s
buffers, the state updated in place. It branches on no tensor value, reads none into Python and
copies no Python data to the device. Compiled (``compiled_step``), the state's update and its
read-out are one pass over it (``_update_and_read``); eagerly, one in-place batched product
updates it and one reads it.

One compiled step per shape is shared by every Decoder of that shape (``_STEPS``); a compile
for a new shape, or a recompile of a known one, says so in one warning (``say_compiled``), and
a compile that fails falls back to eager with one warning (``run_compiled``).
"""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

from .attention import ROW_SUM_FLOOR
from .features import key_exponent_floor, pair_shift
from .held_weights import linear
from .rotary import rotary_tables

__all__ = ["forward_step", "rope_rows", "fill_tables", "compiled_step", "run_compiled"]


# -- RoPE on the step's rows ---------------------------------------------------------------------

def rope_rows(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """`[T, 2 dim]`: cos of each pair's angle twice, then (-sin, sin) per pair, for integer
    ``positions`` `[T]`: ``x * cos + swap(x) * sin`` is then RoPE (Eq. 34) of x's pairs."""
    cos, sin = rotary_tables(positions.shape[0], dim, base=base, dtype=dtype, device=positions.device,
                             positions=positions)  # (T, dim/2)
    return torch.cat((cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)), dim=-1)


def fill_tables(dec, lo: int) -> None:
    """The tables ``dec``'s step gathers rows from, from position ``lo`` on: RoPE's rows for
    ``max_len`` positions, and each layer's FAVOR+ projection (W^T) and shifts (c, -c)."""
    dec.first.fill_(lo)
    rows = torch.arange(lo, lo + dec.max_len, device=dec.device)
    if dec.rope is not None:
        dec.rope.copy_(rope_rows(rows, dec.m, dec.cfg.rope_base, dec.dtype))
    if dec.rope_pre is not None:
        dec.rope_pre.copy_(rope_rows(rows, dec.cfg.dim_head, dec.cfg.rope_base, dec.dtype))
    for blk, (wt, shifts) in zip(dec.model.blocks, dec.favor or []):
        w = blk.attn.features.projection.to(dec.dtype)
        c = pair_shift(w)
        wt.copy_(w.t()), shifts.copy_(torch.stack((c, -c))[:, None])


def _rotate(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """RoPE of x `[..., D]` (interleaved pairs) with ``rope_rows`` rows broadcast to `[..., 2 D]`."""
    D = x.shape[-1]
    swapped = x.unflatten(-1, (D // 2, 2)).flip(-1).flatten(-2)
    return (x * rows[..., :D]).addcmul_(swapped, rows[..., D:])


def _traced(t: torch.Tensor) -> bool:
    """True while the step is traced for a compiler: by dynamo (``torch.compile``), or by
    AOTAutograd / ``make_fx`` directly (``compile_fx`` on a graph, as ``benchmarks.gpu_predict``
    compiles it), which hand the step functional or fake tensors instead of the plain buffers."""
    f = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
    return f() or type(t) is not torch.Tensor


# -- the step's work -------------------------------------------------------------------------------

def forward_step(dec, token: torch.Tensor) -> torch.Tensor:
    """The step's work on ``dec`` (a ``Decoder``): no Python branch on a tensor value, no read,
    no Python data."""
    model = dec.model
    row = dec.positions - dec.first  # (B,) the tables' row of each token
    x = model.tok_emb(token.long())
    if model.pos_emb is not None:
        x = x + model.pos_emb(dec.positions)
    x = model.drop(x)
    rope = None if dec.rope is None else dec.rope.index_select(0, row)[:, None, None]  # (B, 1, 1, 2m)
    pre = None if dec.rope_pre is None else dec.rope_pre.index_select(0, row)[:, None, None]
    W = dec._w
    for i, blk in enumerate(model.blocks):
        w = (None,) * 4 if W is None else W[i]  # (to_qkv, to_out, ff in, ff out): held (weight, bias) or None
        a = _softmax_layer(dec, i, blk.attn, blk.ln1(x), pre, w) if dec.softmax else \
            _linear_layer(dec, i, blk.attn, blk.ln1(x), rope, pre, w)
        x = x + a
        h = blk.ln2(x)
        if W is None:
            x = x + blk.ff(h)
        else:
            ff = blk.ff
            x = x + ff[3](linear(ff[2], w[3], ff[1](linear(ff[0], w[2], h))))
    dec.positions.add_(1)
    if dec.softmax:
        dec.slot.add_(1)
    return linear(model.head, None if W is None else W[-1][0], model.ln_f(x))


def _qk_v(dec, attn, h: torch.Tensor, pre: torch.Tensor | None, w: tuple):
    """qk `[B, 2, H, d]` (normed, rotated for rope_pre) and v `[B, H, d]`."""
    qkv = linear(attn.to_qkv, w[0], h).view(h.shape[0], 3, attn.heads, attn.dim_head)
    qk, v = qkv[:, :2], qkv[:, 2]
    if attn.qk_norm is not None:
        qk = F.normalize(qk, dim=-1) * attn.qk_norm.scale.view(1, 1, -1, 1).to(qk.dtype)
    if pre is not None:
        qk = _rotate(qk.to(dec.dtype), pre).to(qk.dtype)
    return qk, v


def _favor(qk: torch.Tensor, proj: torch.Tensor, shifts: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """Stabilised FAVOR+ (``linear_rope.features``) of q and k at once: `[B, 2, H, m]`."""
    xs = qk * qk.shape[-1] ** -0.25
    if _traced(xs):
        # out of place, q and k together (a row max and a norm for each, the queries'
        # max and the keys' norm used): no in-place write on a slice keeps Inductor
        # from fusing; compiled, the features and their rotation are a GEMM and a kernel
        sq = xs.square().sum(-1, keepdim=True)  # |x'|^2
        lin = torch.matmul(xs, proj) + shifts  # (B, 2, H, m): w.q' + c, w.k' - c
        is_q = torch.arange(2, device=lin.device).view(1, 2, 1, 1) == 0
        return torch.where(is_q, lin - lin.amax(-1, keepdim=True),  # queries: - their max
                           lin.sub(sq, alpha=0.5).clamp(min=key_exponent_floor(cdt), max=0.0)).exp()
    # eagerly, in place: fewer operations (the same values)
    phi = torch.matmul(xs, proj).add_(shifts)  # (B, 2, H, m): w.q' + c, w.k' - c
    phi[:, 1].sub_(xs[:, 1].square().sum(-1, keepdim=True), alpha=0.5)  # keys: - |k'|^2 / 2
    phi[:, 0].sub_(phi[:, 0].amax(-1, keepdim=True))
    phi[:, 1].clamp_(min=key_exponent_floor(cdt), max=0.0)
    return phi.exp_()


def _linear_layer(dec, i: int, attn, h: torch.Tensor, rope, pre, w: tuple) -> torch.Tensor:
    """Eq. 19 for one token, as ``rotary_linear_attention_step`` computes it."""
    qk, v = _qk_v(dec, attn, h, pre, w)
    cdt = dec.dtype
    with torch.autocast(h.device.type, enabled=False):
        qk, v = qk.to(cdt), v.to(cdt)
        if dec.favor is not None:
            phi = _favor(qk, *dec.favor[i], cdt)
        elif attn.features.kind == "elu":
            phi = F.elu(qk).add_(1.0)
        else:
            phi = F.relu(qk)
        rphi = phi if rope is None else _rotate(phi, rope)
        num, den = _update_and_read(dec, dec.Sz[i], rphi, phi, v)
        out = num / den.masked_fill(den <= 0, 1.0)  # as naive: <= 0 divides by 1, NaN stays
        if dec.e > v.shape[-1]:
            out = out[..., :-1] / out[..., -1:].clamp_min(ROW_SUM_FLOOR)
    return attn.dropout(linear(attn.to_out, w[1], out.flatten(1).to(h.dtype)))


def _update_and_read(dec, Sz: torch.Tensor, rphi: torch.Tensor, phi: torch.Tensor, v: torch.Tensor):
    """Add the key to the state in place (S += R phi(k) v^T, z += phi(k); rope_norm: S's ones
    column += R phi(k)) and read the query out of the new state: (numerator (R phi(q))^T S
    `[B, H, e]`, denominator phi(q)^T z `[B, H, 1]`). ``Sz`` `[B, H, e + 1, m]`; ``rphi`` and
    ``phi`` `[B, 2, H, m]` (queries, keys), rotated and not; v `[B, H, d]`."""
    B, H, E, m = Sz.shape
    if _traced(Sz):
        # one pass over the state: each row of S^T and z is read, updated and written back,
        # and summed against the query, in one kernel (Inductor fuses the elementwise ops with
        # the sum over the contiguous m, as it fuses a layer norm's)
        z_row = (torch.arange(E, device=Sz.device) == E - 1)[:, None]  # (E, 1)
        ones = v.new_ones(B, H, E - v.shape[-1])  # rope_norm's ones column, then z's
        key = torch.where(z_row, phi[:, 1, :, None], rphi[:, 1, :, None])  # (B, H, E, m)
        new = Sz + torch.cat((v, ones), -1)[..., None] * key
        read = (torch.where(z_row, phi[:, 0, :, None], rphi[:, 0, :, None]) * new).sum(-1)  # (B, H, E)
        Sz.copy_(new)
        return read[..., :-1], read[..., -1:]
    # eagerly: one in-place rank-2 product ((v, e_z) times keys (R phi(k), phi(k))), then one
    # product reading S and z for (R phi(q), phi(q))
    dec.vz[:, :, :v.shape[-1], 0].copy_(v)
    Sz.view(B * H, E, m).baddbmm_(dec.vz.view(B * H, E, 2),
                                  torch.stack((rphi[:, 1], phi[:, 1]), 2).view(B * H, 2, m))
    res = torch.matmul(Sz, torch.stack((rphi[:, 0], phi[:, 0]), -1))  # (B, H, e + 1, 2)
    return res[:, :, :-1, 0], res[:, :, -1:, 1]


def _softmax_layer(dec, i: int, attn, h: torch.Tensor, pre, w: tuple) -> torch.Tensor:
    qk, v = _qk_v(dec, attn, h, pre, w)
    k_cache, v_cache = dec.k[i], dec.v[i]
    k_cache.index_copy_(2, dec.slot, qk[:, 1, :, None].to(k_cache.dtype))
    v_cache.index_copy_(2, dec.slot, v[:, :, None].to(v_cache.dtype))
    if i == 0:
        dec.key_mask.index_fill_(1, dec.slot, True)
    out = F.scaled_dot_product_attention(qk[:, 0, :, None].to(k_cache.dtype), k_cache, v_cache,
                                         attn_mask=dec.key_mask[:, None, None, :])
    return attn.dropout(linear(attn.to_out, w[1], out.flatten(1).to(h.dtype)))


# -- the compiled step, one per shape --------------------------------------------------------------

# One compiled step per shape, shared by every Decoder of that shape: {key: compiled function}.
# Each has its own dynamo entries and recompile limit (``isolate_recompiles``, where torch has
# it), so shapes do not count against each other, and past the limit the compile fails
# (``fullgraph``) instead of running eagerly unseen.
_STEPS: dict = {}
_COMPILED: dict = {}  # key -> how many times its step compiled
_RECOMPILE_LIMIT = 8


def _graphs_compiled() -> int:
    """Graphs dynamo compiled so far in this process (a call that compiles raises it)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compiled_step(key: tuple, mode: str | None):
    """The compiled ``forward_step`` for ``key`` (batch_size, max_len, device, dtype, config,
    mode), compiled at its first call."""
    fn = _STEPS.get(key)
    if fn is None:
        kw = dict(mode=mode, fullgraph=True, dynamic=False)
        try:
            known = inspect.signature(torch.compile).parameters
        except (TypeError, ValueError):
            known = {}
        if "isolate_recompiles" in known and "recompile_limit" in known:
            kw.update(isolate_recompiles=True, recompile_limit=_RECOMPILE_LIMIT)
        fn = _STEPS[key] = torch.compile(forward_step, **kw)
    return fn


def _shape(key: tuple) -> str:
    return f"batch_size={key[0]}, max_len={key[1]}"


def run_compiled(dec, token: torch.Tensor) -> torch.Tensor | None:
    """``dec``'s compiled step on ``token``: its logits, or None where the compile failed (one
    warning; ``dec`` decodes eagerly from then on). A failure after a successful compile
    (other than the recompile limit) is raised."""
    try:
        before = _graphs_compiled()
        torch.compiler.cudagraph_mark_step_begin()
        # (a clone: a CUDA graph's output is overwritten by its next replay)
        logits = dec._compiled(dec, token).clone()
        if _graphs_compiled() != before:
            say_compiled(dec._key)
        dec._compile_ok = True
        return logits
    except Exception as e:  # a failed compile: eager gives the same result
        limit = type(e).__name__ == "FailOnRecompileLimitHit"
        if dec._compile_ok and not limit:
            raise
        if dec._key not in _COMPILED and _STEPS.get(dec._key) is dec._compiled:
            del _STEPS[dec._key]  # the next Decoder of this shape tries afresh
        first = str(e).splitlines()[0] if str(e) else ""
        why = f"its recompile limit ({_RECOMPILE_LIMIT}) for {_shape(dec._key)} is reached" if limit \
            else f"{type(e).__name__}: {first}"
        warnings.warn(f"Decoder: torch.compile failed, decoding eagerly ({why})", stacklevel=4)
        dec._compiled = None
        return None


def say_compiled(key: tuple) -> None:
    """One warning line where this call compiled the step for ``key`` and it is not the
    process's first compile of a step: a new (batch_size, max_len), or the same one again."""
    n = _COMPILED.get(key, 0)
    others = sorted({(k[0], k[1]) for k in _COMPILED if k != key})
    _COMPILED[key] = n + 1
    if n:
        warnings.warn(f"Decoder: the step compiled again for {_shape(key)} (compile {n + 1} of this "
                      "shape and model kind: a weight's dtype or the autocast state changed, say)", stacklevel=5)
    elif key[:2] in others:
        warnings.warn(f"Decoder: compiling the step for another model at {_shape(key)}", stacklevel=5)
    elif others:
        seen = ", ".join(f"{b}x{L}" for b, L in others)
        warnings.warn(f"Decoder: compiling the step for a new shape, {_shape(key)} (compiled before "
                      f"for batch_size x max_len {seen}); each new shape compiles once", stacklevel=5)
