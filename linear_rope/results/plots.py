"""Results tables and figures from finished runs (matplotlib: ``pip install "linear_rope[plot]"``).

    python -m linear_rope.plots decay --out results            # RoFormer Fig. 2, d=64 and m=266
    python -m linear_rope.plots all --runs runs/results \\
        --data enwiki-sample.xml.bz2 --out results

``all`` runs, in order: ``export`` (each run's TensorBoard scalars to ``curves/<run>.csv``),
``extrapolate`` (test BPC of every final model at windows L, 2L, 4L, 8L), ``attention`` (the
Eq. 19 weight matrix of one head and the row sums of every head, per variant, as PNGs and as
TensorBoard images in the run), ``rowsums`` (row sums of every layer and head of every run at
windows L, 2L, 4L, 8L), ``decay``, ``summary`` (``summary.json`` and the val-BPC
figure with mean +- std bands) and ``tables`` (the markdown tables of the reports in ``results/<folder>/``,
printed). ``headline`` prints the top-level README's one table, and ``fill`` (from the repository
root) rewrites every tables block of the README and the results reports from their folders'
summary.json. Every figure is drawn from the CSV / JSON written beside it. ``--out`` has no
default: every command but ``fill`` writes to (or, ``tables`` and ``headline``, reads from)
the folder it names, and nothing else.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..enwik8 import data
from ..enwik8.checkpoint import CheckpointError
from ..enwik8.cli import OneLineParser
from .attention_maps import attention
from .extrapolation import FACTORS, decay, extrapolate, rowsums
from .runs import ResultsError, export, find_runs, read_csv, write_csv
from .tables import HEADLINE, fill, headline, summary, tables
from .tables import _ms, _redraw_jumps  # noqa: F401  (the reports' scripts and tests read them here)

__all__ = ["main", "export", "extrapolate", "attention", "rowsums", "decay", "summary", "tables", "headline",
           "fill", "find_runs", "read_csv", "write_csv", "ResultsError", "FACTORS", "HEADLINE"]


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m linear_rope.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["all", "export", "extrapolate", "attention", "rowsums", "decay",
                                    "summary", "tables", "headline", "fill"])
    p.add_argument("--runs", default="runs/results", help="experiment dir of <variant>-seed<k> runs")
    p.add_argument("--data", default=None,
                   help="the corpus the runs trained on (for test windows; default: enwik8, as in training)")
    p.add_argument("--data-dir", default="data", help="split cache dir (default data)")
    p.add_argument("--out", default=None, help="the folder the CSV/JSON/PNG files go to; for tables and headline, the "
                   "folder whose summary.json they read (required, except for fill)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.out is None and args.what != "fill":  # never a default folder: nothing lands where it was not asked
        p.error(f"{args.what} needs --out: the folder its files go to (tables, headline: the folder of the "
                f"summary.json to read), e.g. --out {args.runs}/plots")
    out, runs = Path(args.out or "."), Path(args.runs)
    if args.what not in ("tables", "headline", "fill"):
        out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what not in ("decay", "summary", "tables", "headline", "fill") and not runs.is_dir():
        p.exit(2, f"{p.prog}: error: --runs {runs} is not a directory\n")
    try:
        if args.what in ("all", "export"):
            export(runs, out)
        if args.what in ("all", "extrapolate"):
            extrapolate(runs, out, args.data, args.data_dir)
        if args.what in ("all", "attention"):
            attention(runs, out, args.data, args.data_dir)
        if args.what in ("all", "rowsums"):
            rowsums(runs, out, args.data, args.data_dir)
        if args.what in ("all", "decay"):
            decay(out)
        if args.what in ("all", "summary"):
            summary(runs, out)
        if args.what in ("all", "tables"):
            print(tables(out))
        if args.what == "headline":
            print(headline(out))
        if args.what == "fill":
            for doc in fill(Path(".")):
                print(f"refilled {doc}", file=sys.stderr)
    except (data.DataError, CheckpointError, ResultsError) as e:
        p.exit(2, f"{p.prog}: error: {' '.join(str(e).split())}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

