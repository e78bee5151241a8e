"""Training configuration: the TrainConfig dataclass, the presets and the command line.

The CLI is derived from the two dataclasses (``ModelConfig`` and ``TrainConfig``): every field is
a flag whose help is the field's comment, with each preset's value.
"""
from __future__ import annotations

import argparse
import inspect
import math
import re
import typing
from dataclasses import dataclass, fields

from .model import LM_POSITIONS, MODEL_PRESETS, ModelConfig


class ConfigError(ValueError):
    """A run the model rejects or a --resume that does not match its checkpoint (CLI: exit 2)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr (exit 2), without the usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


@dataclass
class TrainConfig:
    steps: int = 2000  # optimizer steps in total
    batch_size: int = 8  # sequences per micro-batch on each rank
    grad_accum: int = 1  # micro-batches per step (global batch = batch_size * grad_accum * ranks)
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 100  # linear warmup steps
    decay_steps: int | None = None  # step where the cosine ends (None: steps)
    weight_decay: float = 0.01  # AdamW weight decay on matrices and embeddings
    grad_clip: float = 1.0  # max global grad norm (0: no clipping)
    eval_every: int = 250  # val BPC every N steps (0: only at the last step)
    eval_batch_size: int = 32  # eval windows per forward pass
    log_every: int = 10  # train scalars every N steps
    checkpoint_every: int = 0  # also checkpoint every N steps (0: at evals, the end and signals)
    keep_checkpoints: int = 3  # newest checkpoints kept per run (older ones are deleted)
    seed: int = 0  # init, data order and redraws (set per run by --seeds)
    data: str | None = None  # any byte corpus (.bz2/.gz/.xz/.zip/raw); None: enwik8
    data_dir: str = "data"  # where the splits (and enwik8.zip) are cached
    out: str | None = None  # experiment dir, one subdir per run (None: runs/<preset>)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    compile: bool = False  # model.compile() in place (optional on CPU)
    threads: int | None = None  # torch CPU threads (None: torch's default; 1 on a busy machine)
    deterministic: bool = False  # torch.use_deterministic_algorithms (bitwise-repeatable runs)

    def __post_init__(self):
        for f in ("steps", "batch_size", "grad_accum", "eval_batch_size", "log_every",
                  "keep_checkpoints"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        for f in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "checkpoint_every",
                  "seed"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for f in ("decay_steps", "threads"):
            if getattr(self, f) is not None and getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1 or None, got {getattr(self, f)}")


TRAIN_PRESETS: dict[str, dict] = {
    # RoFormer section 4.4: lr 1e-4, batch 128. The step count is not stated there; ours.
    "paper": dict(lr=1e-4, batch_size=128, steps=100_000, warmup_steps=1000, eval_every=1000,
                  eval_batch_size=16, log_every=50),
    # about 0.56 s/step on 2 idle EPYC cores: 1000 steps ~ 9.5 min plus ~25 s per full-val eval
    "cpu": dict(lr=1e-3, batch_size=8, steps=1000, warmup_steps=100, eval_every=250,
                eval_batch_size=32, log_every=10),
    "tiny": dict(lr=1e-3, batch_size=4, steps=20, warmup_steps=2, eval_every=10,
                 eval_batch_size=256, log_every=1),
}
assert set(TRAIN_PRESETS) == set(MODEL_PRESETS)

# Train fields a --resume may change: they do not alter the training trajectory.
RESUMABLE = {"steps", "eval_every", "eval_batch_size", "log_every", "checkpoint_every",
             "keep_checkpoints", "data", "data_dir", "out", "device", "compile", "threads",
             "deterministic"}

# A sanity cap on --seq-len per preset (16x its training length): a typo such as --seq-len 1024000
# fails at once instead of allocating for minutes. Evaluation at longer windows has no cap.
MAX_SEQ_LEN = {name: 16 * cfg["seq_len"] for name, cfg in MODEL_PRESETS.items()}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of the update at 0-based ``step`` (see the module docstring)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    end = cfg.decay_steps or cfg.steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, end - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# --------------------------------------------------------------------------- CLI


def field_help(cls) -> dict[str, str]:
    """``{field: comment}`` from the ``name: type = default  # comment`` lines of a dataclass."""
    return dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.+)$", inspect.getsource(cls), flags=re.M))


