"""Sample bytes from a checkpoint written by ``linear_rope.train``.

    python -m linear_rope.sample runs/cpu/rope-seed0/checkpoint.pt --prompt "The " \\
        --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0

Prints the prompt and its continuation decoded as UTF-8; bytes that do not decode are shown as
U+FFFD. Decoding is recurrent (``PerformerLM.generate``): O(1) work per new byte.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .model import ModelConfig, PerformerLM

__all__ = ["load_model", "main"]


def load_model(path, device: str = "cpu") -> PerformerLM:
    """Rebuild ``PerformerLM(ModelConfig(**cfg["model"]))`` and load its weights (eval mode).

    Raises ``FileNotFoundError`` if ``path`` is missing; other errors mean a corrupt or foreign file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = PerformerLM(ModelConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="path to a checkpoint.pt")
    p.add_argument("--prompt", default="\n", help="text to continue (UTF-8; default a newline)")
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

    try:
        model = load_model(args.checkpoint, args.device)
    except FileNotFoundError as e:
        fail(str(e))
    except Exception as e:  # torch.load / state-dict errors: any unreadable checkpoint
        fail(f"cannot load checkpoint {args.checkpoint} ({type(e).__name__}): corrupt, truncated "
             f"or not written by linear_rope.train")
    prompt = args.prompt.encode("utf-8")
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    try:
        new = model.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, generator=gen)
    except ValueError as e:
        fail(str(e))
    print((prompt + new).decode("utf-8", errors="replace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
