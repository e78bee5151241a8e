"""LinearRopeConfig: ``ModelConfig`` (linear_rope/model.py) as a Hugging Face configuration."""
from __future__ import annotations

from dataclasses import asdict, fields

from transformers import PretrainedConfig

from ..model import MODEL_PRESETS, ModelConfig

__all__ = ["LinearRopeConfig"]

MODEL_FIELDS = {f.name: f.default for f in fields(ModelConfig)}


class LinearRopeConfig(PretrainedConfig):
    """Every field of ``ModelConfig`` (``position`` picks the variant: rope, rope_pre, rope_norm,
    none, softmax, absolute), checked by it, plus Hugging Face's own keys. The standard names
    ``hidden_size``, ``num_hidden_layers`` and ``num_attention_heads`` read ``dim``, ``depth``
    and ``heads``. The vocabulary is the 256 bytes; byte 0 pads (always under a 0 mask).

    ``LinearRopeConfig.from_preset("tiny", position="softmax")`` builds a named preset.
    """

    model_type = "linear_rope"
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "depth", "num_attention_heads": "heads"}

    def __init__(self, **kwargs):
        model = {name: kwargs.pop(name, default) for name, default in MODEL_FIELDS.items()}
        ModelConfig(**model)  # the library's checks: a one-line ValueError naming the field
        for name, value in model.items():
            setattr(self, name, value)
        kwargs.setdefault("tie_word_embeddings", False)  # the head is its own matrix
        kwargs.setdefault("pad_token_id", 0)
        super().__init__(**kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LinearRopeConfig":
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(MODEL_PRESETS)}")
        return cls(**{**MODEL_PRESETS[name], **overrides})

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "LinearRopeConfig":
        return cls(**asdict(cfg), **kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS})
