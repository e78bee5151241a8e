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
from .checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint
from .cli import OneLineParser

__all__ = ["load_model", "main"]


def load_model(path, device: str = "cpu") -> PerformerLM:
    """Rebuild ``PerformerLM(ModelConfig(**cfg["model"]))`` from a checkpoint file or run dir.

    Raises :class:`CheckpointError` (one line) for a missing, corrupt, unsafe or foreign file.
    """
    path = resolve_checkpoint(path)
    ckpt = load_checkpoint(path)
    try:
        model = PerformerLM(ModelConfig(**ckpt["config"]["model"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not match linear_rope's model "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    return model.to(device).eval()


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
    p.add_argument("--seed", type=int, default=0, help="sampling generator seed (default 0)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
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
    try:
        model = load_model(args.checkpoint, args.device)
    except CheckpointError as e:
        fail(str(e))
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
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
