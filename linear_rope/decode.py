"""Decoder: batched token-by-token decoding of a ``PerformerLM`` on state updated in place.

``PerformerLM.step`` is functional (states in, new states out) and checks its arguments on
every call, which reads tensor values. A ``Decoder`` is what decoding loops use instead
(``PerformerLM.generate`` does)::

    dec = Decoder(model, batch_size=B, max_len=P + n)  # buffers allocated once
    logits = dec.prefill(ids, mask=mask)               # `[B, P]` prompts -> `[B, vocab]`
    for _ in range(n):
        tok = dec.sample(logits)                       # `[B]`, on the device
        logits = dec.step(tok)                         # `[B, vocab]`, O(1) in the context

* Every layer's state lives in one preallocated buffer `[B, H, m, e + 1]`: S in the first e
  columns, z in the last (``LinearAttentionState`` views of it: ``dec.states``). A step adds
  the token to it in place and reads S and z back with one batched product.
* Each row's next position is a device tensor `[B]` (left-padded prompts decode at their own
  positions); RoPE's cos and sin rows are precomputed at ``prefill`` (exactly as
  ``linear_rope.rotary`` forms them) and a step gathers one row per batch row.
* A step reads no tensor value into Python and copies no Python data to the device: nothing
  waits for the GPU until the caller reads the tokens. Its work does not grow with the context.
* On CUDA the step is compiled (``torch.compile(mode="reduce-overhead")``: a CUDA graph, one
  replay per token); elsewhere it runs eagerly unless ``compile=True``. A compile that fails
  falls back to eager with one warning.

The ``softmax`` anchor keeps a key/value cache of ``max_len`` slots instead (O(max_len) per step).
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from .attention import ROW_SUM_FLOOR
from .checks import ID_DTYPES
from .features import key_exponent_floor, pair_shift
from .ops import LinearAttentionState
from .rotary import MAX_POSITION, check_offset, rotary_tables, table_dtype
from .softmax_attention import KVCache

__all__ = ["Decoder", "check_temperature", "sample_next"]


def check_temperature(temperature) -> None:
    """A finite number >= 0 (0: greedy); any positive value samples, however small."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")


def check_top_k(top_k) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")


def _rounds_to_zero(x: float, dtype: torch.dtype) -> bool:
    """``x`` (> 0) is 0 in ``dtype``: at or below half its smallest subnormal (ties go to even, 0)."""
    fi = torch.finfo(dtype)
    return x <= fi.smallest_normal * fi.eps / 2


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int | None, generator=None) -> torch.Tensor:
    """logits `[B, V]` -> token ids `[B]`, on the device: reads no value into Python.

    ``top_k=1`` or ``temperature=0`` is greedy. Sampling draws what ``torch.multinomial(probs, 1)``
    draws from the same generator (its one-sample method: exponential noise, then an argmax),
    without its checks of the probabilities, which wait for the device.
    """
    check_temperature(temperature)
    check_top_k(top_k)
    if top_k == 1 or temperature == 0:
        return logits.argmax(-1)
    if _rounds_to_zero(temperature, logits.dtype):  # 1e-300 is 0 in float32: x / 0
        logits = logits.double()  # float64 holds it (finite and > 0: check_temperature)
    # Shift the max to 0 first: a tiny temperature then sends the others to -inf, never inf - inf.
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def _rope_rows(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """`[T, 2 dim]`: cos of each pair's angle twice, then (-sin, sin) per pair, for integer
    ``positions`` `[T]`: ``x * cos + swap(x) * sin`` is then RoPE (Eq. 34) of x's pairs."""
    cos, sin = rotary_tables(positions.shape[0], dim, base=base, dtype=dtype, device=positions.device,
                             positions=positions)  # (T, dim/2)
    return torch.cat((cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)), dim=-1)


