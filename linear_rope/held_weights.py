"""The weights a ``Decoder``'s step reads, held cast to the autocast dtype.

Under autocast (a float32 model, bfloat16 autocast, say) every linear layer would cast its weight
at every token. ``HeldWeights`` casts the step's matrices (the attention projections, the
feed-forward and the head) once, and again only when a weight changes: at every step the
modules' current tensors are read (a Parameter replaced, by ``load_state_dict(assign=True)`` or
``module.weight = ...``, is seen) and each one's identity, storage, offset, strides and version
counter compared on the host (no device read). A snapshot: writes no version counter sees
(``.data``, NumPy or DLPack views) need ``refresh()``. The step then runs
with autocast off, as plain GEMMs in the autocast dtype (``linear``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["HeldWeights", "autocast_dtype", "linear"]


def autocast_dtype(device: torch.device) -> torch.dtype | None:
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


def linear(mod, w, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)``, or on the held weights ``w`` (weight, bias) with x cast to their dtype."""
    return mod(x) if w is None else F.linear(x.to(w[0].dtype), w[0], w[1])


class HeldWeights:
    """``model``'s (a ``PerformerLM``) step matrices cast to the autocast dtype, or none.

    ``w``: None (the step reads the model's own weights), or per layer (to_qkv, to_out, ff in,
    ff out), then ``(head,)``, each a held (weight, bias) or None (that module runs as it is).
    """

    def __init__(self, model):
        self.model = model
        self.w = None  # the step's matrices cast to the autocast dtype (``sync``), or None: the model's
        self._cast = None  # what they were cast from: {"dtype", "src", "dst", "sig"}

    def _sources(self, cdt: torch.dtype) -> list:
        """Per layer (to_qkv, to_out, ff in, ff out) Linear modules, then the head. ``to_out``
        stays in float32 under float16 for RoPE's outputs (as ``RotaryLinearAttention``'s ``wide``)."""
        wide = cdt == torch.float16 and self.model.cfg.position in ("rope", "rope_norm")
        layers = [(b.attn.to_qkv, None if wide else b.attn.to_out, b.ff[0], b.ff[2]) for b in self.model.blocks]
        return layers + [(self.model.head,)]

    def sync(self, device: torch.device, static: bool) -> bool:
        """Hold the step's matrices in the autocast dtype where autocast would cast them at every
        token (a float32 model under bfloat16 autocast, say); recast them where a weight changed
        since (another tensor, storage, offset, strides or version: host reads, no device sync). True: the step is
        to run on them with autocast off. ``static``: mark new copies as static addresses (for
        a compiled step)."""
        ac = autocast_dtype(device)
        wdt = self.model.head.weight.dtype
        cdt = ac if ac is not None and wdt != ac and wdt != torch.float64 else None  # autocast leaves float64 alone
        if cdt is None:
            self.w = None
            return False
        groups = self._sources(cdt)  # the modules' current tensors, read at every step (host reads)
        src = [t for g in groups for mod in g if mod is not None for t in (mod.weight, mod.bias) if t is not None]
        layout = [(t.shape, t.dtype, t.device) for t in src] + [cdt]
        c = self._cast
        if c is None or c["layout"] != layout:
            dst = [torch.empty_like(t, dtype=cdt, memory_format=torch.contiguous_format) for t in src]
            if static:
                for t in dst:
                    torch._dynamo.mark_static_address(t)
            held = iter(dst)
            w = tuple(tuple(None if mod is None else (next(held), None if mod.bias is None else next(held))
                            for mod in g) for g in groups)
            c = self._cast = dict(layout=layout, dst=dst, w=w, sig=None)
        self.w = c["w"]  # (again after a step without autocast, which set it to None)
        # what decides the copies: which tensor each is (a replaced Parameter, assign=True) and its
        # storage, offset, strides and version (an in-place write)
        sig = [(id(t), t.untyped_storage().data_ptr(), t.storage_offset(), t.stride(), t._version) for t in src]
        if sig != c["sig"]:
            with torch.no_grad():
                for d, t in zip(c["dst"], src):
                    d.copy_(t)
            c["sig"], c["src"] = sig, src  # src kept: no other tensor takes a seen id while it is compared
        return True

    def refresh(self) -> None:
        """Recast at the next ``sync`` from the modules' current tensors, whatever their version
        counters say: needed only after a write that no version counter sees (through ``.data``,
        or a NumPy or DLPack view of a weight's memory)."""
        if self._cast is not None:
            self._cast["sig"] = None
