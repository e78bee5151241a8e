"""Argument checks that hold the same way in eager, under ``torch.compile`` and under the
``torch.func`` transforms (``vmap``, ``grad``, ``jvp``, ``jacrev``, ``jacfwd``) and forward-mode AD.

A check that reads tensor values (features >= 0, a finite state, positions in range) cannot
print a value inside a compiled graph, and cannot read a value through ``vmap``'s batched
tensors (``.item()`` is refused there). ``require`` runs it where it can: eagerly on the plain
values (every vmapped entry at once), or as ``torch._assert_async`` in a compiled graph (the
same message, a RuntimeError when the graph runs: skipping it would let compiled code return
what eager refuses).

Checks that read a tensor's values cost a host sync on a GPU (the CPU waits for it), so on CUDA
the model's forward and a training step run none by default: values are checked where data
enters (the command line, the loader, a module's construction, a FAVOR+ draw), and a bad value
in the forward gives NaN (an id outside the vocabulary, a position past ``MAX_POSITION``). On
CPU tensors a read costs no sync, so there they run by default (``value_checks``), each a
one-line ValueError; ``LINEAR_ROPE_BACKEND=parallel`` on a CPU stands for the GPU's path (what
the launch and sync counts measure) and keeps the GPU's rule. ``LINEAR_ROPE_CHECKS=1`` in the
environment (``debug_checks``) turns the eager value checks on everywhere.
"""
from __future__ import annotations

import math
import os

import torch

ID_DTYPES = (torch.long, torch.int32, torch.uint8)  # token ids (a bool tensor is not one)

__all__ = ["ID_DTYPES", "debug_checks", "value_checks", "check_input", "CHECKS_ENV", "values", "in_transform",
           "is_transformed", "is_compiling", "is_static", "require", "check_flag", "check_base"]


CHECKS_ENV = "LINEAR_ROPE_CHECKS"


def debug_checks() -> bool:
    """``LINEAR_ROPE_CHECKS=1``: run the value checks that need a host sync (ids in range,
    positions in range, ...) eagerly in the forward, each a one-line ValueError. Read at every
    call, so a test or a debugging session can switch it on and off. Off by default, and never
    inside a compiled graph (a graph cannot raise a ValueError)."""
    return os.environ.get(CHECKS_ENV, "") not in ("", "0") and not is_compiling()


def value_checks(t: torch.Tensor | None = None) -> bool:
    """Whether the eager checks that read tensor values run for a call on ``t``: with
    ``LINEAR_ROPE_CHECKS=1`` everywhere; otherwise for CPU tensors (a read costs no device
    sync there) unless ``LINEAR_ROPE_BACKEND=parallel`` stands for the GPU's path. Never inside
    a compiled graph."""
    if is_compiling():
        return False
    if debug_checks():
        return True
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    from .ops.backend import backend

    return backend() != "parallel"


def check_input(x, name: str, dims: str, like: torch.Tensor) -> None:
    """A layer's input ``x``: a floating-point tensor of the shape ``dims`` names (`"[B, N, dim]"`
    or `"[B, dim]"`: its rank), whose last dim is ``like``'s (the input projection's weight
    `[out, dim]`), on ``like``'s device, and in its dtype unless an autocast on that device
    casts both (float64 it never casts). ValueError naming ``name`` otherwise (torch's own error
    names a matmul)."""
    rank, dim = dims.count(",") + 1, like.shape[-1]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != rank:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point tensor {dims} with dim={dim}, got {got}")
    if x.shape[-1] != dim:
        raise ValueError(f"{name}: the last dim is {x.shape[-1]}, the layer's dim is {dim}")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device}, the layer on {like.device}")
    if x.dtype != like.dtype and not (_autocast(x.device.type) and torch.float64 not in (x.dtype, like.dtype)):
        raise ValueError(f"{name} is {x.dtype}, the layer's weights {like.dtype}: cast one to the other")


def _autocast(device_type: str) -> bool:
    """An autocast is on for the device (it casts float16, bfloat16 and float32, never float64)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


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
