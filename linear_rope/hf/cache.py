"""``RecurrentCache``: what ``LinearRopeForCausalLM`` carries from one forward to the next, and
the reading of tokens into it.

A prompt is read in one parallel forward (``read_prompt``); the tokens after it one step at a
time (``read_tokens``): on a ``Decoder`` held by the cache, its state updated in place, where no
token is padding, else one ``PerformerLM.step`` per token, a padded token leaving its row's
state as it was.
"""
from __future__ import annotations

import torch

from ..decode import Decoder
from ..ops import LinearAttentionState
from ..softmax_attention import KVCache

__all__ = ["RecurrentCache", "read_prompt", "read_tokens"]


class RecurrentCache:
    """What decoding carries from one forward to the next, updated in place (as Hugging Face
    caches are): ``states`` (one per layer, as ``PerformerLM.step`` takes them),
    ``positions`` `[B]`, the number of real tokens each row has seen (its next position), and
    ``seen``, the number of columns of ``input_ids`` read, padding included (an int: what
    ``generate()`` feeds next is ``input_ids[:, seen:]``)."""

    is_compileable = False  # generate() must not try to compile a static cache around it
    is_croppable = False
    decoder = None  # (Decoder, the states list it serves): tokens with no padding step in place there

    def __init__(self, states: list, positions: torch.Tensor, seen: int | None = None):
        self.states, self.positions = list(states), positions
        # Without padding every row has read ``positions`` columns (read once, when it is made).
        self.seen = int(positions.max()) if seen is None and positions.numel() else int(seen or 0)

    def __len__(self) -> int:
        return len(self.states)

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: the state is a fixed-size summary (generate() never slices inputs by its length)."""
        return [True] * len(self.states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues from row ``beam_idx[i]``."""
        pick = lambda t: t.index_select(0, beam_idx.to(t.device))  # noqa: E731
        self.states = [None if s is None else type(s)(*map(pick, s)) for s in self.states]
        self.positions = pick(self.positions)


def _keep_where(real: torch.Tensor, new, old):
    """A padded token leaves a row's state as it was: ``new`` where ``real`` `[B]`, else ``old``."""
    if isinstance(new, KVCache):  # the softmax anchor appended the token: mark its key padding
        return new._replace(key_mask=torch.cat([new.key_mask[:, :-1], real[:, None]], 1))
    old = old or LinearAttentionState(torch.zeros_like(new.S), torch.zeros_like(new.z))
    return LinearAttentionState(torch.where(real.view(-1, 1, 1, 1), new.S, old.S),
                                torch.where(real.view(-1, 1, 1), new.z, old.z))


def read_prompt(lm, ids, mask, use_cache: bool):
    """A prompt `[B, N]` read in one parallel forward of ``lm`` (a ``PerformerLM``): (logits,
    a new ``RecurrentCache``, or None without ``use_cache``)."""
    if not use_cache:
        return lm(ids, mask=mask), None
    logits, states = lm(ids, mask=mask, output_final_state=True)
    pos = mask.sum(1) if mask is not None else torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
    return logits, RecurrentCache(states, pos, seen=ids.shape[1])

def read_tokens(lm, ids, mask, cache: RecurrentCache, seq_len: int) -> torch.Tensor:
    """Token by token from ``cache`` (updated in place): one ``PerformerLM.step`` of ``lm`` per
    token and layer, or one ``Decoder`` step per token where no token is padding."""
    if len(cache) != len(lm.blocks) or cache.positions.shape != ids.shape[:1]:
        raise ValueError(f"past_key_values: a cache of {len(cache)} layers and {cache.positions.shape[0]} rows "
                         f"does not fit this model ({len(lm.blocks)} layers) and batch ({ids.shape[0]})")
    if lm.pos_emb is not None and cache.seen + ids.shape[1] > seq_len:
        # from the lengths (no tensor read per step): a row's position never passes the columns read
        raise ValueError(f"input_ids: {cache.seen} tokens read and {ids.shape[1]} more go past the absolute "
                         f"table of seq_len={seq_len}")
    dec = None if mask is not None else _decoder(lm, cache, ids.shape[1])
    if dec is not None:  # no padding: the cache's Decoder steps in place, reading no value
        out = torch.stack([dec.step(ids[:, t]) for t in range(ids.shape[1])], dim=1)
        cache.seen += ids.shape[1]
        return out
    out = []
    for t in range(ids.shape[1]):
        pos = cache.positions
        # one position for every row: an int, as PerformerLM.generate passes it (the same tables)
        same = pos.numel() > 0 and bool((pos == pos[0]).all())
        logits, states = lm.step(ids[:, t], cache.states, int(pos[0]) if same else pos)
        if mask is not None and not bool(mask[:, t].all()):
            states = [_keep_where(mask[:, t], new, old) for new, old in zip(states, cache.states)]
            pos = pos + mask[:, t].long()
        else:
            pos = pos + 1
        cache.states, cache.positions = states, pos
        cache.seen += 1
        out.append(logits)
    return torch.stack(out, dim=1)

def _decoder(lm, cache: RecurrentCache, n: int) -> Decoder | None:
    """The ``Decoder`` holding ``cache``'s state (linear variants; eager: ``generate()`` reads
    a value every token anyway). Made again from ``cache.states`` where a padded token or
    beam search replaced them, or when ``n`` more tokens would not fit (room for 1024 more)."""
    if lm.cfg.position == "softmax" or cache.positions.numel() == 0:
        return None
    held = cache.decoder
    if held is not None and held[1] is cache.states and held[0].steps_left >= n:
        return held[0]
    lo, hi = (int(v) for v in torch.aminmax(cache.positions))
    dec = Decoder(lm, cache.positions.shape[0], hi - lo + max(n, 1024), compile=False)
    dec.load(cache.states, cache.positions)
    cache.states, cache.positions = dec.states, dec.positions  # live views of its buffers
    cache.decoder = (dec, cache.states)
    return dec
