"""A model config checked against stored weights' shapes before anything is built from it.

Every reader of saved weights (``load_run``, ``python -m linear_rope.sample``, ``python -m
linear_rope.export`` and the Hugging Face loader) builds the model its config describes and then
loads the weights into it: a ``depth`` edited to 1e6, or an ``absolute`` run's ``seq_len`` edited
to 2**24, would allocate and initialise that model first. ``config_fits`` compares the config
with the tensors' names and shapes (no tensor value is read), sized step by step so that nothing
larger than the weights is ever made: the number of blocks first, the widths next (from tensors
of the file), the FAVOR+ width against the numbers the weights hold, and only then every tensor
of the state dict, from a model on the ``meta`` device (no memory): ``seq_len`` (the absolute
table), ``position``, ``feature_map``, ``qk_norm`` and every other field that sizes or selects a
weight are checked there.
"""
from __future__ import annotations

import torch

from .model import ModelConfig, PerformerLM

__all__ = ["config_fits", "shapes_error"]


def shapes_error(missing, mismatched, unexpected) -> str | None:
    """``N missing (a, b, c, ...); N mismatched (...); N unexpected (...)``, or None."""
    parts = [("missing", sorted(missing)), ("mismatched", sorted(mismatched)), ("unexpected", sorted(unexpected))]
    bad = [f"{len(v)} {k} ({', '.join(map(str, v[:3]))}{', ...' if len(v) > 3 else ''})" for k, v in parts if v]
    return "; ".join(bad) or None


def config_fits(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], prefix: str = "") -> str | None:
    """Why the model ``cfg`` describes does not hold exactly the tensors ``shapes`` names
    (``PerformerLM.state_dict()`` names after ``prefix``), of their shapes; None where it does. Nothing is
    allocated beyond what the weights themselves hold. A combination ``ModelConfig`` accepts and
    a layer refuses raises that layer's ValueError."""
    shapes = {k: tuple(s) for k, s in shapes.items()}
    held = {k[len(prefix):]: s for k, s in shapes.items() if k.startswith(prefix)}
    blocks = {k.split(".")[1] for k in held if k.startswith("blocks.")}
    if len(blocks) != cfg.depth:  # first: a depth of 1e6 is never built, even on meta
        return f"depth {cfg.depth}, but the weights hold {len(blocks)} blocks"
    want = {"tok_emb.weight": (cfg.vocab_size, cfg.dim), "head.weight": (cfg.vocab_size, cfg.dim),
            "blocks.0.attn.to_qkv.weight": (3 * cfg.heads * cfg.dim_head, cfg.dim),
            "blocks.0.ff.0.weight": (cfg.ff_mult * cfg.dim, cfg.dim)}
    bad = [f"{k} should be {list(s)}, is {list(held[k]) if k in held else 'missing'}"
           for k, s in want.items() if held.get(k) != s]
    if bad:
        return "; ".join(bad[:3])
    numbers = sum(int(torch.Size(s).numel()) for s in shapes.values())
    if cfg.nb_features is not None and cfg.nb_features * cfg.dim_head > numbers:  # a projection is drawn for it
        return f"nb_features {cfg.nb_features} needs more numbers than the weights hold"
    with torch.device("meta"):  # widths bounded by the weights' now: shapes only, nothing allocated
        sd = PerformerLM(cfg).state_dict()
    want = {prefix + k: tuple(t.shape) for k, t in sd.items()}
    return shapes_error(set(want) - set(shapes), {k for k in set(want) & set(shapes) if want[k] != shapes[k]},
                        set(shapes) - set(want))
