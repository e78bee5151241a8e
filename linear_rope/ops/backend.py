"""Which path a call of the op takes, and the record of it: the backend choice beside the door.

The backend comes from ``use_backend``'s block, else the ``LINEAR_ROPE_BACKEND`` environment
variable, else ``"auto"``:

* ``auto`` (the default): a causal call on CUDA tensors takes the fused path (``fused/``: Triton
  kernels with the FAVOR+ features made on chip) when it takes the call (``fused.supports_fused``:
  FAVOR+ inside, bf16 arithmetic, d and e up to 128, triton installed), else the chunk-parallel
  path (``parallel.py``: plain torch ops, a fixed number of kernels at any N, no host sync),
  recording why; on other devices the torch path's block walk (``chunk_op.py``, the fastest on a
  CPU). The fused path is never taken for CPU tensors. Each specialization of the fused kernels
  (dtype and arithmetic, d, m, e, RoPE, mask, initial state) first checks itself once against the
  chunk-parallel path (``fused/selfcheck.py``: at its first eager call, or ``check_backend``'s
  ``specs``); a failed build, launch or check sends its calls to the chunk-parallel path with one
  warning line; while tracing or capturing, a stored result decides (none: the chunk-parallel path).
* ``fused``: the fused path for CUDA tensors; a causal call it does not take, or whose
  specialization failed its self-check, is a ValueError with the reason (never a silent fallback).
* ``parallel``: the chunk-parallel path on any device (the CPU tests and counts it).
* ``torch``: the torch path on any device.
* ``fla``: fla-core's chunk kernels (``fla_path.py``: causal, CUDA, ``pip install
  'linear_rope[fla]'``); a call it does not take is a ValueError with the reason.

Whatever the backend, packed documents (``cu_seqlens``) take the torch path (``PACKED_REASON``),
``torch.func`` transforms and forward-mode AD the composite path, and ``causal=False`` the
closed form. ``record_paths`` collects the path each call takes, with the reason, as one string
("parallel path (auto: CUDA tensors)"): the trainer names it in its first lines and the GPU
benchmarks label their rows with it.

The Triton kernels that ``LINEAR_ROPE_BACKEND=triton`` once selected were removed (the chunk-parallel
path measured faster in training); ``TRITON_REMOVED`` says where they are kept.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from .fused.selfcheck import NOT_CHECKED, Spec, verdict

__all__ = ["BACKENDS", "ENV_VAR", "PACKED_REASON", "TRITON_REMOVED", "backend", "check_backend",
           "choose", "record", "record_paths", "takes_parallel", "use_backend"]

ENV_VAR = "LINEAR_ROPE_BACKEND"
BACKENDS = ("auto", "torch", "parallel", "fla", "fused")
TRITON_REMOVED = ("the Triton kernels (LINEAR_ROPE_BACKEND=triton) were removed from linear_rope: the "
                  "chunk-parallel path (auto on CUDA) replaced them; commit d4a32e6 is the last that has them "
                  "(docs/gpu.md)")
PACKED_REASON = ("cu_seqlens: the documents' lengths set the shapes of the chunk layout, and reading them is a host "
                 "sync, so packed documents take the torch path")

_OVERRIDE: list[str] = []  # use_backend's stack (innermost last)
_RECORDERS: list[list[str]] = []


def _checked(name: str, where: str) -> str:
    if name == "triton":
        raise ValueError(f"{where}=triton: {TRITON_REMOVED}")
    if name not in BACKENDS:
        raise ValueError(f"{where} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, calls take backend ``name`` as if ``LINEAR_ROPE_BACKEND`` said so (e.g. to
    time two paths through the public op)."""
    _OVERRIDE.append(_checked(name, "use_backend: name"))
    try:
        yield
    finally:
        _OVERRIDE.pop()


