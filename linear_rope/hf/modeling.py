"""LinearRopeForCausalLM: ``PerformerLM`` as a Hugging Face causal LM, decoding on its O(1) state.

The weights are ``PerformerLM``'s, under ``model.`` (FAVOR+ projections included: they are
buffers of the state dict), so a training run's checkpoint converts with no renaming
(``linear_rope.hf.export``). ``generate()`` keeps a ``RecurrentCache``: one
``LinearAttentionState`` (S, z) per layer, O(1) in the context (the ``softmax`` anchor keeps its
key/value cache there), each row's next position, and how many columns of ``input_ids`` it has
read. Left-padded rows under an ``attention_mask`` get the positions they get alone, as in
``PerformerLM.generate``. A cache of a prompt's prefix continues from where it ends.
"""
from __future__ import annotations

import contextvars
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..decode import Decoder
from ..model import PerformerLM
from ..ops import LinearAttentionState
from ..softmax_attention import KVCache
from .configuration import ALIASES, MODEL_FIELDS, LinearRopeConfig, config_file
from .inputs import (check_cache, check_cache_position, check_extra_kwargs, check_ids, check_labels, check_mask,
                     check_positions)
from .loading import check_config_fits, shapes_error, weight_shapes
from .remote import AUTO_MAP, write_remote_code

__all__ = ["LinearRopeForCausalLM", "RecurrentCache"]

# transformers 5 names the cache ``cache`` in model outputs (``past_key_values`` before).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# from_pretrained -> __init__: (the config's name, the weights' file, their shapes), checked before building
_LOADING = contextvars.ContextVar("linear_rope_hf_loading", default=None)
# the fields that size or select weights: a default of these the weights contradict is named as such
SIZING = ("vocab_size", "dim", "depth", "heads", "dim_head", "nb_features", "seq_len", "position", "feature_map",
          "ff_mult", "qk_norm")


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


