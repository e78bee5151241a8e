"""Buffers the causal op reuses between calls, on the CPU.

glibc serves every allocation over 32 MiB with a fresh ``mmap`` that the kernel zeroes page by
page on first touch. The features, intra-chunk products and chunk states the forward keeps for
the backward (``chunk_fwd.keep_plan``) are that large from N of a few thousand, so each call paid
a page-faulting pass over each of them (about 11% of a fwd+bwd at N = 4096, B·H = 12, m = 266;
docs/performance.md). Here they come from a pool instead: a buffer is handed out again only when
nothing but the pool references its storage (the views given out, and the autograd graph that
saved them, are gone), so a buffer still needed by a pending backward is never reused.

The pool holds at most ``LIMIT_BYTES``: a size that does not fit evicts idle buffers of other
sizes (the oldest first), and where the buffers in use leave no room it is a plain allocation;
``clear()`` releases the pool.
CUDA has its own caching allocator, so only CPU tensors are pooled. A buffer is keyed on its
element count, dtype and whether it was made under ``torch.inference_mode`` (an inference tensor
cannot be written or saved for backward outside that mode); its contents are never read before
they are written, so nothing else decides what a call computes.
"""
from __future__ import annotations

import math
import threading

import torch

__all__ = ["LIMIT_BYTES", "empty", "clear", "held_bytes"]

LIMIT_BYTES = 512 << 20

_lock = threading.Lock()
_pool: dict[tuple, list[tuple[torch.Tensor, int]]] = {}  # (numel, dtype, inference) -> [(buffer, its idle use count)]


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def held_bytes() -> int:
    """Bytes the pool holds (free or in use)."""
    with _lock:
        return sum(_nbytes(b) for bufs in _pool.values() for b, _ in bufs)


def clear() -> None:
    """Drop the pool's references: buffers still in use live on with their users, the rest are freed."""
    with _lock:
        _pool.clear()


def empty(shape, like: torch.Tensor) -> torch.Tensor:
    """``like.new_empty(shape)``, from a pooled buffer nobody else holds where there is one."""
    if like.device.type != "cpu":
        return like.new_empty(shape)
    n = math.prod(shape)
    # A buffer made under ``torch.inference_mode`` is an inference tensor: written in place or
    # saved for backward outside that mode it raises, so each mode has buffers of its own.
    key = (n, like.dtype, torch.is_inference_mode_enabled())
    with _lock:
        bufs = _pool.setdefault(key, [])
        for b, idle in bufs:
            if _use_count(b) == idle:
                return b.view(shape)
        size = n * like.element_size()
        if not _make_room(size):
            return like.new_empty(shape)
        b = like.new_empty(n)
        bufs.append((b, _use_count(b)))
        return b.view(shape)


def _nbytes(b: torch.Tensor) -> int:
    return b.numel() * b.element_size()


def _make_room(size: int) -> bool:
    """Under the lock: drop idle buffers of other sizes (the oldest sizes first) until ``size``
    more bytes fit under ``LIMIT_BYTES``; False when the buffers in use leave no room."""
    held = sum(_nbytes(b) for v in _pool.values() for b, _ in v)
    for key in list(_pool):
        if held + size <= LIMIT_BYTES:
            break
        keep = []
        for b, idle in _pool[key]:
            if held + size > LIMIT_BYTES and _use_count(b) == idle:
                held -= _nbytes(b)
            else:
                keep.append((b, idle))
        if keep:
            _pool[key] = keep
        else:
            del _pool[key]
    return held + size <= LIMIT_BYTES
