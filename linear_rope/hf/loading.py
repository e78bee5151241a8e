"""A saved folder's config checked against its weights before a model is built from it.

``from_pretrained`` builds the model its ``config.json`` describes, then loads the weights into
it: a ``depth`` edited to 1e6 (or a ``dim``, ``nb_features``, ...) would allocate and initialise
that model first. Here the tensors' names and shapes are read from the weight files' headers
(no tensor is read) and compared with the model the config describes, sized step by step so that
nothing larger than the weights is ever made: the number of blocks first, the widths next
(from tensors of the file), and only then the whole state dict's shapes, from a model on the
``meta`` device.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
from pathlib import Path

import torch

from ..model import ModelConfig
from ..weights_fit import config_fits, shapes_error
from .configuration import ALIASES, MODEL_FIELDS, config_file

__all__ = ["weight_shapes", "check_config_fits", "shapes_error", "checked_against_weights", "check_before_building",
           "check_loaded"]

PREFIX = "model."  # LinearRopeForCausalLM.base_model_prefix
# from_pretrained -> __init__: (the config's name, the weights' file, their shapes), checked before building
_LOADING = contextvars.ContextVar("linear_rope_hf_loading", default=None)
# the fields that size or select weights: a default of these the weights contradict is named as such
SIZING = ("vocab_size", "dim", "depth", "heads", "dim_head", "nb_features", "seq_len", "position", "feature_map",
          "ff_mult", "qk_norm", "input_pos", "head_bias")


def _weight_files(folder: Path, variant: str | None, use_safetensors: bool | None) -> list[Path]:
    def named(name: str) -> Path:
        stem, ext = name.rsplit(".", 1)
        return folder / (f"{stem}.{variant}.{ext}" if variant else name)

    safe = [named("model.safetensors"), named("model.safetensors.index.json")]
    pt = [named("pytorch_model.bin"), named("pytorch_model.bin.index.json")]
    for f in (pt + safe) if use_safetensors is False else (safe + ([] if use_safetensors else pt)):
        if f.is_file():
            if f.name.endswith(".index.json"):
                shards = sorted(set(json.loads(f.read_text())["weight_map"].values()))
                return [folder / s for s in shards]
            return [f]
    return []


def weight_shapes(name_or_path, subfolder: str = "", variant: str | None = None,
                  use_safetensors: bool | None = None) -> tuple[Path, dict[str, tuple[int, ...]]] | None:
    """``(the weights' file, {name: shape})`` of a local folder's weights, from the files'
    headers (a ``.bin`` is opened on ``meta``); None where ``name_or_path`` is not a local folder
    or holds no weight file (``from_pretrained`` then says what it lacks). A header that cannot be
    read is a one-line ValueError naming the file."""
    if name_or_path is None or not Path(str(name_or_path), subfolder or "").is_dir():
        return None
    files = _weight_files(Path(str(name_or_path), subfolder or ""), variant, use_safetensors)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(f), framework="pt") as s:
                    shapes.update({k: tuple(s.get_slice(k).get_shape()) for k in s.keys()})
            else:
                sd = torch.load(f, map_location="meta", weights_only=True)
                shapes.update({k: tuple(v.shape) for k, v in sd.items()})
        except Exception as e:  # noqa: BLE001 -- any unreadable header: one line naming the file
            raise ValueError(f"{f}: its header cannot be read ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:160]})") from None
    return (files[0], shapes) if files else None


def check_config_fits(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], file: Path, config: str,
                      defaulted=()) -> None:
    """ValueError (one line, naming ``file`` and ``config``, where the config came from, and the
    fields ``defaulted`` because it lacks them) unless the model ``cfg`` describes holds exactly
    the tensors ``shapes`` names, of their shapes (``model.``-prefixed names)."""
    def refuse(what: str):
        lacks = f"; it lacks {', '.join(defaulted)}, which took ModelConfig's defaults" if defaulted else ""
        raise ValueError(f"{file}: its weights do not match {config} ({what}{lacks}); re-export the run, or "
                         f"restore the folder's config.json and weights")

    try:
        err = config_fits(cfg, shapes, PREFIX)
    except ValueError as e:  # a combination ModelConfig accepts and a layer refuses (elu with m != d)
        raise ValueError(f"{config}: {' '.join(str(e).split())}") from None
    if err:
        refuse(err)


@contextlib.contextmanager
def checked_against_weights(where, kwargs: dict):
    """Around ``PreTrainedModel.from_pretrained(where, **kwargs)``: the weights' shapes (a local
    folder's headers, or a ``state_dict=`` given) and where the config comes from, for
    ``check_before_building`` to check the config against before the model is built."""
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
        yield
    finally:
        _LOADING.reset(token)


def check_before_building(config, cfg: ModelConfig) -> None:
    """In ``LinearRopeForCausalLM.__init__`` under ``checked_against_weights``: ``cfg`` (from
    ``config``) checked against the weights (``check_config_fits``) before anything is built."""
    loading = _LOADING.get()
    if loading is not None:
        _LOADING.set(None)
        named, file, shapes, from_file = loading
        defaulted = [f for f in getattr(config, "_defaulted", ()) if f in SIZING] if from_file else ()
        check_config_fits(cfg, shapes, file, named, defaulted)


def check_loaded(info: dict, where) -> None:
    """ValueError (one line) unless ``from_pretrained`` found every weight, of its shape, and
    nothing else."""
    bad = shapes_error(*(info.get(k) or () for k in ("missing_keys", "mismatched_keys", "unexpected_keys")))
    if bad:
        raise ValueError(f"{where}: its weights do not match its config.json ({bad}); "
                         f"re-export the run, or restore the folder's config.json and model.safetensors")
