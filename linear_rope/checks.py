"""Argument checks that hold the same way in eager, under ``torch.compile`` and under the
``torch.func`` transforms (``vmap``, ``grad``, ``jvp``, ``jacrev``, ``jacfwd``) and forward-mode AD.

A check that reads tensor values (features >= 0, a finite state, positions in range) cannot
print a value inside a compiled graph, and cannot read a value through ``vmap``'s batched
tensors (``.item()`` is refused there). ``require`` runs it where it can: eagerly on the plain
values (every vmapped entry at once), or as ``torch._assert_async`` in a compiled graph (the
same message, a RuntimeError when the graph runs: skipping it would let compiled code return
what eager refuses).
"""
from __future__ import annotations

import math

import torch

__all__ = ["values", "in_transform", "is_transformed", "is_compiling", "is_static", "require", "check_flag",
           "check_base"]


def is_compiling() -> bool:
    return torch.compiler.is_compiling()


def in_transform() -> bool:
    """Inside a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ``jacrev``, ``jacfwd``, ...)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def is_static() -> bool:
    """No Python branch on tensor values here: a compiled graph, or a transform (``vmap`` cannot
    read a value into Python)."""
    return is_compiling() or in_transform()


def values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values without autograd and without ``torch.func``'s wrappers: what a check reads.
    Under ``vmap`` these are every batch entry at once."""
    t = t.detach()
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def is_transformed(*ts) -> bool:
    """True inside a ``torch.func`` transform, or where a tensor of ``ts`` (None entries
    skipped) carries a forward-mode tangent (``torch.autograd.forward_ad``)."""
    if is_compiling():
        return False
    if in_transform():
        return True
    import torch.autograd.forward_ad as fwAD

    if getattr(fwAD, "_current_level", 0) < 0:  # no dual level open (torch 2.x keeps it here; else look)
        return False
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in ts)


def require(ok: torch.Tensor, msg: str) -> None:
    """ValueError(msg) unless every entry of the bool tensor ``ok`` is True (see the module
    docstring for compiled graphs and transforms)."""
    if is_compiling():
        torch._assert_async(ok.all(), msg)
        return
    if not bool(values(ok).all()):
        raise ValueError(msg)


def check_flag(name: str, val) -> bool:
    """A keyword that is True or False, and nothing that merely converts to one (1, "no", None)."""
    if not isinstance(val, bool):
        raise ValueError(f"{name} must be True or False, got {val!r}")
    return val


def check_base(base, name: str = "base") -> float:
    """The RoPE base: a finite number > 0 (NaN or inf would turn every angle into NaN)."""
    ok = isinstance(base, (int, float)) and not isinstance(base, bool)
    if not ok or not math.isfinite(base) or base <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {base!r}")
    return float(base)