def backend() -> str:
    """``use_backend``'s, else ``LINEAR_ROPE_BACKEND``'s, else "auto"; a one-line ValueError for
    another name."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    return _checked(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def _source() -> str:
    return "forced" if _OVERRIDE else f"{ENV_VAR}={backend()}"


def takes_parallel(q: torch.Tensor, name: str | None = None) -> bool:
    """Whether the backend (``name``, else ``backend()``) sends a causal call on ``q`` to the
    chunk-parallel path or the fused one (the GPU's paths: no host sync): ``parallel`` anywhere,
    ``auto`` and ``fused`` for CUDA tensors."""
    name = backend() if name is None else name
    return name == "parallel" or (name in ("auto", "fused") and q.is_cuda)


def choose(q: torch.Tensor, *, causal: bool, packed: bool, transformed: bool, eager: bool,
           fused_refusal: str | None = "not asked") -> str:
    """The path of a call on ``q``: "fused", "parallel", "torch", "composite", "bidirectional",
    "documents" or "fla"; an eager causal call records it for ``record_paths``. ``packed``:
    ``cu_seqlens`` given; ``transformed``: under ``torch.func`` or forward-mode AD; ``eager``:
    neither compiling nor transformed; ``fused_refusal``: why the fused path does not take the
    call (``fused.fused_refusal``), None if it does. A forced ``fused`` backend returns "fused"
    for every causal call that is neither packed nor transformed: the op raises the refusal."""
    name = backend()
    if name == "fla" and eager:
        return "fla"  # recorded by the fla path, which refuses with the reason a call it does not take
    if not causal:
        return "documents" if packed else "bidirectional"
    if transformed:
        return "composite"
    unchecked = fused_refusal == NOT_CHECKED  # traced or captured before the kernels checked themselves
    if name == "fused" and not packed and not unchecked:
        if eager and fused_refusal is None:
            record(f"fused path ({_source()})")
        return "fused"
    par = takes_parallel(q, name) or unchecked
    if par and not packed and name == "auto" and fused_refusal is None:
        path, why = "fused", "auto: CUDA tensors"
    elif par and not packed:
        why = "auto: CUDA tensors" if name == "auto" else _source()
        if name in ("auto", "fused") and fused_refusal != "not asked":
            why += f"; not fused: {fused_refusal}"
        path = "parallel"
    elif par:
        path, why = "torch", PACKED_REASON
    else:
        path, why = "torch", f"auto: tensors on {q.device.type}" if name == "auto" else _source()
    if eager or unchecked:
        record(f"{path} path ({why})")
    return path


@contextlib.contextmanager
def record_paths():
    """Within the block, every causal op call appends the path it takes to the yielded list:
    "parallel path (<reason>)", "torch path (<reason>)" or "fla path (<reason>)"."""
    paths: list[str] = []
    _RECORDERS.append(paths)
    try:
        yield paths
    finally:
        _RECORDERS.remove(paths)


def record(path: str) -> None:
    """Note the path a call took, for ``record_paths`` (a no-op outside it)."""
    for paths in _RECORDERS:
        paths.append(path)


# the backends that run on CUDA only: (what they run, the module they need, the line without it)
_GPU_ONLY = {"fused": ("the fused Triton kernels", "triton", "triton is not installed"),
             "fla": ("fla-core's kernels", "fla", "fla-core is not installed (pip install 'linear_rope[fla]')")}


def check_backend(device: torch.device | str | None = None, specs=()) -> str:
    """The backend ``LINEAR_ROPE_BACKEND`` names, checked once at a program's start for work on
    ``device`` (None: CUDA if available, else the CPU): a one-line ValueError for a value that run
    could not use (an unknown name; ``triton``, removed; ``fla`` without a CUDA device or fla-core;
    ``fused`` without a CUDA device or triton).
    Every other backend runs on any device.

    ``specs``: the fused kernels' specializations the program will call (``fused.selfcheck.Spec``),
    each checked now against the chunk-parallel path (once per device: the first eager call of a
    specialization checks it otherwise; a compiled graph or CUDA graph traced before then takes
    the chunk-parallel path), on CUDA under ``auto`` (its bf16 arithmetic) and ``fused``. A
    failure: one warning line under ``auto`` (those calls take the chunk-parallel path), a
    one-line ValueError under ``fused``."""
    try:
        name = backend()
    except ValueError:
        if os.environ.get(ENV_VAR, "").strip().lower() == "triton":
            raise  # TRITON_REMOVED's line
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r} is not a backend: use one of "
                         f"{', '.join(BACKENDS)}, or unset it") from None
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if name in _GPU_ONLY:
        what, module, missing = _GPU_ONLY[name]
        if dev.type != "cuda":
            raise ValueError(f"{ENV_VAR}={name}: {what} need a CUDA device and this run is on {dev.type}; "
                             f"unset {ENV_VAR} or set it to auto or torch")
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{ENV_VAR}={name}: {missing}")
    if name in ("auto", "fused") and dev.type == "cuda" and importlib.util.find_spec("triton") is not None:
        for spec in specs:
            if name == "auto" and not Spec(*spec).lowp:
                continue  # auto takes the fused path for bf16 arithmetic only
            why = verdict(Spec(*spec), dev, forced=name == "fused")
            if why is not None and name == "fused":
                raise ValueError(f"{ENV_VAR}=fused: {why}")
    return name
