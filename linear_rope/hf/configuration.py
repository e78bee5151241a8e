"""LinearRopeConfig: ``ModelConfig`` (linear_rope/model.py) as a Hugging Face configuration."""
from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

from transformers import PretrainedConfig

from ..model import MODEL_PRESETS, ModelConfig

__all__ = ["LinearRopeConfig", "ConfigFieldError"]

MODEL_FIELDS = {f.name: f.default for f in fields(ModelConfig)}
# transformers' standard names for fields of ``ModelConfig``: read and checked as those fields.
ALIASES = {"hidden_size": "dim", "num_hidden_layers": "depth", "num_attention_heads": "heads",
           "head_dim": "dim_head", "rope_theta": "rope_base"}
# transformers' names for what this model fixes or sizes otherwise: a value is refused, never ignored.
NOT_READ = {
    "max_position_embeddings": "the training context (and the absolute table's size) is seq_len",
    "intermediate_size": "the feed-forward width is ff_mult * dim",
    "num_key_value_heads": "every head has its own keys and values (heads)",
    "hidden_act": "the feed-forward activation is GELU",
    "layer_norm_eps": "the LayerNorms use torch's default eps",
    "rms_norm_eps": "the norms are LayerNorms with torch's default eps",
    "rope_scaling": "RoPE is unscaled, with base rope_base",
    "rope_parameters": "RoPE is unscaled, with base rope_base",
    "partial_rotary_factor": "RoPE rotates every pair (see position)",
}


class ConfigFieldError(ValueError):
    """A field of a ``LinearRopeConfig`` (under its own name or a transformers alias) that no
    model can be built from: one line, naming the field as it was given, and the file it came
    from (``late``: set after construction, as a keyword of ``from_pretrained`` is: no file)."""

    late = False


def config_file(name_or_path, subfolder: str | None = None) -> str:
    """What a message names: the ``config.json`` of a folder, or the file given."""
    path = Path(str(name_or_path), subfolder or "")
    return str(path if path.suffix == ".json" else path / "config.json")


def _located(e: ConfigFieldError, where) -> ConfigFieldError:
    return e if not where or e.late or str(e).startswith(f"{where}:") else ConfigFieldError(f"{where}: {e}")


def check_model_fields(values: dict, given: dict[str, str] | None = None) -> ModelConfig:
    """``ModelConfig(**values)``; its TypeError or ValueError as a ConfigFieldError naming the field
    as given (``given``: field -> the name it arrived under, e.g. ``dim`` -> ``hidden_size``)."""
    try:
        if values.get("causal") is False:  # a bidirectional model reads the tokens after each output
            raise ValueError("causal must be True for a causal LM (a bidirectional model cannot generate), got False")
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:
        msg = " ".join(str(e).split())
        for field, name in (given or {}).items():
            if name != field and msg.startswith(field):  # ModelConfig's messages start with the field
                msg = f"{name} ({field}){msg[len(field):]}"
        raise ConfigFieldError(msg) from None


def _check_not_read(key: str, value) -> None:
    if key in NOT_READ and value is not None:
        raise ConfigFieldError(f"{key}: LinearRopeConfig does not read it ({NOT_READ[key]}), got {value!r}")
    if key == "tie_word_embeddings" and value is not False:
        raise ConfigFieldError(f"tie_word_embeddings must be False (the head is its own matrix), got {value!r}")


def take_model_fields(kwargs: dict) -> tuple[dict, dict[str, str]]:
    """Pop every ``ModelConfig`` field from ``kwargs``, under its own name or an alias (both
    given: they must agree), defaulting those absent as ``ModelConfig`` does; refuse the
    transformers names this model does not read. Returns (fields, field -> the name it came
    under; a field defaulted is absent)."""
    for key in [*NOT_READ, "tie_word_embeddings"]:
        if key in kwargs:
            _check_not_read(key, kwargs[key])
            if key in NOT_READ:
                kwargs.pop(key)
    given = {field: field for field in MODEL_FIELDS if field in kwargs}
    for alias, field in ALIASES.items():
        if alias in kwargs:
            value = kwargs.pop(alias)
            if field in kwargs and kwargs[field] != value:
                raise ConfigFieldError(f"{alias} {value!r} and {field} {kwargs[field]!r} disagree "
                                       f"({alias} is another name for {field}): give one")
            kwargs[field], given[field] = value, alias
    return {name: kwargs.pop(name, default) for name, default in MODEL_FIELDS.items()}, given


