"""A training run's checkpoint as a Hugging Face folder (``save_pretrained``, safetensors).

    python -m linear_rope.export runs/ablation/rope-seed0 exported/rope-seed0

RUN_DIR is a run directory (its newest ``ckpt-<step>.pt``) or one checkpoint file, read as
``python -m linear_rope.sample`` reads it: ``torch.load(weights_only=True)`` only, through the
app's checkpoint checks. OUT_DIR must not exist or be empty: nothing is ever written over. The
folder is written beside OUT_DIR under a temporary name and renamed into place, so a failed export
leaves no partial folder. It holds ``config.json`` (``LinearRopeConfig``, with the run's step and
val / test BPC under ``linear_rope_run``), ``model.safetensors``, ``generation_config.json`` and the
``ByteTokenizer``'s ``tokenizer_config.json``; ``import linear_rope.hf`` then
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it. Bad input: one line, exit 2.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..enwik8.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint
from ..enwik8.cli import OneLineParser
from ..model import ModelConfig, PerformerLM
from .modeling import LinearRopeForCausalLM
from .tokenization import ByteTokenizer

__all__ = ["export_run", "main"]


def load_run(path) -> tuple[PerformerLM, dict]:
    """The run's model (eval mode) and ``{"checkpoint", "step", "val_bpc", "test_bpc"}``.
    Raises :class:`CheckpointError` (one line) for a missing, corrupt, unsafe or foreign file."""
    path = resolve_checkpoint(path)
    ckpt = load_checkpoint(path)
    try:
        model = PerformerLM(ModelConfig(**ckpt["config"]["model"]))
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not match linear_rope's model "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    metrics = ckpt.get("metrics") if isinstance(ckpt.get("metrics"), dict) else {}
    run = {"checkpoint": f"{path.parent.name}/{path.name}", "step": ckpt["step"],
           "val_bpc": metrics.get("val_bpc"), "test_bpc": metrics.get("test_bpc")}
    return model.eval(), run


def check_out_dir(out) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"OUT_DIR {out} is a file")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"OUT_DIR {out} is not empty; choose a new folder (nothing is written over)")
    return out


def export_run(run_dir, out_dir) -> tuple[Path, dict]:
    """Write the Hugging Face folder of ``run_dir``'s checkpoint to ``out_dir``; return it and
    the run's metadata. Raises CheckpointError or FileExistsError (one line each)."""
    out = check_out_dir(out_dir)
    model, run = load_run(run_dir)
    hf = LinearRopeForCausalLM.from_performer(model, linear_rope_run=run)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        hf.save_pretrained(tmp)
        ByteTokenizer().save_pretrained(tmp)
        check_out_dir(out)  # still new or empty: nothing appeared there meanwhile
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op once renamed
    return out, run


def main(argv: list[str] | None = None, prog: str = "python -m linear_rope.export") -> int:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory (its newest checkpoint) or a ckpt-<step>.pt file")
    p.add_argument("out_dir", help="the Hugging Face folder to write (must not exist, or be empty)")
    args = p.parse_args(argv)
    try:
        out, run = export_run(args.run_dir, args.out_dir)
    except (CheckpointError, FileExistsError, OSError) as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    bpc = "" if run["val_bpc"] is None else f", val bpc {run['val_bpc']:.4f}"
    print(f"exported {run['checkpoint']} (step {run['step']}{bpc}) to {out}", file=sys.stderr)
    return 0
