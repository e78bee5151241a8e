"""Sample bytes from a checkpoint written by ``linear_rope.train``.

    python -m linear_rope.sample runs/cpu/rope-seed0 --prompt "The " \\
        --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0

The checkpoint is a ``ckpt-<step>.pt`` file or a run directory (its newest checkpoint), read with
``torch.load(weights_only=True)`` only. The model is byte-level, so a prompt is bytes: ``--prompt``
is taken as the exact bytes the shell passed (UTF-8 or not; Python's surrogateescape keeps
undecodable bytes), ``--prompt-file`` as a file's raw bytes. An empty prompt is an error: the
model has no start-of-text token to condition on. Output is the prompt and its continuation,
decoded as UTF-8 with U+FFFD for bytes that do not decode, or the raw bytes with ``--raw``.
Decoding is recurrent (``PerformerLM.generate``): O(1) work per new byte.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..model import ModelConfig, PerformerLM
from ..weights_fit import config_fits
from .checkpoint import (CheckpointError, load_checkpoint, nonfinite, previous_checkpoint, resolve_checkpoint,
                         verify_params)
from ..ops.backend import check_backend
from .cli import OneLineParser, check_device
from .rundir import os_error_line

__all__ = ["load_model", "load_verified", "main"]

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits


def _check_shapes(cfg: ModelConfig, sd: dict, path) -> None:
    """The config must describe the weights stored beside it (``weights_fit.config_fits``, before
    the model is built: a config edited to depth 1e6, or an absolute table of 2**24 rows, would
    otherwise be allocated first)."""
    bad = config_fits(cfg, {k: tuple(t.shape) for k, t in sd.items() if isinstance(t, torch.Tensor)})
    if bad:
        raise CheckpointError(f"{path}: its config does not describe its weights ({bad})")


def load_verified(path, tries: int = 3) -> tuple[PerformerLM, dict, Path]:
    """The checks every reader of a checkpoint runs (``sample``, ``export``): ``(model, ckpt,
    path)``, the model on the CPU in eval mode, rebuilt as ``PerformerLM(ModelConfig(**cfg["model"]))``
    from a checkpoint file or a run directory (its newest checkpoint), with ``path`` the file read.

    Raises :class:`CheckpointError` (one line) for a missing, corrupt, unsafe or foreign file, a
    config that does not match the weights (checked on the shapes before the model is built),
    weights that fail their stored digest, or non-finite weights; the message names the previous
    checkpoint of the run where there is one. A run that is still training deletes old
    checkpoints as it writes new ones: when the newest checkpoint of a run directory is gone by
    the time it is read, the new newest one is read instead (``tries`` times in all).
    """
    for attempt in range(tries):
        file = resolve_checkpoint(path)
        try:
            return _load_verified(file)
        except CheckpointError:
            if Path(path).is_dir() and not file.exists() and attempt + 1 < tries:
                continue  # retention deleted it under us: a newer one is in place
            raise
    raise AssertionError("unreachable")


def _load_verified(path: Path) -> tuple[PerformerLM, dict, Path]:
    try:
        ckpt = load_checkpoint(path)
        sd = ckpt["model"]
        try:
            cfg = ModelConfig(**ckpt["config"]["model"])
            _check_shapes(cfg, sd, path)
            model = PerformerLM(cfg)
            verify_params(ckpt, model, path)
            model.load_state_dict(sd)
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as e:
            raise CheckpointError(f"{path} does not match linear_rope's model "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
        bad = nonfinite({"model": sd})
        if bad:
            raise CheckpointError(f"{path} holds {bad}: nothing can be sampled or exported from it")
    except CheckpointError as e:
        older = previous_checkpoint(path)
        raise CheckpointError(f"{e}; the previous checkpoint is {older}" if older else str(e)) from None
    return model.eval(), ckpt, path


def load_model(path, device: str = "cpu") -> PerformerLM:
    """Rebuild ``PerformerLM(ModelConfig(**cfg["model"]))`` from a checkpoint file or run dir,
    verified by :func:`load_verified` (CheckpointError, one line, for anything it refuses)."""
    return load_verified(path)[0].to(device).eval()


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a ckpt-<step>.pt file, or a run directory (its newest)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None,
                     help="bytes to continue, as passed by the shell (default a newline)")
    src.add_argument("--prompt-file", default=None, help="continue this file's raw bytes")
    p.add_argument("--raw", action="store_true", help="write raw bytes, not UTF-8 with U+FFFD")
    p.add_argument("--max-new-tokens", type=int, default=200, help="bytes to generate (default 200)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest bytes only")
    p.add_argument("--seed", type=int, default=0, help="sampling generator seed, 0 to 2**64 - 1 (default 0)")
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N (default cpu)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog or "python -m linear_rope.sample")
    args = parser.parse_args(argv)

    def fail(msg: str):
        parser.exit(2, f"{parser.prog}: error: {' '.join(msg.split())}\n")

    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_bytes()
        except OSError as e:
            fail(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}")
    else:
        prompt = ("\n" if args.prompt is None else args.prompt).encode("utf-8", "surrogateescape")
    if not prompt:
        fail("the prompt is empty: the model has no start-of-text token, so give at least one "
             "byte (e.g. --prompt $'\\n')")
    if not 0 <= args.seed <= MAX_SEED:
        fail(f"--seed must be in [0, 2**64 - 1], got {args.seed}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        check_device(args.device)
        check_backend(device)  # LINEAR_ROPE_BACKEND
    except ValueError as e:
        fail(str(e))
    try:
        model = load_model(args.checkpoint, device)
    except CheckpointError as e:
        fail(str(e))
    except OSError as e:
        fail(os_error_line(e))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    try:
        new = model.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, generator=gen)
    except ValueError as e:
        fail(str(e))
    if args.raw:
        sys.stdout.flush()
        sys.stdout.buffer.write(prompt + new)
        sys.stdout.buffer.flush()
    else:
        print((prompt + new).decode("utf-8", errors="replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
