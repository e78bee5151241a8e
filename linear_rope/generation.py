"""``PerformerLM.generate``: prompts of bytes in, new bytes out, on a ``Decoder``.

The prompts are checked on the host (their bytes against the vocabulary: no device read),
left-padded into one batch and read once in parallel under a mask; each row then decodes at its
own positions, one in-place ``Decoder`` step per token, and the new tokens are read from the
device once, after the last step.
"""
from __future__ import annotations

import torch

from .decode import Decoder
from .sampling import check_temperature, check_top_k

__all__ = ["generate"]


def generate(model, prompt, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, compile: bool | None = None):
    """``model.generate`` (``model`` a ``PerformerLM``): the new bytes after ``prompt`` (bytes, or
    a list of them: then a list)."""
    prompts = [prompt] if isinstance(prompt, (bytes, bytearray)) else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(
            isinstance(p, (bytes, bytearray)) and len(p) > 0 for p in prompts):
        raise ValueError("prompt must be non-empty bytes, or a non-empty list of non-empty bytes")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    check_top_k(top_k)
    check_temperature(temperature)
    device = model.head.weight.device
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None (seed one with "
                        f"torch.Generator().manual_seed(seed)), got {type(generator).__name__}")
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator: it is on {generator.device}, the model on {device}; "
                         f"create it with torch.Generator(device={str(device)!r})")
    V = model.cfg.vocab_size
    top = max(max(p) for p in prompts)
    if top >= V:  # bytes are read on the host: no device sync
        raise ValueError(f"prompt: byte {top} is outside the vocabulary [0, vocab_size={V})")
    longest = max(len(p) for p in prompts)
    if model.pos_emb is not None and longest + max_new_tokens > model.cfg.seq_len + 1:
        raise ValueError(f"max_new_tokens: the absolute variant cannot go past seq_len={model.cfg.seq_len}")
    was_training = model.training
    model.eval()
    try:
        out = _decode(model, prompts, longest, max_new_tokens, temperature, top_k, generator, compile)
    finally:  # an error on the way (a bad id, an interrupt) leaves the mode as it was
        model.train(was_training)
    res = [bytes(row) for row in out.tolist()]  # the one read of the device: after the last step
    return res[0] if isinstance(prompt, (bytes, bytearray)) else res


def _decode(model, prompts, longest: int, max_new_tokens: int, temperature, top_k, generator,
            compile=None) -> torch.Tensor:
    """``generate``'s loop on a ``Decoder``: one parallel read of the left-padded prompts, then
    one in-place step per token; the new ids `[B, max_new_tokens]`, read by the caller once."""
    device = model.head.weight.device
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for b, p in enumerate(prompts):  # left padding: every row's last token is at the end
        ids[b, longest - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[b, longest - len(p):] = True
    ragged = any(len(p) != longest for p in prompts)
    max_len = longest + max_new_tokens
    if compile if compile is not None else device.type == "cuda":  # one compiled graph per power of two
        max_len = 1 << max(8, (max_len - 1).bit_length())
    dec = Decoder(model, len(prompts), max_len, compile=compile)
    return dec.generate(ids.to(device), max_new_tokens, mask=mask.to(device) if ragged else None,
                        temperature=temperature, top_k=top_k, generator=generator)
