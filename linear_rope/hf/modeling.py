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

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..model import PerformerLM
from .cache import RecurrentCache, read_prompt, read_tokens
from .configuration import LinearRopeConfig
from .inputs import (check_cache, check_cache_position, check_extra_kwargs, check_ids, check_labels, check_mask,
                     check_positions)
from .loading import check_before_building, check_loaded, checked_against_weights
from .prompt import check_prompt
from .remote import AUTO_MAP, write_remote_code

__all__ = ["LinearRopeForCausalLM", "RecurrentCache"]

# transformers 5 names the cache ``cache`` in model outputs (``past_key_values`` before).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


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
        check_before_building(config, cfg)  # from_pretrained: the config must describe the weights
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
        with checked_against_weights(where, kwargs):
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
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
            logits, cache = read_prompt(self.model, input_ids, mask, use_cache)
        else:
            logits = read_tokens(self.model, input_ids, mask, cache, self.config.seq_len)
        loss = None
        if labels is not None:
            loss = self._next_byte_loss(logits, labels, kwargs.get("num_items_in_batch"))
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()

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
        check_prompt(self, args, kwargs)  # (a position_ids it checked is dropped: the model counts positions)
        return super().generate(*args, **kwargs)

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