def _arg_type(hint):
    """int / float / str, or ``X | None`` parsed from "None" or an X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if not args:
        return hint

    def parse(s: str):
        return None if s.lower() == "none" else args[0](s)

    parse.__name__ = args[0].__name__  # argparse names the type in its error messages
    return parse


def _add_fields(group, cls, skip, presets: dict[str, dict]):
    helps, hints = field_help(cls), typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        by_preset = {k: v[f.name] for k, v in presets.items() if f.name in v}
        default = (", ".join(f"{k} {by_preset.get(k, f.default)}" for k in presets)
                   if by_preset else f.default)
        text = f"{helps.get(f.name, f.name)} (default: {default})"
        flag = "--" + f.name.replace("_", "-")
        if hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        base = ([a for a in typing.get_args(hint) if a is not type(None)] or [hint])[0]
        metavar = {int: "N", float: "X"}.get(base, f.name.upper())
        metavar += "|None" if base is not hint and base is not str else ""
        group.add_argument(flag, type=_arg_type(hint), default=None, metavar=metavar, help=text)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0],
                                epilog="Model and training flags override the preset's values.")
    p.add_argument("--preset", choices=sorted(TRAIN_PRESETS), default="cpu",
                   help="named model + train config (default cpu)")
    p.add_argument("--variants", default="rope,none",
                   help=f"comma list of ModelConfig.position values, one run each: "
                        f"{', '.join(LM_POSITIONS)} (default rope,none)")
    p.add_argument("--seeds", default="0", help="comma list of run seeds (default 0)")
    p.add_argument("--resume", action="store_true",
                   help="continue runs from their latest checkpoint up to --steps")
    p.add_argument("--overwrite", action="store_true",
                   help="delete earlier runs of the same names in --out and start again")
    _add_fields(p.add_argument_group("model (ModelConfig)"), ModelConfig, {"position"}, MODEL_PRESETS)
    _add_fields(p.add_argument_group("training (TrainConfig)"), TrainConfig, {"seed"}, TRAIN_PRESETS)
    return p


def _csv(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    return list(dict.fromkeys(items))


def configs_from_args(args) -> list[tuple[str, ModelConfig, TrainConfig]]:
    """``[(run name, model config, train config)]`` for every variant x seed; ValueError if bad."""
    variants = _csv(args.variants, "variants")
    for v in variants:
        if v not in LM_POSITIONS:
            raise ValueError(f"unknown variant {v!r}; choose from {', '.join(LM_POSITIONS)}")
    try:
        seeds = [int(s) for s in _csv(args.seeds, "seeds")]
    except ValueError:
        raise ValueError(f"--seeds must be a comma list of integers, got {args.seeds!r}") from None
    given = {k: v for k, v in vars(args).items() if v is not None}
    model_kw = {**MODEL_PRESETS[args.preset],
                **{f.name: given[f.name] for f in fields(ModelConfig) if f.name in given}}
    train_kw = {"out": f"runs/{args.preset}", **TRAIN_PRESETS[args.preset],
                **{f.name: given[f.name] for f in fields(TrainConfig) if f.name in given}}
    if model_kw["seq_len"] > MAX_SEQ_LEN[args.preset]:
        raise ValueError(f"seq_len {model_kw['seq_len']} is above the {args.preset} preset's maximum "
                         f"{MAX_SEQ_LEN[args.preset]} (16x its training length); use a larger preset")
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other; pass one")
    return [(f"{v}-seed{s}", ModelConfig(**{**model_kw, "position": v}),
             TrainConfig(**{**train_kw, "seed": s})) for v in variants for s in seeds]
