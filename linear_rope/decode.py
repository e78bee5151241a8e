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

Here the state (its buffers, ``prefill``, ``load``) and the public ``step`` and ``generate``; the
step's work and its compiled form in ``decode_step.py``, the weights held under autocast in
``held_weights.py``, ``sample_next`` in ``sampling.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from . import decode_step
from .checks import ID_DTYPES
from .decode_step import compiled_step, fill_tables, forward_step
from .held_weights import HeldWeights
from .ops import LinearAttentionState
from .rotary import MAX_POSITION, check_offset, table_dtype
from .sampling import check_temperature, check_top_k, sample_next  # noqa: F401 (re-exported)
from .softmax_attention import KVCache

__all__ = ["Decoder", "check_temperature", "sample_next"]


def check_ids(ids: torch.Tensor, name: str, dims: int, B: int, device: torch.device) -> None:
    """ValueError unless ``ids`` is an integer tensor `[B, N >= 1]` (``dims`` 2) or `[B]` on ``device``."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != dims or ids.dtype not in ID_DTYPES \
            or ids.shape[0] != B or (dims == 2 and ids.shape[1] == 0):
        want = f"[B={B}, N >= 1]" if dims == 2 else f"[B={B}]"
        raise ValueError(f"{name} must be an integer tensor {want}, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {list(getattr(ids, 'shape', []))}")
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device}, the model on {device}")


def copy_states(dec, states: list, key_columns: int | None) -> int:
    """``states`` (checked: one per layer, of ``dec``'s kind and shape) into ``dec``'s buffers;
    the ``softmax`` anchor's key/value slots filled (``key_columns``, default all of the cache
    given), 0 for the linear state."""
    if dec.softmax:
        n = states[0].k.shape[2] if key_columns is None else key_columns
        if n > dec.max_len:
            raise ValueError(f"states: {n} cached keys do not fit max_len={dec.max_len}")
        for i, st in enumerate(states):
            if not isinstance(st, KVCache) or st.k.shape != (dec.B, dec.cfg.heads, n, dec.cfg.dim_head):
                raise ValueError(f"states[{i}]: a KVCache of k, v [B={dec.B}, H, {n}, d] is needed")
            dec.k[i][:, :, :n].copy_(st.k), dec.v[i][:, :, :n].copy_(st.v)
            dec.k[i][:, :, n:].zero_(), dec.v[i][:, :, n:].zero_()
        dec.key_mask.zero_()[:, :n].copy_(states[0].key_mask)
        dec.slot.fill_(n)
        return n
    else:
        want = (dec.B, dec.cfg.heads, dec.m, dec.e)
        for i, st in enumerate(states):
            if not isinstance(st, tuple) or len(st) != 2 or st[0].shape != want or st[1].shape != want[:3]:
                raise ValueError(f"states[{i}]: a LinearAttentionState S {list(want)}, z {list(want[:3])} "
                                 "is needed")
            dec.Sz[i][:, :, :-1].copy_(st[0].transpose(-1, -2)), dec.Sz[i][:, :, -1].copy_(st[1])
    return 0


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
        if not cfg.causal:
            raise ValueError("a bidirectional model (causal=False) cannot decode token by token: each of its "
                             "outputs reads the tokens after it")
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
        self._held = HeldWeights(model)  # the step's matrices under autocast, cast once (``_sync_weights``)
        self._w = None  # what the step reads of them (``HeldWeights.w``), or None: the model's weights
        self._compiled = None
        if compile if compile is not None else self.device.type == "cuda":
            for t in self.buffers:
                torch._dynamo.mark_static_address(t)
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._key = (batch_size, max_len, str(self.device), p.dtype, dataclasses.astuple(cfg), mode)
            self._compiled = compiled_step(self._key, mode)

    # -- filling the state ---------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Read prompts `[B, N]` in one parallel forward (``mask`` `[B, N]` bool, True = real
        token, padding left or right) and return each row's logits after its last real token
        `[B, vocab]`. The state then holds the prompts; positions count real tokens."""
        check_ids(ids, "ids", 2, self.B, self.device)
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
        self._filled = copy_states(self, states, key_columns)
        used = key_columns if key_columns is not None else (self._filled if self.softmax else 0)
        self._left = self.max_len - max(used, hi - lo)  # the cache's slots, and the RoPE rows
        if self.model.pos_emb is not None:  # and the absolute table: positions below seq_len
            self._left = max(0, min(self._left, self.cfg.seq_len - hi))
        fill_tables(self, lo)
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
        check_ids(token, "token", 1, self.B, self.device)
        if self._steps >= self._left:
            table = f" or the absolute table's seq_len={self.cfg.seq_len}" if self.model.pos_emb is not None else ""
            raise ValueError(f"step: max_len={self.max_len}{table} reached ({self._steps} steps after the prompt); "
                             "build the Decoder with a larger max_len")
        self._steps += 1
        cast = self._sync_weights()
        with torch.autocast(self.device.type, enabled=False) if cast else contextlib.nullcontext():
            if self._compiled is not None:
                logits = decode_step.run_compiled(self, token)
                if logits is not None:
                    return logits
            return self._forward_step(token)

    # -- the weights the step reads, the step's work -------------------------------------------

    def _sync_weights(self) -> bool:
        """``HeldWeights.sync``: True where the step is to run on the held weights (``_w``), autocast off."""
        cast = self._held.sync(self.device, self._compiled is not None)
        self._w = self._held.w
        return cast

    def refresh(self) -> None:
        """Recast the held weights at the next step from the model's current tensors. Needed only
        after writing the model's weights in a way no version counter sees (through ``.data``, or
        a NumPy or DLPack view); in-place updates (an optimizer step, ``load_state_dict``) and
        replaced tensors (``load_state_dict(assign=True)``, ``module.weight = ...``) are seen at
        every step. The FAVOR+ projections and RoPE tables are copied at ``prefill`` / ``load``."""
        self._held.refresh()

    def _forward_step(self, token: torch.Tensor) -> torch.Tensor:
        """The step's work (``decode_step.forward_step``), uncompiled."""
        return forward_step(self, token)

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
