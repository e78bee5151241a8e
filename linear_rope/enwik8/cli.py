"""The training command line, derived from ``ModelConfig`` and ``TrainConfig``.

Every dataclass field is a flag whose help is the field's comment, with each preset's value. Only
the flags given override the preset; ``None`` is a value for the optional fields
(``--nb-features None``). A value may start with ``-`` (``--lr -1e-3`` reaches the range check,
as ``--lr=-1e-3`` does). Every check runs here, before any data is read or any file is written:
a bad command line is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import inspect
import re
import typing
from dataclasses import fields

import torch

from ..model import LM_POSITIONS, MODEL_PRESETS, ModelConfig
from .config import MAX_SEQ_LEN, TRAIN_PRESETS, TrainConfig, check_model, check_run

DESCRIPTION = ("Train the Enwik8 ablation: PerformerLM variants x seeds, with TensorBoard, "
               "checkpoints and DDP.")

__all__ = ["OneLineParser", "build_parser", "parse_runs", "configs_from_args", "check_device", "initial_model_config"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr (exit 2), without the usage dump,
    and a flag is only ever its full name (``--step`` is an error, not ``--steps``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")

    def format_help(self) -> str:
        """Plain text: the reST of the docstrings help texts come from (``x``, :func:`x`) as x."""
        return re.sub(r"(?::\w+:)?`{1,2}([^`]+)`{1,2}", r"\1", super().format_help())


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


def _add_fields(group, cls, skip, presets: dict[str, dict]) -> None:
    helps, hints = field_help(cls), typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        by_preset = {k: v[f.name] for k, v in presets.items() if f.name in v}
        default = (", ".join(f"{k} {by_preset.get(k, f.default)}" for k in presets)
                   if by_preset else f.default)
        text = f"{helps.get(f.name, f.name)} (default: {default})".replace("%", "%%")
        flag = "--" + f.name.replace("_", "-")
        if hint is bool or hint == (bool | None):  # SUPPRESS: a flag not given leaves the preset's value
            group.add_argument(flag, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=text)
            continue
        base = ([a for a in typing.get_args(hint) if a is not type(None)] or [hint])[0]
        metavar = {int: "N", float: "X"}.get(base, f.name.upper())
        metavar += "|None" if base is not hint else ""
        group.add_argument(flag, type=_arg_type(hint), default=argparse.SUPPRESS,
                           metavar=metavar, help=text)


def build_parser(prog: str | None = None) -> OneLineParser:
    p = OneLineParser(prog=prog, description=DESCRIPTION,
                      epilog="Model and training flags override the preset's values.")
    p.add_argument("--preset", choices=sorted(TRAIN_PRESETS), default="cpu",
                   help="named model + train config (default cpu)")
    p.add_argument("--variants", default="rope,none",
                   help=f"comma list of ModelConfig.position values, one run each: "
                        f"{', '.join(LM_POSITIONS)} (default rope,none)")
    p.add_argument("--seeds", default="0", help="comma list of run seeds (default 0)")
    p.add_argument("--resume", action="store_true",
                   help="continue runs from their latest checkpoint up to --steps (a run without one "
                        "starts from step 0, after a note that names where it looked)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete earlier runs of the same names in --out and start again")
    _add_fields(p.add_argument_group("model (ModelConfig)"), ModelConfig, {"position"}, MODEL_PRESETS)
    _add_fields(p.add_argument_group("training (TrainConfig)"), TrainConfig, {"seed"}, TRAIN_PRESETS)
    return p


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--lr -1e-3`` -> ``--lr=-1e-3``: argparse takes a value starting with ``-`` for a flag
    unless it looks like a plain negative number, so ``-1e-3`` would be "expected one argument"."""
    takes_value = {s for a in parser._actions if a.nargs is None and a.option_strings
                   and not isinstance(a, (argparse._StoreConstAction, argparse.BooleanOptionalAction))
                   for s in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1] not in parser._option_string_actions:
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def check_device(device: str) -> None:
    """ValueError unless ``device`` is auto, cpu, or a CUDA device this machine has."""
    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown --device {device!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(f"--device {device}: CUDA is not available on this machine (torch "
                         f"{torch.__version__} is {build}); use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s)")


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
    try:  # deduplicated as numbers: "1,01" is one run, not the same run twice
        seeds = list(dict.fromkeys(int(s) for s in _csv(args.seeds, "seeds")))
    except ValueError:
        raise ValueError(f"--seeds must be a comma list of integers, got {args.seeds!r}") from None
    given = vars(args)  # only the flags on the command line (the others are SUPPRESSed)
    init = given.get("init_from")  # the model config is the checkpoint's, the flags given override it
    base = initial_model_config(init) if init else MODEL_PRESETS[args.preset]
    model_kw = {**base, **{f.name: given[f.name] for f in fields(ModelConfig) if f.name in given}}
    train_kw = {**TRAIN_PRESETS[args.preset],
                **{f.name: given[f.name] for f in fields(TrainConfig) if f.name in given}}
    if train_kw.get("out") is None:
        train_kw["out"] = f"runs/{args.preset}"
    if not init and model_kw["seq_len"] > MAX_SEQ_LEN[args.preset]:
        raise ValueError(f"seq_len {model_kw['seq_len']} is above the {args.preset} preset's maximum "
                         f"{MAX_SEQ_LEN[args.preset]} (16x its training length); use a larger preset")
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other; pass one")
    runs = [(f"{v}-seed{s}", ModelConfig(**{**model_kw, "position": v}),
             TrainConfig(**{**train_kw, "seed": s})) for v in variants for s in seeds]
    check_device(runs[0][2].device)
    check_run(runs[0][1], runs[0][2])
    for v in variants:  # the library's own checks (feature map vs nb_features, ...), once a variant
        check_model(next(mc for _, mc, _ in runs if mc.position == v))
    return runs


def initial_model_config(path) -> dict:
    """The model config of ``--init-from``'s checkpoint (a file, or a run folder's newest), read
    with ``torch.load(weights_only=True)`` and checked against its content digest."""
    from .checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint

    ckpt = load_checkpoint(resolve_checkpoint(path))
    cfg = ckpt["config"].get("model") if isinstance(ckpt["config"], dict) else None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"--init-from {path}: the checkpoint holds no model config")
    return {k: v for k, v in cfg.items() if k != "position"}


def parse_runs(parser: argparse.ArgumentParser, argv: list[str]):
    """``(args, runs)`` from a command line; ValueError (one line) for a bad value (a wrong type,
    impossible from the command line, is a TypeError). argparse's own errors (unknown flag, bad
    int) exit 2 through :class:`OneLineParser`."""
    args = parser.parse_args(_join_negative_values(parser, argv))
    return args, configs_from_args(args)
