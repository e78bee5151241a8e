"""Crash-safe checkpoints: atomic writes, retention of the last N, safe loading, run-dir guard.

A checkpoint is ``TrainState.state_dict()`` (``linear_rope.enwik8.trainer``). A run directory
holds ``ckpt-<step, 8 digits>.pt`` files, each written with ``files.atomic_write`` (temporary
file, fsync, rename, directory fsync), so a crash (even ``kill -9`` or a power cut after the
rename) leaves either the previous set of checkpoints or the new one, never a partial file under
a checkpoint name. Older checkpoints are deleted only after the new one is in place. A checkpoint is a plain dict of
tensors, numbers, strings, lists and dicts, and is only ever read with
``torch.load(weights_only=True)``: a file that would need to run code to unpickle is refused.
"""
from __future__ import annotations

import contextlib
import json
import pickle
import re
from pathlib import Path

import torch

from .config import resume_diffs
from .files import TMP_SUFFIX, atomic_write

__all__ = ["CheckpointError", "checkpoint_path", "list_checkpoints", "latest_checkpoint",
           "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "check_out_dir"]

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
LEGACY = "checkpoint.pt"  # the single checkpoint of linear_rope <= 0.1
REQUIRED = ("model", "step", "config")


class CheckpointError(Exception):
    """A checkpoint that cannot or must not be loaded (the CLIs print it and exit 2)."""


class RunDirError(ValueError):
    """An --out that holds an earlier or different run (the CLI prints it and exits 2)."""


def checkpoint_path(run_dir, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:08d}.pt"


def list_checkpoints(run_dir) -> list[tuple[int, Path]]:
    """``[(step, path)]`` of the complete checkpoints in ``run_dir``, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name)))
    if not found and (run_dir / LEGACY).is_file():
        found = [(-1, run_dir / LEGACY)]  # step unknown until loaded
    return found


def latest_checkpoint(run_dir) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(run_dir, step: int, payload: dict, keep: int) -> Path:
    """Write ``payload`` as the step's checkpoint atomically, then keep only the newest ``keep``."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = atomic_write(checkpoint_path(run_dir, step), lambda f: torch.save(payload, f))
    for _, old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    for stale in run_dir.glob(f".ckpt-*{TMP_SUFFIX}"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    return final


def load_checkpoint(path) -> dict:
    """``torch.load(path, weights_only=True)`` with one-line :class:`CheckpointError` messages."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()
        why = next((ln for ln in why if "GLOBAL" in ln or "Unsupported" in ln), why[0] if why else "")
        raise CheckpointError(
            f"refusing to load {path}: it contains pickled objects that are not plain weights, and "
            f"loading it could run code (torch.load weights_only=True: {' '.join(why.split())[:160]})"
        ) from None
    except Exception as e:  # zip / EOF / unpickling errors of a truncated or foreign file
        raise CheckpointError(f"cannot read checkpoint {path} ({type(e).__name__}): corrupt, "
                              f"truncated or not a torch checkpoint") from None
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in REQUIRED):
        raise CheckpointError(f"{path} is not a linear_rope checkpoint "
                              f"(needs the keys {', '.join(REQUIRED)})")
    return ckpt


def resolve_checkpoint(path) -> Path:
    """A checkpoint file as given, or the latest checkpoint of a run directory."""
    path = Path(path)
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
        runs = sorted(str(d) for d in path.iterdir() if d.is_dir() and latest_checkpoint(d))
        if runs:  # an experiment folder (runs/<exp>), which holds run folders
            raise CheckpointError(f"{path} holds runs, not checkpoints: name one of "
                                  f"{', '.join(runs)}")
        raise CheckpointError(f"no checkpoint in {path} (expected ckpt-<step>.pt files)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    return path


def check_out_dir(runs, resume: bool, overwrite: bool) -> list[Path]:
    """Refuse to write over an earlier run; return the run dirs ``--overwrite`` will clear.

    ``runs``: ``[(name, ModelConfig, TrainConfig)]``. An existing non-empty run dir needs
    ``--overwrite``, or ``--resume`` with a config its ``config.json`` allows (``resume_diffs``,
    checked again against the checkpoint itself when it loads).
    """
    out = Path(runs[0][2].out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    clear = []
    for name, mc, tc in runs:
        run_dir = out / name
        if not run_dir.is_dir() or not any(run_dir.iterdir()):
            continue
        if overwrite:
            clear.append(run_dir)
            continue
        old = None
        with contextlib.suppress(OSError, ValueError, TypeError):
            old = json.loads((run_dir / "config.json").read_text())
        diffs = resume_diffs(old, mc, tc) if isinstance(old, dict) else []
        if diffs and resume:
            raise RunDirError(f"cannot resume {run_dir}: config differs ({'; '.join(diffs)})")
        if diffs:
            raise RunDirError(f"{run_dir} holds a different experiment ({'; '.join(diffs)}); "
                              f"choose another --out, or pass --overwrite to replace it")
        if not resume:
            raise RunDirError(f"{run_dir} holds an earlier run; pass --resume to continue it, "
                              f"--overwrite to replace it, or choose another --out")
    return clear
