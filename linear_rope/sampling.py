"""Sampling the next token from logits on the device, and the checks of its arguments."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["check_temperature", "check_top_k", "sample_next"]


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