class LinearRopeForCausalLM(PreTrainedModel, GenerationMixin):
    """Byte-level causal LM (every ``PerformerLM`` variant), Hugging Face's interface.

    ``LinearRopeForCausalLM(LinearRopeConfig.from_preset("tiny"))`` builds a fresh model with
    ``PerformerLM``'s own initialisation; ``from_performer(lm)`` wraps a trained one (its weights
    are shared, not copied).
    """

    config_class = LinearRopeConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _is_stateful = True  # no assisted decoding: a state cannot rewind
    supports_gradient_checkpointing = False

    def __init__(self, config: LinearRopeConfig):
        super().__init__(config)
        cfg = config.to_model_config()
        loading = _LOADING.get()
        if loading is not None:  # from_pretrained: the config must describe the weights before it is built
            _LOADING.set(None)
            named, file, shapes, from_file = loading
            defaulted = [f for f in getattr(config, "_defaulted", ()) if f in SIZING] if from_file else ()
            check_config_fits(cfg, shapes, file, named, defaulted)
        self.model = PerformerLM(cfg)
        self.post_init()
        if self.generation_config is not None:  # stated, so that pipeline() does not sample by its own default
            self.generation_config.do_sample = False

    def _init_weights(self, module):
        """Nothing: ``PerformerLM`` initialises its weights (GPT-2 style) and draws its FAVOR+
        projections itself; loaded checkpoints hold every weight and projection."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward() makes its own RecurrentCache

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, refusing a folder whose weights do not cover the
        model its config describes (a tensor removed from ``model.safetensors``, a ``depth``,
        ``position`` or width edited in ``config.json``): a weight left as allocated would decode
        garbage, and ``PerformerLM``'s initialisation would be a random model under a trained name.

        A local folder's config (its ``config.json``, with any field given here, or ``config=``)
        is checked against the weights' headers before the model is built (``loading.py``): a
        ``depth`` of 1e6 or a wrong width is refused in one line naming the file, never allocated."""
        want_info = kwargs.pop("output_loading_info", False)
        where = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        found = weight_shapes(where, kwargs.get("subfolder", ""), kwargs.get("variant"), kwargs.get("use_safetensors"))
        if found is None and isinstance(kwargs.get("state_dict"), dict):
            found = (Path("state_dict"), {k: tuple(v.shape) for k, v in kwargs["state_dict"].items()})
        given = kwargs.get("config")
        from_file = given is None or isinstance(given, (str, Path)) or bool(given.name_or_path)
        if given is None or isinstance(given, (str, Path)):
            named = config_file(given or where, None if given else kwargs.get("subfolder"))
        else:  # the Auto classes pass the config they read; a config of one's own names no file
            named = config_file(given.name_or_path) if given.name_or_path else "the config given"
        fields = {k: v for k, v in kwargs.items() if ALIASES.get(k, k) in MODEL_FIELDS}
        if fields:
            named += f" with {', '.join(f'{k}={v!r}' for k, v in fields.items())} given"
        token = _LOADING.set(None if found is None else (named, *found, from_file))
        try:
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        finally:
            _LOADING.reset(token)
        check_loaded(info, where)
        return (model, info) if want_info else model

    @classmethod
    def from_performer(cls, lm: PerformerLM, **config_kwargs) -> "LinearRopeForCausalLM":
        """Wrap a ``PerformerLM`` (its config and its weights, shared)."""
        with torch.device("meta"):  # no throwaway weights, no draw from the global RNG
            hf = cls(LinearRopeConfig.from_model_config(lm.cfg, **config_kwargs))
        hf.model = lm
        return hf.train(lm.training)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, plus ``modeling_linear_rope.py`` and the config's
        ``auto_map``: the folder loads with ``trust_remote_code=True`` and no ``import linear_rope.hf``."""
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        out = super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)
        return out

    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value):
        self.model.tok_emb = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value):
        self.model.head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        past_key_values: RecurrentCache | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        cache: RecurrentCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ):
        """input_ids `[B, N]` -> ``CausalLMOutputWithPast`` (logits `[B, N, 256]`).

        Args:
            attention_mask: `[B, N]` (or `[B, seen + N]` with a cache: the cache's columns and
                these) of 0 and 1 (bool, integer or float), 1 = real token, 0 = padding, left or
                right; each row's real tokens get the logits they get alone, at positions that
                count its real tokens only.
            labels: `[B, N]`, shifted inside (``labels = input_ids`` trains next-byte
                prediction); -100 is ignored. The loss is the mean cross-entropy, as the trainer's
                (or the sum over ``num_items_in_batch``, as Hugging Face's Trainer passes it).
            past_key_values / cache: a ``RecurrentCache``; input_ids then holds the new tokens
                only, read one step at a time (O(1) each). Updated in place and returned.
            use_cache: return the cache (default ``config.use_cache``, off in training).
            position_ids `[B, N]` / cache_position `[N]`: not needed; where given they must be
                the positions the model reads (each row's real tokens 0, 1, 2, ..., as
                ``attention_mask.cumsum(-1) - 1`` gives them, continuing the cache's) and the
                columns read next; any other value is refused.

        Inputs are checked as ``PerformerLM``'s (``inputs.py``): a malformed one is a one-line
        ValueError naming it; ids, mask values and labels are read where that costs no device
        sync (on the CPU; on a GPU with ``LINEAR_ROPE_CHECKS=1``), as an unknown keyword is refused.
        """
        check_extra_kwargs(kwargs)
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: a byte-level model takes input_ids only")
        if input_ids is None:
            raise ValueError("input_ids is required")
        for name, flag in (("use_cache", use_cache), ("return_dict", return_dict)):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"{name} must be True, False or None, got {flag!r}")
        device = self.model.head.weight.device
        check_ids(input_ids, self.config.vocab_size, device)
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, RecurrentCache):
            raise ValueError(f"past_key_values must be a RecurrentCache (from this model), got {type(cache).__name__}")
        use_cache = use_cache if use_cache is not None else (getattr(self.config, "use_cache", True) and not self.training)
        B, N = input_ids.shape
        if cache is not None:
            check_cache(cache, len(self.model.blocks), self.model.cfg.position == "softmax", B, device)
        if labels is not None:
            check_labels(labels, (B, N), self.config.vocab_size)
        mask = None
        if attention_mask is not None:
            mask = check_mask(attention_mask, B, (N,) if cache is None else (N, cache.seen + N), device)[:, -N:]
            mask = None if bool(mask.all()) else mask
        if kwargs.get("cache_position") is not None:
            check_cache_position(kwargs["cache_position"], 0 if cache is None else cache.seen, N)
        if kwargs.get("position_ids") is not None:
            counted = torch.arange(N, device=device).expand(B, N) if mask is None else mask.long().cumsum(1) - 1
            start = 0 if cache is None else cache.positions.long()[:, None]
            check_positions(kwargs["position_ids"], counted + start, mask)
        if cache is None:
            logits, cache = self._read_prompt(input_ids, mask, use_cache)
        else:
            logits = self._read_tokens(input_ids, mask, cache)
        loss = None
        if labels is not None:
            loss = self._next_byte_loss(logits, labels, kwargs.get("num_items_in_batch"))
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()

    def _read_prompt(self, ids, mask, use_cache):
        if not use_cache:
            return self.model(ids, mask=mask), None
        logits, states = self.model(ids, mask=mask, output_final_state=True)
        pos = mask.sum(1) if mask is not None else torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
        return logits, RecurrentCache(states, pos, seen=ids.shape[1])

    def _read_tokens(self, ids, mask, cache: RecurrentCache) -> torch.Tensor:
        """Token by token from the cache: one ``PerformerLM.step`` per token and layer."""
        if len(cache) != len(self.model.blocks) or cache.positions.shape != ids.shape[:1]:
            raise ValueError(f"past_key_values: a cache of {len(cache)} layers and {cache.positions.shape[0]} rows "
                             f"does not fit this model ({len(self.model.blocks)} layers) and batch ({ids.shape[0]})")
        if self.model.pos_emb is not None and cache.seen + ids.shape[1] > self.config.seq_len:
            # from the lengths (no tensor read per step): a row's position never passes the columns read
            raise ValueError(f"input_ids: {cache.seen} tokens read and {ids.shape[1]} more go past the absolute "
                             f"table of seq_len={self.config.seq_len}")
        dec = None if mask is not None else self._decoder(cache, ids.shape[1])
        if dec is not None:  # no padding: the cache's Decoder steps in place, reading no value
            out = torch.stack([dec.step(ids[:, t]) for t in range(ids.shape[1])], dim=1)
            cache.seen += ids.shape[1]
            return out
        out = []
        for t in range(ids.shape[1]):
            pos = cache.positions
            # one position for every row: an int, as PerformerLM.generate passes it (the same tables)
            same = pos.numel() > 0 and bool((pos == pos[0]).all())
            logits, states = self.model.step(ids[:, t], cache.states, int(pos[0]) if same else pos)
            if mask is not None and not bool(mask[:, t].all()):
                states = [_keep_where(mask[:, t], new, old) for new, old in zip(states, cache.states)]
                pos = pos + mask[:, t].long()
            else:
                pos = pos + 1
            cache.states, cache.positions = states, pos
            cache.seen += 1
            out.append(logits)
        return torch.stack(out, dim=1)

    def _decoder(self, cache: RecurrentCache, n: int) -> Decoder | None:
        """The ``Decoder`` holding ``cache``'s state (linear variants; eager: ``generate()`` reads
        a value every token anyway). Made again from ``cache.states`` where a padded token or
        beam search replaced them, or when ``n`` more tokens would not fit (room for 1024 more)."""
        if self.model.cfg.position == "softmax" or cache.positions.numel() == 0:
            return None
        held = cache.decoder
        if held is not None and held[1] is cache.states and held[0].steps_left >= n:
            return held[0]
        lo, hi = (int(v) for v in torch.aminmax(cache.positions))
        dec = Decoder(self.model, cache.positions.shape[0], hi - lo + max(n, 1024), compile=False)
        dec.load(cache.states, cache.positions)
        cache.states, cache.positions = dec.states, dec.positions  # live views of its buffers
        cache.decoder = (dec, cache.states)
        return dec

    @staticmethod
    def _next_byte_loss(logits, labels, num_items_in_batch=None) -> torch.Tensor:
        """Next-byte cross-entropy: logits at t predict labels at t + 1 (float32, as the trainer)."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"labels must have input_ids' shape {list(logits.shape[:2])}, got {list(labels.shape)}")
        pred, target = logits[:, :-1].float().flatten(0, 1), labels[:, 1:].to(logits.device).flatten()
        if num_items_in_batch is None:
            return F.cross_entropy(pred, target, ignore_index=-100)
        return F.cross_entropy(pred, target, ignore_index=-100, reduction="sum") / num_items_in_batch

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``, its prompt checked up front as ``PerformerLM.generate``
        checks it (one read of the prompt's values, on any device): ``input_ids`` of bytes, an
        ``attention_mask`` of 0 and 1 whose last column is real in every row (left padding: each
        row continues from its last column, so right padding or an empty row would continue from a
        pad), ``position_ids`` (not needed) only as the mask gives them. The ``absolute`` variant
        refuses, from the lengths, a prompt plus ``max_new_tokens`` past its table."""
        ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        self._check_prompt(ids, kwargs)
        if self.model.pos_emb is not None:
            cfg = (args[1] if len(args) > 1 else kwargs.get("generation_config")) or self.generation_config
            new = kwargs.get("max_new_tokens", cfg.max_new_tokens if "max_length" not in kwargs else None)
            total = (ids.shape[-1] + new) if new is not None else \
                kwargs.get("max_length", cfg.max_length)
            if total is not None and total > self.config.seq_len + 1:
                raise ValueError(f"max_new_tokens: the absolute variant cannot go past seq_len={self.config.seq_len} "
                                 f"(the prompt and the new tokens come to {total} tokens, at most "
                                 f"{self.config.seq_len + 1} fit)")
        return super().generate(*args, **kwargs)

    def _check_prompt(self, ids, kwargs: dict) -> None:
        if ids is None:
            raise ValueError("input_ids is required: the model has no start-of-text token to begin from")
        cfg = kwargs.get("generation_config") or self.generation_config
        for key in ("output_attentions", "output_hidden_states"):
            if kwargs.get(key, getattr(cfg, key, False)):
                raise ValueError(f"{key}: not available (the model returns logits only); leave it out")
        device = self.model.head.weight.device
        check_ids(ids, self.config.vocab_size, device, always=True)
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

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, use_cache=True, **kwargs):
        """With a cache, only the columns it has not read go in: after the prompt the newest
        token, and after a cache of a prompt's prefix the rest of the prompt."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            if not isinstance(cache, RecurrentCache):
                raise ValueError(f"past_key_values must be a RecurrentCache (from this model), "
                                 f"got {type(cache).__name__}")
            if cache.seen >= input_ids.shape[1]:
                raise ValueError(f"past_key_values has read {cache.seen} tokens and the input holds "
                                 f"{input_ids.shape[1]}: pass a cache of a shorter prefix (the next token's "
                                 f"logits come from reading the prompt's last token)")
            input_ids = input_ids[:, cache.seen:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache, "use_cache": use_cache}


def check_loaded(info: dict, where) -> None:
    """ValueError (one line) unless ``from_pretrained`` found every weight, of its shape, and
    nothing else."""
    bad = shapes_error(*(info.get(k) or () for k in ("missing_keys", "mismatched_keys", "unexpected_keys")))
    if bad:
        raise ValueError(f"{where}: its weights do not match its config.json ({bad}); "
                         f"re-export the run, or restore the folder's config.json and model.safetensors")
