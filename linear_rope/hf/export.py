"""A training run's checkpoint as a Hugging Face folder (``save_pretrained``, safetensors).

    python -m linear_rope.export runs/ablation/rope-seed0 exported/rope-seed0

RUN_DIR is a run directory (its newest ``ckpt-<step>.pt``) or one checkpoint file, read and
verified as ``python -m linear_rope.sample`` reads it (``sample.load_verified``:
``torch.load(weights_only=True)`` only, the stored digests, a config that describes the weights,
finite weights). A run that is still training may delete its newest checkpoint while it is read:
the new newest one is read then. OUT_DIR must not exist or be empty: nothing is ever written
over. A new OUT_DIR is written beside it under a temporary name and renamed into place (with the
permissions the umask gives a new folder); an empty one (``.`` included) gets the files moved in;
a failed export leaves nothing behind. It holds ``config.json`` (``LinearRopeConfig``, with the
run's step and val / test BPC under ``linear_rope_run``, and ``auto_map``), ``model.safetensors``,
``generation_config.json`` (greedy decoding unless asked otherwise), the ``ByteTokenizer``'s
``tokenizer_config.json`` and ``modeling_linear_rope.py``, which imports the installed
``linear_rope``, so ``AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True)``
loads it without ``import linear_rope.hf``. Bad input: one line, exit 2.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..enwik8.checkpoint import CheckpointError
from ..enwik8.cli import OneLineParser
from ..enwik8.sample import load_verified
from ..model import PerformerLM
from .modeling import LinearRopeForCausalLM
from .tokenization import ByteTokenizer

__all__ = ["export_run", "main"]

def load_run(path) -> tuple[PerformerLM, dict]:
    """The run's model (eval mode) and ``{"checkpoint", "step", "val_bpc", "test_bpc"}``, verified
    as ``sample`` verifies it. Raises :class:`CheckpointError` (one line)."""
    model, ckpt, path = load_verified(path)
    metrics = ckpt.get("metrics") if isinstance(ckpt.get("metrics"), dict) else {}
    run = {"checkpoint": f"{path.parent.name}/{path.name}", "step": ckpt["step"],
           "val_bpc": metrics.get("val_bpc"), "test_bpc": metrics.get("test_bpc")}
    return model, run


def check_out_dir(out) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"OUT_DIR {out} is a file")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"OUT_DIR {out} is not empty; choose a new folder (nothing is written over)")
    return out


def write_folder(hf: LinearRopeForCausalLM, folder: Path) -> None:
    """``save_pretrained`` of the model and the tokenizer, every file as the umask gives it."""
    hf.save_pretrained(folder)  # both write the remote code and its auto_map
    ByteTokenizer().save_pretrained(folder)
    for f in folder.iterdir():  # some writers go through mkstemp (0600): what the umask gives instead
        f.chmod(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def export_run(run_dir, out_dir) -> tuple[Path, dict]:
    """Write the Hugging Face folder of ``run_dir``'s checkpoint to ``out_dir``; return it and
    the run's metadata. Raises CheckpointError or FileExistsError (one line each)."""
    out = check_out_dir(out_dir)
    model, run = load_run(run_dir)
    hf = LinearRopeForCausalLM.from_performer(model, linear_rope_run=run)
    into = out.is_dir()
    if into:  # empty: the files move in, the folder (its owner, its mode) stays
        tmp = Path(tempfile.mkdtemp(dir=out, prefix=".export.", suffix=".tmp"))
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700: a new folder gets what the umask gives
    moved = []
    try:
        write_folder(hf, tmp)
        if into:
            names = sorted(p.name for p in tmp.iterdir())
            if any(p != tmp for p in out.iterdir()):
                raise FileExistsError(f"OUT_DIR {out} is not empty; choose a new folder (nothing is written over)")
            for name in names:
                os.replace(tmp / name, out / name)
                moved.append(out / name)
        else:
            check_out_dir(out)  # still new or empty: nothing appeared there meanwhile
            if out.is_dir():
                out.rmdir()
            os.replace(tmp, out)
    except BaseException:
        for p in moved:  # ours: OUT_DIR was empty
            p.unlink(missing_ok=True)
        raise
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
