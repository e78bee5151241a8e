"""Resuming a run: every check a checkpoint passes before it is loaded into a run.

The config (``resume_diffs``), the number of ranks, the corpus (its digest, or for a checkpoint
from before digests its ``--data`` path), and the checkpoint's own parameter digests; a failed
check is a one-line ``ConfigError`` naming the checkpoint, and where an older one exists, how to
resume from it.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, nonfinite, previous_checkpoint,
                         resolve_checkpoint, verify_params)
from .config import ConfigError, resume_diffs

__all__ = ["checked_checkpoint", "load_initial_weights"]


def checked_checkpoint(run_dir: Path, name: str, mc, tc, model, corpus: dict, world: int, lead: bool) -> dict | None:
    """The run dir's newest checkpoint, checked against this run (``mc``, ``tc``, ``model``, the
    ``corpus`` digest, ``world`` ranks), or None where there is none."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return None

    def refuse(why: str):
        older = previous_checkpoint(path)
        hint = f"; move it away to resume from {older.name}" if older else ""
        raise ConfigError(f"cannot resume: {why}{hint}") from None

    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        refuse(str(e))
    diffs = resume_diffs(ckpt["config"], mc, tc)
    if ckpt.get("world", 1) != world:
        diffs.append(f"ranks: checkpoint {ckpt.get('world', 1)}, now {world} (the "
                     f"global batch and data slices depend on it)")
    if diffs:
        raise ConfigError(f"cannot resume from {path}: config differs ({'; '.join(diffs)})")
    _check_corpus(ckpt["config"], corpus, tc.data, path, name, lead)
    try:
        verify_params(ckpt, model, path)
    except CheckpointError as e:
        refuse(str(e))
    old = ckpt["config"]["train"]
    if tc.decay_steps is None and old.get("decay_steps") is None and old["steps"] != tc.steps and lead:
        print(f"{name}: note: the cosine now ends at step {tc.steps}, not "
              f"{old['steps']} (fix --decay-steps to avoid this)", file=sys.stderr)
    return ckpt


def _check_corpus(old: dict, now: dict, data, path: Path, name: str, lead: bool) -> None:
    """A resume trains on the corpus the run started on: the same bytes, wherever --data now
    points. A checkpoint from before corpus digests can only be checked by its --data path."""
    was = old.get("corpus")
    if isinstance(was, dict) and "sha256" in was:
        if was["sha256"] != now["sha256"]:
            raise ConfigError(
                f"cannot resume from {path}: --data is another corpus (sha256 {now['sha256'][:12]}, "
                f"{now['bytes']:,} bytes) than the run started on (sha256 {was['sha256'][:12]}, "
                f"{was.get('bytes', 0):,} bytes, from --data {old['train'].get('data')}); pass the same corpus")
        return
    if old["train"].get("data") != data:
        raise ConfigError(f"cannot resume from {path}: it was trained on --data {old['train'].get('data')}, "
                          f"now --data {data}, and it predates corpus digests, so only the path "
                          f"can be compared; pass the same --data")
    if lead:
        print(f"{name}: note: {path.name} predates corpus digests; the corpus was checked by its "
              f"path, and its sha256 is recorded from now on", file=sys.stderr)


def load_initial_weights(path, model) -> None:
    """``--init-from``: ``model`` takes the weights of the checkpoint at ``path`` (a file, or a run
    folder's newest), checked by its digests and finite; a one-line ConfigError unless every
    weight has the name and shape the model has. The FAVOR+ projections of a checkpoint go where
    the model has them (the ``softmax`` anchor has none); nothing else is dropped or added."""
    try:
        path = resolve_checkpoint(path)
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        raise ConfigError(f"--init-from: {e}") from None
    own = model.state_dict()
    sd = {k: v for k, v in ckpt["model"].items() if k in own or not k.endswith("features.projection")}
    bad = [f"{k} missing" for k in own if k not in sd] + [f"{k} unexpected" for k in sd if k not in own]
    bad += [f"{k} is {list(v.shape)}, the model's {list(own[k].shape)}" for k, v in sd.items()
            if k in own and v.shape != own[k].shape]
    if bad:
        raise ConfigError(f"--init-from {path}: its weights do not fit this model ({'; '.join(bad[:3])}"
                          f"{f'; {len(bad) - 3} more' if len(bad) > 3 else ''})")
    try:
        verify_params(ckpt, model, path)
    except CheckpointError as e:
        raise ConfigError(f"--init-from: {e}") from None
    bad = nonfinite({"model": sd})
    if bad:
        raise ConfigError(f"--init-from {path}: it holds {bad}")
    model.load_state_dict(sd)