def _rotate(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """RoPE of x `[..., D]` (interleaved pairs) with ``_rope_rows`` rows broadcast to `[..., 2 D]`."""
    D = x.shape[-1]
    swapped = x.unflatten(-1, (D // 2, 2)).flip(-1).flatten(-2)
    return (x * rows[..., :D]).addcmul_(swapped, rows[..., D:])


class Decoder:
    """Decodes ``batch_size`` rows of ``model`` (a ``PerformerLM``) token by token.

    Args:
        model: the ``PerformerLM``; its weights are read live, its FAVOR+ projections at each
            ``prefill`` / ``load`` (a redraw in between takes effect at the next one).
        batch_size: rows decoded together.
        max_len: how far a row may go: prompt columns plus decoded tokens (more exactly, every
            position stays below the smallest starting position plus ``max_len``; the ``softmax``
            anchor's key/value cache has ``max_len`` slots).
        compile: ``torch.compile`` the step (default: on CUDA only, as a CUDA graph).

    Run it under ``torch.no_grad()`` (``generate`` does), with the model in eval mode.
    """

    def __init__(self, model, batch_size: int, max_len: int, *, compile: bool | None = None):
        for name, v in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if compile is not None and not isinstance(compile, bool):
            raise ValueError(f"compile must be True, False or None, got {compile!r}")
        cfg = model.cfg
        self.model, self.cfg, self.B, self.max_len = model, cfg, batch_size, max_len
        p = model.head.weight
        self.device, self.dtype = p.device, table_dtype(p.dtype)  # states and tables: float32 or wider
        self.softmax = cfg.position == "softmax"
        H, d = cfg.heads, cfg.dim_head
        self.m = model.blocks[0].attn.features.out_features if not self.softmax else d
        self.e = d + (cfg.position == "rope_norm")  # rope_norm's ones column
        kw = dict(device=self.device)
        if self.softmax:
            kv = (batch_size, H, max_len, d)
            self.k = [torch.zeros(kv, dtype=p.dtype, **kw) for _ in model.blocks]
            self.v = [torch.zeros(kv, dtype=p.dtype, **kw) for _ in model.blocks]
            self.key_mask = torch.zeros(batch_size, max_len, dtype=torch.bool, **kw)
            self.slot = torch.zeros(1, dtype=torch.long, **kw)  # the cache column of the next token
            self.buffers = self.k + self.v + [self.key_mask, self.slot]
        else:
            self.Sz = [torch.zeros(batch_size, H, self.m, self.e + 1, dtype=self.dtype, **kw) for _ in model.blocks]
            self.buffers = list(self.Sz)
        self.positions = torch.zeros(batch_size, dtype=torch.long, **kw)  # each row's next position
        self.first = torch.zeros(1, dtype=torch.long, **kw)  # the position of the tables' row 0
        rot = cfg.position in ("rope", "rope_norm")
        pre = cfg.position in ("rope_pre", "softmax")
        self.rope = torch.zeros(max_len, 2 * self.m, dtype=self.dtype, **kw) if rot else None
        self.rope_pre = torch.zeros(max_len, 2 * d, dtype=self.dtype, **kw) if pre else None
        self.buffers += [self.positions, self.first] + [t for t in (self.rope, self.rope_pre) if t is not None]
        self.favor = None  # per layer: W^T `[d, m]` and the shifts (c, -c) `[2, 1, m]`, set at prefill / load
        if cfg.feature_map == "favor" and not self.softmax:
            self.favor = [(torch.zeros(d, self.m, dtype=self.dtype, **kw),
                           torch.zeros(2, 1, self.m, dtype=self.dtype, **kw)) for _ in model.blocks]
            self.buffers += [t for pair in self.favor for t in pair]
        self._steps = self._left = self._filled = 0  # since prefill / load: steps, steps left, cache slots
        self._loaded = self._compile_ok = False
        self._compiled = None
        if compile if compile is not None else self.device.type == "cuda":
            for t in self.buffers:
                torch._dynamo.mark_static_address(t)
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._compiled = torch.compile(self._forward_step, mode=mode, fullgraph=True, dynamic=False)

    # -- filling the state ---------------------------------------------------------------------

    def _check_ids(self, ids: torch.Tensor, name: str, dims: int) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != dims or ids.dtype not in ID_DTYPES \
                or ids.shape[0] != self.B or (dims == 2 and ids.shape[1] == 0):
            want = f"[B={self.B}, N >= 1]" if dims == 2 else f"[B={self.B}]"
            raise ValueError(f"{name} must be an integer tensor {want}, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} {list(getattr(ids, 'shape', []))}")
        if ids.device != self.device:
            raise ValueError(f"{name} is on {ids.device}, the model on {self.device}")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Read prompts `[B, N]` in one parallel forward (``mask`` `[B, N]` bool, True = real
        token, padding left or right) and return each row's logits after its last real token
        `[B, vocab]`. The state then holds the prompts; positions count real tokens."""
        self._check_ids(ids, "ids", 2)
        N = ids.shape[1]
        if N > self.max_len:
            raise ValueError(f"ids: {N} columns do not fit max_len={self.max_len}")
        logits, states = self.model(ids, mask=mask, output_final_state=True)
        if mask is None:
            last = logits[:, -1]
            positions = torch.full((self.B,), N, dtype=torch.long, device=self.device)
        else:  # the last real token of each row (padding on either side)
            idx = (N - 1 - mask.flip(1).long().argmax(1)).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
            last = logits.gather(1, idx)[:, 0]
            positions = mask.sum(1)
        self.load(states, positions, key_columns=N)
        return last

    @torch.no_grad()
    def load(self, states: list, positions: int | torch.Tensor, *, key_columns: int | None = None) -> None:
        """Continue from ``states`` (one per layer, as ``PerformerLM.forward(...,
        output_final_state=True)`` or ``PerformerLM.step`` give them) with each row's next
        position ``positions`` (an int, or a LongTensor `[B]`). ``key_columns``: the columns of
        ``max_len`` the prompt used (the ``softmax`` anchor's ``KVCache`` fills that many slots;
        default: all of the cache given, and none for the linear state). One read of the
        positions (their range) happens here, none later."""
        if not isinstance(states, (list, tuple)) or len(states) != len(self.model.blocks):
            raise ValueError(f"states: one state per layer is needed ({len(self.model.blocks)}), got "
                             f"{len(states) if isinstance(states, (list, tuple)) else type(states).__name__}")
        positions = check_offset(positions, "positions", rows=self.B)
        if isinstance(positions, int):
            positions = torch.full((self.B,), positions, dtype=torch.long, device=self.device)
        lo, hi = (int(v) for v in torch.aminmax(positions.to(self.device)))
        if lo < 0 or hi > MAX_POSITION:  # (their one read: the range, here)
            raise ValueError(f"positions must lie in [0, MAX_POSITION = 2**62 - 1], got {lo} .. {hi}")
        if lo + self.max_len - 1 > MAX_POSITION:
            raise ValueError(f"positions: from {lo}, max_len={self.max_len} runs to {lo + self.max_len - 1}, past "
                             "MAX_POSITION = 2**62 - 1; start lower or build the Decoder with a smaller max_len")
        self.positions.copy_(positions)
        if self.softmax:
            n = states[0].k.shape[2] if key_columns is None else key_columns
            if n > self.max_len:
                raise ValueError(f"states: {n} cached keys do not fit max_len={self.max_len}")
            for i, st in enumerate(states):
                if not isinstance(st, KVCache) or st.k.shape != (self.B, self.cfg.heads, n, self.cfg.dim_head):
                    raise ValueError(f"states[{i}]: a KVCache of k, v [B={self.B}, H, {n}, d] is needed")
                self.k[i][:, :, :n].copy_(st.k), self.v[i][:, :, :n].copy_(st.v)
                self.k[i][:, :, n:].zero_(), self.v[i][:, :, n:].zero_()
            self.key_mask.zero_()[:, :n].copy_(states[0].key_mask)
            self.slot.fill_(n)
            self._filled = n
        else:
            want = (self.B, self.cfg.heads, self.m, self.e)
            for i, st in enumerate(states):
                if not isinstance(st, tuple) or len(st) != 2 or st[0].shape != want or st[1].shape != want[:3]:
                    raise ValueError(f"states[{i}]: a LinearAttentionState S {list(want)}, z {list(want[:3])} "
                                     "is needed")
                self.Sz[i][..., :-1].copy_(st[0]), self.Sz[i][..., -1].copy_(st[1])
        used = key_columns if key_columns is not None else (self._filled if self.softmax else 0)
        self._left = self.max_len - max(used, hi - lo)  # the cache's slots, and the RoPE rows
        if self.model.pos_emb is not None:  # and the absolute table: positions below seq_len
            self._left = max(0, min(self._left, self.cfg.seq_len - hi))
        self.first.fill_(lo)
        rows = torch.arange(lo, lo + self.max_len, device=self.device)
        if self.rope is not None:
            self.rope.copy_(_rope_rows(rows, self.m, self.cfg.rope_base, self.dtype))
        if self.rope_pre is not None:
            self.rope_pre.copy_(_rope_rows(rows, self.cfg.dim_head, self.cfg.rope_base, self.dtype))
        for blk, (wt, shifts) in zip(self.model.blocks, self.favor or []):
            w = blk.attn.features.projection.to(self.dtype)
            c = pair_shift(w)
            wt.copy_(w.t()), shifts.copy_(torch.stack((c, -c))[:, None])
        self._steps, self._loaded = 0, True

    @property
    def states(self) -> list:
        """The live state of every layer: ``LinearAttentionState`` views of the buffers (S `[B, H,
        m, e]`, z `[B, H, m]`), or for ``softmax`` the ``KVCache`` of the slots filled so far."""
        if self.softmax:
            n = self._filled + self._steps
            return [KVCache(k[:, :, :n], v[:, :, :n], self.key_mask[:, :n]) for k, v in zip(self.k, self.v)]
        return [LinearAttentionState(t[..., :-1], t[..., -1]) for t in self.Sz]

    @property
    def steps_left(self) -> int:
        """How many more ``step`` calls fit ``max_len``."""
        return self._left - self._steps

    # -- one token -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token ids `[B]` -> logits `[B, vocab]`, the state advanced in place by one token.

        Only the shape, dtype and device of ``token`` are checked: its values are not read (an
        id outside the vocabulary fails in the embedding)."""
        if not self._loaded:
            raise ValueError("step: nothing to continue from; call prefill (or load) first")
        self._check_ids(token, "token", 1)
        if self._steps >= self._left:
            table = f" or the absolute table's seq_len={self.cfg.seq_len}" if self.model.pos_emb is not None else ""
            raise ValueError(f"step: max_len={self.max_len}{table} reached ({self._steps} steps after the prompt); "
                             "build the Decoder with a larger max_len")
        self._steps += 1
        if self._compiled is not None:
            try:
                torch.compiler.cudagraph_mark_step_begin()
                logits = self._compiled(token).clone()  # a CUDA graph's output is overwritten by its next replay
                self._compile_ok = True
                return logits
            except Exception as e:  # a failed compile: eager gives the same result
                if self._compile_ok:
                    raise
                first = str(e).splitlines()[0] if str(e) else ""
                warnings.warn(f"Decoder: torch.compile failed, decoding eagerly ({type(e).__name__}: {first})",
                              stacklevel=3)
                self._compiled = None
        return self._forward_step(token)

    def _forward_step(self, token: torch.Tensor) -> torch.Tensor:
        """The step's work: no Python branch on a tensor value, no read, no Python data."""
        model = self.model
        row = self.positions - self.first  # (B,) the tables' row of each token
        x = model.tok_emb(token.long())
        if model.pos_emb is not None:
            x = x + model.pos_emb(self.positions)
        x = model.drop(x)
        rope = None if self.rope is None else self.rope.index_select(0, row)[:, None, None]  # (B, 1, 1, 2m)
        pre = None if self.rope_pre is None else self.rope_pre.index_select(0, row)[:, None, None]
        for i, blk in enumerate(model.blocks):
            a = self._softmax_layer(i, blk.attn, blk.ln1(x), pre) if self.softmax else \
                self._linear_layer(i, blk.attn, blk.ln1(x), rope, pre)
            x = x + a
            x = x + blk.ff(blk.ln2(x))
        self.positions.add_(1)
        if self.softmax:
            self.slot.add_(1)
        return model.head(model.ln_f(x))

    def _qk_v(self, attn, h: torch.Tensor, pre: torch.Tensor | None):
        """qk `[B, 2, H, d]` (normed, rotated for rope_pre) and v `[B, H, d]`."""
        qkv = attn.to_qkv(h).view(h.shape[0], 3, attn.heads, attn.dim_head)
        qk, v = qkv[:, :2], qkv[:, 2]
        if attn.qk_norm is not None:
            qk = F.normalize(qk, dim=-1) * attn.qk_norm.scale.view(1, 1, -1, 1).to(qk.dtype)
        if pre is not None:
            qk = _rotate(qk.to(self.dtype), pre).to(qk.dtype)
        return qk, v

    def _linear_layer(self, i: int, attn, h: torch.Tensor, rope, pre) -> torch.Tensor:
        """Eq. 19 for one token, as ``rotary_linear_attention_step`` computes it."""
        qk, v = self._qk_v(attn, h, pre)
        cdt = self.dtype
        with torch.autocast(h.device.type, enabled=False):
            qk, v = qk.to(cdt), v.to(cdt)
            if self.favor is not None:  # stabilised FAVOR+ (linear_rope.features), q and k at once
                w, shifts = self.favor[i]
                xs = qk * qk.shape[-1] ** -0.25
                phi = torch.matmul(xs, w).add_(shifts)  # (B, 2, H, m): w.q' + c, w.k' - c
                phi[:, 1].sub_(xs[:, 1].square().sum(-1, keepdim=True), alpha=0.5)  # keys: - |k'|^2 / 2
                phi[:, 0].sub_(phi[:, 0].amax(-1, keepdim=True))
                phi[:, 1].clamp_(min=key_exponent_floor(cdt), max=0.0)
                phi.exp_()
            elif attn.features.kind == "elu":
                phi = F.elu(qk).add_(1.0)
            else:
                phi = F.relu(qk)
            rphi = phi if rope is None else _rotate(phi, rope)
            Sz = self.Sz[i]  # (B, H, m, e + 1): S, then z
            Sz[..., :v.shape[-1]].addcmul_(rphi[:, 1, :, :, None], v[:, :, None, :])
            if self.e > v.shape[-1]:  # rope_norm: v's ones column
                Sz[..., -2].add_(rphi[:, 1])
            Sz[..., -1].add_(phi[:, 1])
            # numerator (R phi(q))^T S and denominator phi(q)^T z in one product
            res = torch.matmul(torch.stack((rphi[:, 0], phi[:, 0]), dim=2), Sz)  # (B, H, 2, e + 1)
            den = res[:, :, 1, -1:]
            out = res[:, :, 0, :-1] / den.masked_fill(den <= 0, 1.0)  # as naive: <= 0 divides by 1, NaN stays
            if self.e > v.shape[-1]:
                out = out[..., :-1] / out[..., -1:].clamp_min(ROW_SUM_FLOOR)
        return attn.dropout(attn.to_out(out.flatten(1).to(h.dtype)))

    def _softmax_layer(self, i: int, attn, h: torch.Tensor, pre) -> torch.Tensor:
        qk, v = self._qk_v(attn, h, pre)
        k_cache, v_cache = self.k[i], self.v[i]
        k_cache.index_copy_(2, self.slot, qk[:, 1, :, None].to(k_cache.dtype))
        v_cache.index_copy_(2, self.slot, v[:, :, None].to(v_cache.dtype))
        if i == 0:
            self.key_mask.index_fill_(1, self.slot, True)
        out = F.scaled_dot_product_attention(qk[:, 0, :, None], k_cache, v_cache,
                                             attn_mask=self.key_mask[:, None, None, :])
        return attn.dropout(attn.to_out(out.flatten(1).to(h.dtype)))

    # -- sampling and the whole loop -----------------------------------------------------------

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, *, mask: torch.Tensor | None = None,
                 temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Prefill ``ids`` (``mask`` as in ``prefill``), then sample ``max_new_tokens`` per row:
        a LongTensor `[B, max_new_tokens]` on the device. No step waits for the device; the
        caller's first read of the result does."""
        check_temperature(temperature)
        check_top_k(top_k)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        out = torch.empty(self.B, max_new_tokens, dtype=torch.long, device=self.device)
        if max_new_tokens == 0:
            return out
        logits = self.prefill(ids, mask).float()
        for i in range(max_new_tokens):
            tok = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
            out[:, i] = tok
            if i + 1 < max_new_tokens:
                logits = self.step(tok).float()
        return out
