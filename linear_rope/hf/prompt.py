"""The prompt ``LinearRopeForCausalLM.generate`` starts from, checked before ``GenerationMixin``
sees it, as ``PerformerLM.generate`` checks its own (one read of the prompt's values, on any
device)."""
from __future__ import annotations

import torch

from .inputs import check_ids, check_mask, check_positions

__all__ = ["check_prompt"]


def check_prompt(hf, args: tuple, kwargs: dict) -> None:
    """``hf.generate(*args, **kwargs)``'s prompt (``hf`` a ``LinearRopeForCausalLM``): ids, mask
    and ``position_ids`` (checked, then popped from ``kwargs``), and for the ``absolute``
    variant the prompt plus the new tokens within its table (from the lengths)."""
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    _check_prompt(hf, ids, kwargs)
    if hf.model.pos_emb is not None:
        cfg = (args[1] if len(args) > 1 else kwargs.get("generation_config")) or hf.generation_config
        new = kwargs.get("max_new_tokens", cfg.max_new_tokens if "max_length" not in kwargs else None)
        total = (ids.shape[-1] + new) if new is not None else \
            kwargs.get("max_length", cfg.max_length)
        if total is not None and total > hf.config.seq_len + 1:
            raise ValueError(f"max_new_tokens: the absolute variant cannot go past seq_len={hf.config.seq_len} "
                             f"(the prompt and the new tokens come to {total} tokens, at most "
                             f"{hf.config.seq_len + 1} fit)")


def _check_prompt(hf, ids, kwargs: dict) -> None:
    if ids is None:
        raise ValueError("input_ids is required: the model has no start-of-text token to begin from")
    cfg = kwargs.get("generation_config") or hf.generation_config
    for key in ("output_attentions", "output_hidden_states"):
        if kwargs.get(key, getattr(cfg, key, False)):
            raise ValueError(f"{key}: not available (the model returns logits only); leave it out")
    device = hf.model.head.weight.device
    check_ids(ids, hf.config.vocab_size, device, always=True)
    B, N = ids.shape
    mask = kwargs.get("attention_mask")
    if mask is not None:
        mask = check_mask(mask, B, (N,), device, always=True)
        if not bool(mask[:, -1].all()):
            b = int((~mask[:, -1]).nonzero()[0])
            raise ValueError(f"attention_mask: row {b} ends in padding, and generate() continues every row from "
                             f"its last column: pad on the left (ByteTokenizer's default)")
    if kwargs.get("position_ids") is not None:  # checked, then dropped: the model counts positions itself
        want = torch.arange(N, device=device).expand(B, N) if mask is None else mask.long().cumsum(1) - 1
        check_positions(kwargs.pop("position_ids"), want, mask)
