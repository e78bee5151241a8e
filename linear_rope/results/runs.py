"""Finished runs and their scalars: which runs finished, each run's curves as CSV, the files' helpers.

The shared pieces of ``linear_rope.plots``: ``find_runs``, ``export``, CSV and figure saving."""
from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path

from ..enwik8.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint
from ..enwik8.files import atomic_write
from ..enwik8.sample import load_model
from ..enwik8.trainer import NONFINITE_FILE
from . import analysis

RUN = re.compile(r"^(?P<variant>[a-z_]+)-seed(?P<seed>\d+)$")
COLORS = {"rope": "tab:red", "none": "tab:gray", "absolute": "tab:blue", "rope_pre": "tab:green",
          "rope_norm": "tab:purple", "softmax": "black"}
ORDER = ("softmax", "rope", "rope_pre", "rope_norm", "absolute", "none")
TAGS = ("train/loss", "train/bpc", "val/bpc", "lr", "grad/norm", "test/bpc", "train/skipped_steps")


class ResultsError(Exception):
    """Nothing to plot, or no matplotlib (the CLI prints it and exits 2)."""


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ResultsError('matplotlib is not installed: pip install "linear_rope[plot]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def find_runs(runs: Path) -> dict[str, tuple[str, int]]:
    """``{run name: (variant, seed)}`` for every *finished* run dir under ``runs`` (its newest
    checkpoint is at the configured ``steps``); unfinished runs are listed and left out."""
    found = {}
    for p in sorted(runs.iterdir()):
        if not (p.is_dir() and (m := RUN.match(p.name))):
            continue
        try:
            ckpt = load_checkpoint(resolve_checkpoint(p))
            done = ckpt["step"] >= ckpt["config"]["train"]["steps"]
        except CheckpointError:
            done = False
        if done:
            found[p.name] = (m["variant"], int(m["seed"]))
        elif (p / NONFINITE_FILE).is_file():
            found[p.name] = (m["variant"], int(m["seed"]))
            print(f"{p.name}: stopped by a non-finite step at {_ended(p)['step']}; included with its "
                  f"newest checkpoint", file=sys.stderr)
        else:
            print(f"leaving out {p.name}: not finished", file=sys.stderr)
    if not found:
        raise ResultsError(f"no finished <variant>-seed<k> runs in {runs}")
    return found


def _save(fig, path: Path, legend_axes=()) -> None:
    for ax in legend_axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def write_csv(path: Path, header: list[str], rows) -> None:
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _ended(run_dir: Path) -> dict | None:
    """How a non-finite step ended the run (``trainer.NONFINITE_FILE``), or None."""
    p = run_dir / NONFINITE_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def export(runs: Path, out: Path) -> None:
    """One wide CSV per run: step, then one column per tag (empty where not logged); and each
    run's facts in ``runs.json``. Runs exported earlier (from another run dir, another session)
    stay: the results accumulate, and ``summary`` reads them all from ``out``."""
    meta, found = _read_meta(out), find_runs(runs)
    for name in [n for n in meta if (runs / n).is_dir() and n not in found]:
        del meta[name]  # exported before, unfinished again now (resumed): out until it finishes
        (out / "curves" / f"{name}.csv").unlink(missing_ok=True)
    for name, (variant, seed) in found.items():
        scalars = analysis.read_scalars(runs / name)
        steps = sorted({s for tag in TAGS for s, _ in scalars.get(tag, [])})
        by_tag = {tag: dict(scalars.get(tag, [])) for tag in TAGS}
        write_csv(out / "curves" / f"{name}.csv", ["step", *TAGS],
                  ([s, *(f"{by_tag[t][s]:.6g}" if s in by_tag[t] else "" for t in TAGS)]
                   for s in steps))
        cfg = json.loads((runs / name / "config.json").read_text())
        meta[name] = {"variant": variant, "seed": seed, "config": cfg,
                      "wall_minutes": round(analysis.wall_seconds(runs / name) / 60, 1),
                      "ended_nonfinite": _ended(runs / name)}
    atomic_write(out / "runs.json", json.dumps(dict(sorted(meta.items())), indent=1) + "\n")
    print(f"wrote {out / 'curves'}/*.csv, {out / 'runs.json'}", file=sys.stderr)


def _read_meta(out: Path) -> dict:
    return json.loads((out / "runs.json").read_text()) if (out / "runs.json").is_file() else {}


def _final_models(runs: Path):
    for name, (variant, seed) in find_runs(runs).items():
        path = resolve_checkpoint(runs / name)
        yield name, variant, seed, path, load_model(path)


