"""The checks ``LinearRopeForCausalLM.forward`` and ``generate`` run on their inputs, as the
native API runs them (``PerformerLM.forward`` / ``generate``): one-line ValueErrors naming the
argument, never a traceback deep in torch or NaN logits without a word.

Shapes, dtypes and devices are always checked. Values (ids in the vocabulary, a mask of 0 and
1, labels, a cache's positions) are read where that costs no device sync, as the native API
reads them: tensors on the CPU, eager (not under ``torch.compile`` or a ``torch.func``
transform), unless ``LINEAR_ROPE_BACKEND=parallel`` stands for the GPU's path there; on a GPU
(and under that backend) with ``LINEAR_ROPE_CHECKS=1``, and once per ``generate()`` call for
the prompt (``generate`` reads a value every token anyway). Unread, an id outside the
vocabulary gives NaN logits, as ``PerformerLM``'s does. Position arguments a caller chooses to pass (``position_ids``,
``cache_position``) are always read: each must equal what the model uses, or it is refused.
"""
from __future__ import annotations

import torch

from ..checks import ID_DTYPES, is_static, value_checks, values
from ..softmax_attention import KVCache

__all__ = ["reads_values", "check_ids", "check_mask", "check_labels", "check_positions", "check_cache_position",
           "check_cache", "check_extra_kwargs"]

MASK_DTYPES = (torch.bool, torch.long, torch.int32, torch.int16, torch.int8, torch.uint8,
               torch.float32, torch.float64, torch.float16, torch.bfloat16)
# ``forward(**kwargs)``: what transformers may pass besides the named arguments, and what each may be.
FORWARD_EXTRAS = {"num_items_in_batch", "position_ids", "cache_position", "output_attentions",
                  "output_hidden_states", "logits_to_keep", "token_type_ids"}


def reads_values(t: torch.Tensor, always: bool = False) -> bool:
    """Whether a check reads ``t``'s values here: the native rule (``checks.value_checks``), or
    with ``always`` wherever eager and not on the meta device."""
    if is_static() or t.device.type == "meta":
        return False
    return always or value_checks(t)


def _shown(vals: torch.Tensor) -> str:
    vals = sorted(set(vals.tolist()))
    return ", ".join(map(str, vals[:8])) + (", ..." if len(vals) > 8 else "")


def _device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the model on {device}: move it with .to(model.device)")


def check_ids(ids, vocab: int, device: torch.device, name: str = "input_ids", always: bool = False) -> None:
    """Integer ids `[B, N]` (N >= 1) on the model's device, each in [0, vocab)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in ID_DTYPES or ids.dim() != 2 or ids.shape[1] == 0:
        got = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be an integer tensor [B, N] with N >= 1 (int64, int32 or uint8), got {got}")
    _device(ids, name, device)
    if ids.numel() and reads_values(ids, always):
        v = values(ids).long()  # uint8 would wrap
        out = (v < 0) | (v >= vocab)
        if bool(out.any()):
            raise ValueError(f"{name}: {int(out.sum())} id(s) outside [0, vocab_size={vocab}): {_shown(v[out])}")


def check_mask(mask, B: int, widths: tuple[int, ...], device: torch.device, always: bool = False) -> torch.Tensor:
    """``attention_mask`` `[B, W]` (W one of ``widths``) of 0 and 1 (bool, integer or float) ->
    its bool mask. Every shape but these is refused, as is any value but 0 and 1 (2, 0.5, -1, NaN
    would be read as real tokens)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype not in MASK_DTYPES:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask must be a tensor of 0 and 1 (bool, integer or float; 1 = real token), got {got}")
    if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] not in widths:
        want = " or ".join(str(w) for w in sorted(set(widths)))
        raise ValueError(f"attention_mask must be [B={B}, {want}] (1 = real token), got {list(mask.shape)}")
    _device(mask, "attention_mask", device)
    if mask.dtype != torch.bool and mask.numel() and reads_values(mask, always):
        v = values(mask)
        bad = (v != 0) & (v != 1)
        if bool(bad.any()):
            raise ValueError(f"attention_mask must hold only 0 and 1 (1 = real token), got {_shown(v[bad].double())}")
    return mask.bool() if mask.dtype != torch.bool else mask


def check_labels(labels, shape: tuple[int, int], vocab: int) -> None:
    """``labels`` of ``input_ids``' shape, integer, each in [0, vocab) or -100 (ignored)."""
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.long, torch.int32, torch.uint8):
        got = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be an integer tensor of input_ids' shape {list(shape)}, got {got}")
    if tuple(labels.shape) != shape:
        raise ValueError(f"labels must have input_ids' shape {list(shape)}, got {list(labels.shape)}")
    if labels.numel() and reads_values(labels):
        v = values(labels).long()
        out = ((v < 0) | (v >= vocab)) & (v != -100)
        if bool(out.any()):
            raise ValueError(f"labels: {int(out.sum())} label(s) outside [0, vocab_size={vocab}) and not -100 "
                             f"(ignored): {_shown(v[out])}")


