"""Decoder: batched token-by-token decoding of a ``PerformerLM`` on state updated in place.

``PerformerLM.step`` is functional (states in, new states out) and checks its arguments on
every call, which reads tensor values. A ``Decoder`` is what decoding loops use instead
(``PerformerLM.generate`` does)::

    dec = Decoder(model, batch_size=B, max_len=P + n)  # buffers allocated once
    logits = dec.prefill(ids, mask=mask)               # `[B, P]` prompts -> `[B, vocab]`
    for _ in range(n):
        tok = dec.sample(logits)                       # `[B]`, on the device
        logits = dec.step(tok)                         # `[B, vocab]`, O(1) in the context

* Every layer's state lives in one preallocated buffer `[B, H, e + 1, m]`: S^T in the first e
  rows, z in the last (``LinearAttentionState`` views of it: ``dec.states``), in float32 or
  wider; the feature axis m is the contiguous one, the one the read-out sums over. A step adds
  the token to it in place (S += R phi(k) v^T, z += phi(k): one rank-2 update) and reads S and
  z back for the query. Compiled, the update and the read-out are one
  pass over the state (it is read once and written once: the largest thing a token moves
  after the weights); eagerly, one in-place batched product updates it and one reads it.
* Under autocast (a float32 model, bfloat16 autocast, say) the step's matrices (the attention
  projections, the feed-forward and the head) are held cast to the autocast dtype, cast once
  and again only when the model's weights change (each weight's version counter and address,
  checked on the host at every step: no device read), and the step runs with autocast off:
  plain bfloat16 GEMMs instead of a cast of every weight at every token. ``refresh()`` recasts
  them explicitly (a weight written through ``.data`` bumps no version counter).
* Each row's next position is a device tensor `[B]` (left-padded prompts decode at their own
  positions); RoPE's cos and sin rows are precomputed at ``prefill`` (exactly as
  ``linear_rope.rotary`` forms them) and a step gathers one row per batch row.
* A step reads no tensor value into Python and copies no Python data to the device: nothing
  waits for the GPU until the caller reads the tokens. Its work does not grow with the context.
* On CUDA the step is compiled (``torch.compile(mode="reduce-overhead")``: a CUDA graph, one
  replay per token); elsewhere it runs eagerly unless ``compile=True``. It compiles once per
  (batch_size, max_len) (and model kind), shared by every Decoder of that shape
  (``generate`` rounds max_len up to a power of two for this); a compile for a new shape, or a
  recompile of a known one, says so in one warning naming the shape. A compile that fails
  falls back to eager with one warning; none runs eager silently (past dynamo's recompile
  limit the compile fails, and says so).

The ``softmax`` anchor keeps a key/value cache of ``max_len`` slots instead (O(max_len) per step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
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


def _compiled_step(key: tuple, mode: str | None):
    fn = _STEPS.get(key)
    if fn is None:
        kw = dict(mode=mode, fullgraph=True, dynamic=False)
        try:
            known = inspect.signature(torch.compile).parameters
        except (TypeError, ValueError):
            known = {}
        if "isolate_recompiles" in known and "recompile_limit" in known:
            kw.update(isolate_recompiles=True, recompile_limit=_RECOMPILE_LIMIT)
        fn = _STEPS[key] = torch.compile(Decoder._forward_step, **kw)
    return fn


def _traced(t: torch.Tensor) -> bool:
    """True while the step is traced for a compiler: by dynamo (``torch.compile``), or by
    AOTAutograd / ``make_fx`` directly (``compile_fx`` on a graph, as ``benchmarks.gpu_predict``
    compiles it), which hand the step functional or fake tensors instead of the plain buffers."""
    f = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling
    return f() or type(t) is not torch.Tensor


def _shape(key: tuple) -> str:
    return f"batch_size={key[0]}, max_len={key[1]}"


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force for ``device``'s type, or None."""
    dev = device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except TypeError:  # older torch: no device argument
        on = torch.is_autocast_cpu_enabled() if dev == "cpu" else torch.is_autocast_enabled()
    if not on:
        return None
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype(dev)
    return torch.get_autocast_cpu_dtype() if dev == "cpu" else torch.get_autocast_gpu_dtype()