class LinearRopeConfig(PretrainedConfig):
    """Every field of ``ModelConfig`` (``position`` picks the variant: rope, rope_pre, rope_norm,
    none, softmax, absolute), checked by it, plus Hugging Face's own keys. The vocabulary is the
    256 bytes; byte 0 pads (always under a 0 mask).

    transformers' names ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``head_dim`` and ``rope_theta`` are ``dim``, ``depth``, ``heads``, ``dim_head`` and
    ``rope_base``, read and checked as those (given twice, they must agree). Its names for what
    this model fixes (``max_position_embeddings``, ``intermediate_size``, ``rope_scaling``, a
    tied head, ...) are refused, never ignored. A field a ``config.json`` lacks takes
    ``ModelConfig``'s default on every entry point (a subclass, as ``trust_remote_code`` loads
    it, included); loading a model then refuses a default its weights contradict. Every field is
    checked when it is set, at construction or later (``cfg.hidden_size = 0``, a keyword of
    ``from_pretrained``): a one-line :class:`ConfigFieldError` (a ValueError) naming the field,
    and the ``config.json`` it came from.

    ``LinearRopeConfig.from_preset("tiny", position="softmax")`` builds a named preset.
    """

    model_type = "linear_rope"
    attribute_map = dict(ALIASES)

    def __init__(self, **kwargs):
        try:
            model, given = take_model_fields(kwargs)
            check_model_fields(model, given)  # the library's checks, before anything is set
        except ConfigFieldError as e:
            where = kwargs.get("name_or_path")  # AutoConfig passes the folder it read
            raise _located(e, config_file(where) if where else None) from None
        for name, value in model.items():
            setattr(self, name, value)
        # what a message names when the weights contradict a default (never saved: see to_dict)
        self._defaulted = [name for name in MODEL_FIELDS if name not in given]
        kwargs.setdefault("tie_word_embeddings", False)  # the head is its own matrix
        kwargs.setdefault("pad_token_id", 0)
        super().__init__(**kwargs)

    def __init_subclass__(cls, **kwargs):
        """A subclass with no ``__init__`` of its own (``modeling_linear_rope.py``'s) keeps this
        one: transformers 5 would otherwise give it a dataclass ``__init__`` that sets none of the
        fields a ``config.json`` lacks and checks none of those it has."""
        own = "__init__" in cls.__dict__
        super().__init_subclass__(**kwargs)
        if not own:
            cls.__init__ = LinearRopeConfig.__init__

    def __setattr__(self, key, value):
        field = ALIASES.get(key, key)
        try:
            if key in NOT_READ or key == "tie_word_embeddings":
                _check_not_read(key, value)
            if field in MODEL_FIELDS and all(name in self.__dict__ for name in MODEL_FIELDS):
                check_model_fields({**{n: self.__dict__[n] for n in MODEL_FIELDS}, field: value}, {field: key})
        except ConfigFieldError as e:
            e.late = all(name in self.__dict__ for name in MODEL_FIELDS)  # not from a file: a keyword, an edit
            raise
        super().__setattr__(key, value)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("_defaulted", None)
        return out

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``PretrainedConfig.from_pretrained``; a field no model can be built from is refused
        in one line naming the ``config.json`` (or the keyword) it came from."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except ConfigFieldError as e:
            raise _located(e, config_file(pretrained_model_name_or_path, kwargs.get("subfolder"))) from None

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LinearRopeConfig":
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(MODEL_PRESETS)}")
        named = {ALIASES[k] for k in overrides if k in ALIASES}  # an override under an alias replaces the preset's
        return cls(**{**{k: v for k, v in MODEL_PRESETS[name].items() if k not in named}, **overrides})

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "LinearRopeConfig":
        return cls(**asdict(cfg), **kwargs)

    def to_model_config(self) -> ModelConfig:
        return check_model_fields({name: getattr(self, name) for name in MODEL_FIELDS})
