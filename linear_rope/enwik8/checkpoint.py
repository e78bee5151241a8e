"""Crash-safe checkpoints: atomic writes, retention of the last N, safe loading, run-dir guard.

A checkpoint is ``TrainState.state_dict()`` (``linear_rope.enwik8.state``). A run directory
holds ``ckpt-<step, 8 digits>.pt`` files, each written with ``files.atomic_write`` (temporary
file, fsync, rename, directory fsync), so a crash (even ``kill -9`` or a power cut after the
rename) leaves either the previous set of checkpoints or the new one, never a partial file under
a checkpoint name. Older checkpoints are deleted only after the new one is in place. A checkpoint is a plain dict of
tensors, numbers, strings, lists and dicts, and is only ever read with
``torch.load(weights_only=True)``: a file that would need to run code to unpickle is refused.

Checkpoints are verified on load. ``save_checkpoint`` stores ``content_sha256``, a digest of
everything else in the file (weights, buffers, optimizer moments, RNG states, config, metrics),
and ``load_checkpoint`` refuses a file whose content no longer matches it. The trainer also
stores ``param_sha256`` (``runtime.param_digest`` of the weights); :func:`verify_params` checks
it once a model has loaded the weights, which covers the checkpoints written before
``content_sha256`` existed. :func:`last_good_checkpoint` is the newest checkpoint that loads and
whose weights and val BPC are finite, the one a stopped run names.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import pickle
import re
from pathlib import Path

import torch

from .config import resume_diffs
from .files import TMP_SUFFIX, atomic_write
from .runtime import param_digest
from .rundir import RunDirError, run_files

__all__ = ["CheckpointError", "checkpoint_path", "list_checkpoints", "latest_checkpoint",
           "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "check_out_dir",
           "content_digest", "verify_params", "previous_checkpoint", "last_good_checkpoint", "nonfinite"]

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
LEGACY = "checkpoint.pt"  # the single checkpoint of linear_rope <= 0.1
REQUIRED = ("model", "step", "config")
DIGEST = "content_sha256"  # the key save_checkpoint adds: sha256 of everything else in the file


class CheckpointError(ValueError):
    """A checkpoint that cannot or must not be loaded (the CLIs print it and exit 2); a
    ValueError, as the library's other one-line errors."""


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
    payload = {**{k: v for k, v in payload.items() if k != DIGEST}}
    payload[DIGEST] = content_digest(payload)
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
    if DIGEST in ckpt and content_digest(ckpt) != ckpt[DIGEST]:
        raise CheckpointError(f"{path} is corrupt: its content does not match the {DIGEST} stored in it "
                              f"(a changed byte in its weights, optimizer or RNG states)")
    return ckpt


def _feed(h, x) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(x.shape)}".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    elif isinstance(x, dict):
        h.update(f"D{len(x)}".encode())
        for k, v in x.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__}{len(x)}".encode())
        for v in x:
            _feed(h, v)
    else:  # int, float (repr round-trips), str, bool, None
        h.update(f"{type(x).__name__}:{x!r};".encode())


def content_digest(ckpt: dict) -> str:
    """sha256 over every tensor's dtype, shape and bytes and every other value of a checkpoint,
    in order, leaving out the digest itself."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in ckpt.items() if k != DIGEST})
    return h.hexdigest()


def verify_params(ckpt: dict, model: torch.nn.Module, path) -> None:
    """CheckpointError unless the weights ``ckpt["model"]`` holds for ``model``'s parameters have
    the digest the checkpoint stores (``param_sha256``; checkpoints of linear_rope 0.1 have none).
    Checked before ``model`` loads them."""
    stored = ckpt.get("param_sha256")
    if not stored:
        return
    want = stored[0] if isinstance(stored, (list, tuple)) else stored
    try:
        got = param_digest(model, ckpt["model"])
    except (KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{path} does not hold the weights of this model ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:120]})") from None
    if got != want:
        raise CheckpointError(f"{path} is corrupt: its weights do not match the param_sha256 stored in it")


def previous_checkpoint(path) -> Path | None:
    """The checkpoint before ``path`` in its run folder, if any."""
    path = Path(path)
    older = [p for _, p in list_checkpoints(path.parent) if p.name < path.name and p != path]
    return older[-1] if older else None


def nonfinite(ckpt: dict) -> str | None:
    """What is non-finite in a checkpoint (its weights, or its val BPC), or None."""
    bad = [k for k, t in ckpt["model"].items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        return f"non-finite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
    val = (ckpt.get("metrics") or {}).get("val_bpc")
    if isinstance(val, (int, float)) and not math.isfinite(val):
        return f"val bpc {val}"
    return None


def last_good_checkpoint(run_dir) -> Path | None:
    """The newest checkpoint of ``run_dir`` that loads, verifies, and holds finite weights and a
    finite (or not yet measured) val BPC."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            if nonfinite(load_checkpoint(path)) is None:
                return path
        except (CheckpointError, AttributeError, TypeError):
            continue
    return None


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
    """Refuse to write over an earlier run; return the run dirs ``--overwrite`` will clear (of
    the files a run writes only: ``rundir.clear_run_dir``).

    ``runs``: ``[(name, ModelConfig, TrainConfig)]``. An existing run dir with run files needs
    ``--overwrite``, or ``--resume`` with a config its ``config.json`` allows (``resume_diffs``,
    checked again against the checkpoint itself when it loads).
    """
    out = Path(runs[0][2].out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    clear = []
    for name, mc, tc in runs:
        run_dir = out / name
        if not run_files(run_dir):  # missing, empty, or only what the user put there
            continue
        if overwrite and run_dir.is_symlink():
            raise RunDirError(f"--overwrite: {run_dir} is a symbolic link (to {run_dir.resolve()}); "
                              f"it is not cleared through a link: remove the link or choose another --out")
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