class Decoder:
    """Decodes ``batch_size`` rows of ``model`` (a ``PerformerLM``) token by token.

    Args:
        model: the ``PerformerLM``; its weights are read live (under autocast: held cast, and
            recast at the next step when one changes; see ``refresh``), its FAVOR+ projections at
            each ``prefill`` / ``load`` (a redraw in between takes effect at the next one).
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
            # S^T, then z: [B, H, e + 1, m] (the read-out sums over the contiguous m)
            self.Sz = [torch.zeros(batch_size, H, self.e + 1, self.m, dtype=self.dtype, **kw) for _ in model.blocks]
            # the eager step's rank-2 update's left factor: column 0 = (v, [1 for rope_norm], 0), column 1 = (0, ..., 1)
            self.vz = torch.zeros(batch_size, H, self.e + 1, 2, dtype=self.dtype, **kw)
            self.vz[:, :, d:-1, 0] = 1.0
            self.vz[:, :, -1, 1] = 1.0
            self.buffers = self.Sz + [self.vz]
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
        self._w = None  # the step's matrices cast to the autocast dtype (``_sync_weights``), or None: the model's
        self._cast = None  # what they were cast from: {"dtype", "src", "dst", "sig"}
        self._compiled = None
        if compile if compile is not None else self.device.type == "cuda":
            for t in self.buffers:
                torch._dynamo.mark_static_address(t)
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._key = (batch_size, max_len, str(self.device), p.dtype, dataclasses.astuple(cfg), mode)
            self._compiled = _compiled_step(self._key, mode)

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
                self.Sz[i][:, :, :-1].copy_(st[0].transpose(-1, -2)), self.Sz[i][:, :, -1].copy_(st[1])
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
        return [LinearAttentionState(t[:, :, :-1].transpose(-1, -2), t[:, :, -1]) for t in self.Sz]

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
        cast = self._sync_weights()
        with torch.autocast(self.device.type, enabled=False) if cast else contextlib.nullcontext():
            if self._compiled is not None:
                try:
                    before = _graphs_compiled()
                    torch.compiler.cudagraph_mark_step_begin()
                    # (a clone: a CUDA graph's output is overwritten by its next replay)
                    logits = self._compiled(self, token).clone()
                    if _graphs_compiled() != before:
                        self._say_compiled()
                    self._compile_ok = True
                    return logits
                except Exception as e:  # a failed compile: eager gives the same result
                    limit = type(e).__name__ == "FailOnRecompileLimitHit"
                    if self._compile_ok and not limit:
                        raise
                    if self._key not in _COMPILED and _STEPS.get(self._key) is self._compiled:
                        del _STEPS[self._key]  # the next Decoder of this shape tries afresh
                    first = str(e).splitlines()[0] if str(e) else ""
                    why = f"its recompile limit ({_RECOMPILE_LIMIT}) for {_shape(self._key)} is reached" if limit \
                        else f"{type(e).__name__}: {first}"
                    warnings.warn(f"Decoder: torch.compile failed, decoding eagerly ({why})", stacklevel=3)
                    self._compiled = None
            return self._forward_step(token)

    def _say_compiled(self) -> None:
        """One warning line where this call compiled the step and it is not the process's first
        compile of a step: a new (batch_size, max_len), or the same one again."""
        n = _COMPILED.get(self._key, 0)
        others = sorted({(k[0], k[1]) for k in _COMPILED if k != self._key})
        _COMPILED[self._key] = n + 1
        if n:
            warnings.warn(f"Decoder: the step compiled again for {_shape(self._key)} (compile {n + 1} of this "
                          "shape and model kind: a weight's dtype or the autocast state changed, say)", stacklevel=4)
        elif self._key[:2] in others:
            warnings.warn(f"Decoder: compiling the step for another model at {_shape(self._key)}", stacklevel=4)
        elif others:
            seen = ", ".join(f"{b}x{L}" for b, L in others)
            warnings.warn(f"Decoder: compiling the step for a new shape, {_shape(self._key)} (compiled before "
                          f"for batch_size x max_len {seen}); each new shape compiles once", stacklevel=4)

    # -- the weights the step reads -------------------------------------------------------------

    def _cast_sources(self, cdt: torch.dtype) -> list:
        """Per layer (to_qkv, to_out, ff in, ff out) Linear modules, then the head. ``to_out``
        stays in float32 under float16 for RoPE's outputs (as ``RotaryLinearAttention``'s ``wide``)."""
        wide = cdt == torch.float16 and self.cfg.position in ("rope", "rope_norm")
        layers = [(b.attn.to_qkv, None if wide else b.attn.to_out, b.ff[0], b.ff[2]) for b in self.model.blocks]
        return layers + [(self.model.head,)]

    def _sync_weights(self) -> bool:
        """Hold the step's matrices in the autocast dtype where autocast would cast them at every
        token (a float32 model under bfloat16 autocast, say); recast them where a weight changed
        since (its version counter or address: host reads, no device sync). True: the step is
        to run on them with autocast off."""
        ac = _autocast_dtype(self.device)
        wdt = self.model.head.weight.dtype
        cdt = ac if ac is not None and wdt != ac and wdt != torch.float64 else None  # autocast leaves float64 alone
        if cdt is None:
            self._w = None
            return False
        c = self._cast
        if c is None or c["dtype"] != cdt:
            groups = self._cast_sources(cdt)
            src = [t for g in groups for mod in g if mod is not None for t in (mod.weight, mod.bias) if t is not None]
            dst = [torch.empty_like(t, dtype=cdt) for t in src]
            if self._compiled is not None:
                for t in dst:
                    torch._dynamo.mark_static_address(t)
            held = iter(dst)
            self._w = tuple(tuple(None if mod is None else (next(held), None if mod.bias is None else next(held))
                                  for mod in g) for g in groups)
            c = self._cast = dict(dtype=cdt, src=src, dst=dst, sig=None)
        sig = [(t._version, t.data_ptr()) for t in c["src"]]
        if sig != c["sig"]:
            with torch.no_grad():
                for d, t in zip(c["dst"], c["src"]):
                    d.copy_(t)
            c["sig"] = sig
        return True

    def refresh(self) -> None:
        """Recast the held weights at the next step. Needed only after writing the model's weights
        in a way no version counter sees (through ``.data``); in-place updates (an optimizer step,
        ``load_state_dict``) and replaced tensors are seen at every step."""
        if self._cast is not None:
            self._cast["sig"] = None

    @staticmethod
    def _lin(mod, w, x: torch.Tensor) -> torch.Tensor:
        """``mod(x)``, or on the held weights ``w`` (weight, bias) with x cast to their dtype."""
        return mod(x) if w is None else F.linear(x.to(w[0].dtype), w[0], w[1])

    # -- the step's work ----------------------------------------------------------------------

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
        W = self._w
        for i, blk in enumerate(model.blocks):
            w = (None,) * 4 if W is None else W[i]  # (to_qkv, to_out, ff in, ff out): held (weight, bias) or None
            a = self._softmax_layer(i, blk.attn, blk.ln1(x), pre, w) if self.softmax else \
                self._linear_layer(i, blk.attn, blk.ln1(x), rope, pre, w)
            x = x + a
            h = blk.ln2(x)
            if W is None:
                x = x + blk.ff(h)
            else:
                ff = blk.ff
                x = x + ff[3](self._lin(ff[2], w[3], ff[1](self._lin(ff[0], w[2], h))))
        self.positions.add_(1)
        if self.softmax:
            self.slot.add_(1)
        return self._lin(model.head, None if W is None else W[-1][0], model.ln_f(x))

    def _qk_v(self, attn, h: torch.Tensor, pre: torch.Tensor | None, w: tuple):
        """qk `[B, 2, H, d]` (normed, rotated for rope_pre) and v `[B, H, d]`."""
        qkv = self._lin(attn.to_qkv, w[0], h).view(h.shape[0], 3, attn.heads, attn.dim_head)
        qk, v = qkv[:, :2], qkv[:, 2]
        if attn.qk_norm is not None:
            qk = F.normalize(qk, dim=-1) * attn.qk_norm.scale.view(1, 1, -1, 1).to(qk.dtype)
        if pre is not None:
            qk = _rotate(qk.to(self.dtype), pre).to(qk.dtype)
        return qk, v

    def _linear_layer(self, i: int, attn, h: torch.Tensor, rope, pre, w: tuple) -> torch.Tensor:
        """Eq. 19 for one token, as ``rotary_linear_attention_step`` computes it."""
        qk, v = self._qk_v(attn, h, pre, w)
        cdt = self.dtype
        with torch.autocast(h.device.type, enabled=False):
            qk, v = qk.to(cdt), v.to(cdt)
            if self.favor is not None:  # stabilised FAVOR+ (linear_rope.features), q and k at once
                proj, shifts = self.favor[i]
                xs = qk * qk.shape[-1] ** -0.25
                if _traced(xs):
                    # out of place, q and k together (a row max and a norm for each, the queries'
                    # max and the keys' norm used): no in-place write on a slice keeps Inductor
                    # from fusing; compiled, the features and their rotation are a GEMM and a kernel
                    sq = xs.square().sum(-1, keepdim=True)  # |x'|^2
                    lin = torch.matmul(xs, proj) + shifts  # (B, 2, H, m): w.q' + c, w.k' - c
                    is_q = torch.arange(2, device=lin.device).view(1, 2, 1, 1) == 0
                    phi = torch.where(is_q, lin - lin.amax(-1, keepdim=True),  # queries: - their max
                                      lin.sub(sq, alpha=0.5).clamp(min=key_exponent_floor(cdt), max=0.0)).exp()
                else:  # eagerly, in place: fewer operations (the same values)
                    phi = torch.matmul(xs, proj).add_(shifts)  # (B, 2, H, m): w.q' + c, w.k' - c
                    phi[:, 1].sub_(xs[:, 1].square().sum(-1, keepdim=True), alpha=0.5)  # keys: - |k'|^2 / 2
                    phi[:, 0].sub_(phi[:, 0].amax(-1, keepdim=True))
                    phi[:, 1].clamp_(min=key_exponent_floor(cdt), max=0.0)
                    phi.exp_()
            elif attn.features.kind == "elu":
                phi = F.elu(qk).add_(1.0)
            else:
                phi = F.relu(qk)
            rphi = phi if rope is None else _rotate(phi, rope)
            num, den = self._update_and_read(self.Sz[i], rphi, phi, v)
            out = num / den.masked_fill(den <= 0, 1.0)  # as naive: <= 0 divides by 1, NaN stays
            if self.e > v.shape[-1]:
                out = out[..., :-1] / out[..., -1:].clamp_min(ROW_SUM_FLOOR)
        return attn.dropout(self._lin(attn.to_out, w[1], out.flatten(1).to(h.dtype)))

    def _update_and_read(self, Sz: torch.Tensor, rphi: torch.Tensor, phi: torch.Tensor, v: torch.Tensor):
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
        self.vz[:, :, :v.shape[-1], 0].copy_(v)
        Sz.view(B * H, E, m).baddbmm_(self.vz.view(B * H, E, 2),
                                      torch.stack((rphi[:, 1], phi[:, 1]), 2).view(B * H, 2, m))
        res = torch.matmul(Sz, torch.stack((rphi[:, 0], phi[:, 0]), -1))  # (B, H, e + 1, 2)
        return res[:, :, :-1, 0], res[:, :, -1:, 1]

    def _softmax_layer(self, i: int, attn, h: torch.Tensor, pre, w: tuple) -> torch.Tensor:
        qk, v = self._qk_v(attn, h, pre, w)
        k_cache, v_cache = self.k[i], self.v[i]
        k_cache.index_copy_(2, self.slot, qk[:, 1, :, None].to(k_cache.dtype))
        v_cache.index_copy_(2, self.slot, v[:, :, None].to(v_cache.dtype))
        if i == 0:
            self.key_mask.index_fill_(1, self.slot, True)
        out = F.scaled_dot_product_attention(qk[:, 0, :, None].to(k_cache.dtype), k_cache, v_cache,
                                             attn_mask=self.key_mask[:, None, None, :])
        return attn.dropout(self._lin(attn.to_out, w[1], out.flatten(1).to(h.dtype)))

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