def check_positions(position_ids, want: torch.Tensor, real: torch.Tensor | None) -> None:
    """``position_ids`` `[B, N]` (or `[1, N]`) must equal ``want`` `[B, N]`, the positions the model
    gives each real token (padding, where ``real`` is False, is not read): exact, or refused."""
    B, N = want.shape
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.long, torch.int32) \
            or position_ids.dim() != 2 or position_ids.shape[1] != N or position_ids.shape[0] not in (1, B):
        got = f"{position_ids.dtype} {list(position_ids.shape)}" if isinstance(position_ids, torch.Tensor) \
            else type(position_ids).__name__
        raise ValueError(f"position_ids must be an integer tensor [B={B}, N={N}] (or [1, N]), got {got}")
    if is_static() or position_ids.device.type == "meta":
        raise ValueError("position_ids: their values cannot be checked here (compiled or transformed); leave them out")
    p = values(position_ids).to(want.device).long().expand(B, N)
    ok = (p == want) if real is None else ((p == want) | ~real)
    if not bool(ok.all()):
        b, t = (int(i) for i in (~ok).nonzero()[0])
        raise ValueError(f"position_ids: row {b}, column {t} is {int(p[b, t])}, but the model reads that token at "
                         f"position {int(want[b, t])} (each row's real tokens count 0, 1, 2, ... from its first; "
                         f"padding under attention_mask is skipped): leave position_ids out")


def check_cache_position(cache_position, start: int, N: int) -> None:
    """``cache_position`` `[N]` must be the columns ``start .. start + N - 1`` read next."""
    want = torch.arange(start, start + N)
    if not isinstance(cache_position, torch.Tensor) or cache_position.dtype not in (torch.long, torch.int32) \
            or tuple(cache_position.shape) != (N,):
        got = f"{cache_position.dtype} {list(cache_position.shape)}" if isinstance(cache_position, torch.Tensor) \
            else type(cache_position).__name__
        raise ValueError(f"cache_position must be an integer tensor [N={N}], got {got}")
    if is_static() or cache_position.device.type == "meta":
        raise ValueError("cache_position: its values cannot be checked here (compiled or transformed); leave it out")
    if not torch.equal(values(cache_position).cpu().long(), want):
        raise ValueError(f"cache_position must be the columns read next, {start}..{start + N - 1}, got "
                         f"{values(cache_position).tolist()[:8]}: leave it out")


def check_cache(cache, depth: int, softmax: bool, B: int, device: torch.device) -> None:
    """A ``RecurrentCache`` of this model and batch: one state per layer of the variant's kind,
    ``positions`` an integer tensor `[B]` on the model's device, each in [0, ``seen``]."""
    states, pos, seen = getattr(cache, "states", None), getattr(cache, "positions", None), getattr(cache, "seen", None)
    if not isinstance(states, list) or len(states) != depth:
        got = f"{len(states)} layers" if isinstance(states, list) else type(states).__name__
        raise ValueError(f"past_key_values: a cache of {got} does not fit this model ({depth} layers)")
    kind = KVCache if softmax else tuple
    for i, st in enumerate(states):
        if not isinstance(st, kind) or (not softmax and isinstance(st, KVCache)) or \
                not all(isinstance(t, torch.Tensor) for t in st):
            raise ValueError(f"past_key_values: layer {i} holds a {type(st).__name__}, not this variant's state "
                             f"({'a KVCache' if softmax else 'a LinearAttentionState (S, z)'}): a cache of another model")
        for t in st:
            _device(t, f"past_key_values (layer {i})", device)
    if isinstance(seen, bool) or not isinstance(seen, int) or seen < 0:
        raise ValueError(f"past_key_values: seen must be a non-negative int (the columns read), got {seen!r}")
    if not isinstance(pos, torch.Tensor) or pos.dtype not in (torch.long, torch.int32) or tuple(pos.shape) != (B,):
        got = f"{pos.dtype} {list(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise ValueError(f"past_key_values: its positions must be an integer tensor [B={B}] (a cache of this "
                         f"batch), got {got}")
    _device(pos, "past_key_values (positions)", device)
    if pos.numel() and reads_values(pos):
        v = values(pos)
        if bool((v < 0).any()) or bool((v > seen).any()):
            raise ValueError(f"past_key_values: positions {_shown(v)} must lie in [0, seen={seen}] (a row counts "
                             f"the real tokens among the columns read)")


def check_extra_kwargs(kwargs: dict) -> None:
    """What ``forward(**kwargs)`` takes besides its named arguments: refused where it would be
    ignored (a typo, attentions or hidden states asked for, a partial logits request)."""
    unknown = sorted(k for k, v in kwargs.items() if k not in FORWARD_EXTRAS and v is not None)
    if unknown:
        raise ValueError(f"unexpected argument(s) {unknown}: forward takes input_ids, attention_mask, labels, "
                         f"past_key_values (cache), use_cache, return_dict, position_ids, cache_position")
    for key, why in (("output_attentions", "linear attention never forms attention weights"),
                     ("output_hidden_states", "only the logits are returned")):
        if kwargs.get(key):
            raise ValueError(f"{key}: not available ({why}); leave it out")
    if kwargs.get("token_type_ids") is not None:
        raise ValueError("token_type_ids: a byte-level causal LM has one segment; leave them out")
    keep = kwargs.get("logits_to_keep")
    if keep is not None and (isinstance(keep, torch.Tensor) or keep != 0):
        raise ValueError(f"logits_to_keep: every position's logits are returned (0), got {keep!r}")
