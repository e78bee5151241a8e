"""Test BPC at longer windows (``extrapolate``), Eq. 19's row sums at those windows (``rowsums``) and
RoPE's long-term decay bound (``decay``, RoFormer Fig. 2)."""
from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from ..enwik8 import data
from ..enwik8.checkpoint import load_checkpoint, resolve_checkpoint
from ..enwik8.sample import load_model
from . import analysis
from .runs import (
    COLORS,
    ORDER,
    _final_models,
    _plt,
    _save,
    find_runs,
    read_csv,
    write_csv,
)

FACTORS = (1, 2, 4, 8)


def extrapolate(runs: Path, out: Path, corpus: str, data_dir: str, factors=(1, 2, 4, 8)) -> None:
    """Test BPC of every finished run at windows of f * L. 1L is the run's own final test BPC
    (the same protocol: whole split, non-overlapping windows of L). Rows already in
    ``extrapolation.csv`` for the same run, step and final test BPC are kept, so this can run as
    runs finish; a run redone from scratch (same name and step, new weights) is measured again."""
    test = data.load_split(data.prepare_corpus(corpus, data_dir)["test"])
    header = ["run", "variant", "seed", "step", *(f"bpc_{f}L" for f in factors)]
    done = {}
    if (out / "extrapolation.csv").is_file():
        done = {(r["run"], r["step"]): [r[h] for h in header]
                for r in read_csv(out / "extrapolation.csv") if list(r) == header}
    present = find_runs(runs)
    rows = [r for (name, _), r in done.items() if name not in present]  # exported in another session
    for name, (variant, seed) in present.items():
        path = resolve_checkpoint(runs / name)
        ckpt = load_checkpoint(path)
        done_test = ckpt["metrics"].get("test_bpc")  # None where a non-finite step ended the run
        cached = done.get((name, str(ckpt["step"])))
        if cached and (done_test is None or cached[header.index("bpc_1L")] == f"{done_test:.5f}"):
            rows.append(cached)
            continue
        model = load_model(path)
        L = model.cfg.seq_len
        bpc = analysis.bpc_at_lengths(model, test, [f * L for f in factors if f != 1 or done_test is None])
        bpc.setdefault(L, done_test)
        rows.append([name, variant, seed, ckpt["step"],
                     *("" if bpc[f * L] is None else f"{bpc[f * L]:.5f}" for f in factors)])
        write_csv(out / "extrapolation.csv", header, rows)  # progress survives an interruption
        print(f"{name}: " + ", ".join(f"{f}L {bpc[f * L]}" for f in factors), file=sys.stderr)
    write_csv(out / "extrapolation.csv", header, rows)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    by_variant = defaultdict(list)
    for r in read_csv(out / "extrapolation.csv"):
        by_variant[r["variant"]].append(r)
    for variant, rs in sorted(by_variant.items()):
        cols = [c for c in rs[0] if c.startswith("bpc_") and all(r[c] for r in rs)]
        xs = [int(c[4:-1]) for c in cols]
        means = [statistics.mean(float(r[c]) for r in rs) for c in cols]
        ax.plot(xs, means, "o-", color=COLORS.get(variant), label=f"{variant} (n={len(rs)})")
    ax.set(xscale="log", xlabel="eval window / training length L", ylabel="test BPC",
           title="Length extrapolation (mean over seeds)")
    ax.set_xticks([1, 2, 4, 8], ["L", "2L", "4L", "8L"])
    ax.set_xticks([], minor=True)
    _save(fig, out / "extrapolation.png", [ax])



def rowsums(runs: Path, out: Path, corpus: str, data_dir: str, factors=FACTORS,
            tokens: int = 8192) -> None:
    """Row sums of W in every layer and head of every finished run, on test windows of f * L
    (``tokens`` tokens per factor, as many as the split holds, from the start of the test split). Per run and
    factor: mean, 5th percentile and min over layers, heads, positions and windows, the mean
    over the window's last L positions (past the training length for f > 1), and the share
    below ``ROW_SUM_FLOOR``. ``rowsums_lengths.png``: the mean row sum by position at 8L."""
    from ..attention import ROW_SUM_FLOOR

    test = data.load_split(data.prepare_corpus(corpus, data_dir)["test"])
    header = ["run", "variant", "seed", "step", "factor", "mean", "median", "p05", "p95", "min", "max",
              "mean_last_L", "median_last_L", "frac_below_floor", "frac_abs_above_2"]
    present = find_runs(runs)
    rows, curves, n_windows = [], {}, 0
    if (out / "rowsums_lengths.csv").is_file():  # runs measured in another session stay
        rows = [[r[h] for h in header] for r in read_csv(out / "rowsums_lengths.csv")
                if r["run"] not in present and list(r) == header]
    for name, variant, seed, path, model in _final_models(runs):
        L, step = model.cfg.seq_len, load_checkpoint(path)["step"]
        for f in factors:
            n = f * L
            windows = min(max(1, tokens // n), len(test) // n)
            if windows == 0:
                continue  # the test split is shorter than one window
            sums = torch.stack([analysis.row_sums(model, torch.from_numpy(test[i * n:(i + 1) * n].astype("int64")))
                                for i in range(windows)])  # (windows, depth, H, n)
            flat, last = sums.flatten(), sums[..., -L:].flatten()
            q = torch.quantile(flat, torch.tensor([0.05, 0.5, 0.95], dtype=flat.dtype))
            rows.append([name, variant, seed, step, f, *(f"{x:.5f}" for x in (
                flat.mean(), q[1], q[0], q[2], flat.min(), flat.max(), last.mean(), last.median(),
                (flat < ROW_SUM_FLOOR).double().mean(), (flat.abs() > 2).double().mean()))])
            if f == max(factors) and seed == 0:
                curves[variant], n_windows = sums.mean((0, 1, 2)), windows
        print(f"{name}: row sums at " + ", ".join(f"{r[4]}L {r[5]}" for r in rows if r[0] == name),
              file=sys.stderr)
    write_csv(out / "rowsums_lengths.csv", header, rows)
    if not curves:
        return  # no seed-0 run here: the figure of an earlier session stays
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in [v for v in ORDER if v in curves]:
        ax.plot(curves[variant].numpy(), color=COLORS.get(variant), lw=1, label=variant,
                ls="--" if variant == "rope_norm" else "-")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.axvline(L, color="k", lw=0.5, ls=":")
    ax.set(xlabel="query position m (dotted: training length L)", ylabel="mean row sum of W",
           title=f"Row sums at {max(factors)}L, seed 0: mean of layers, heads and {n_windows} test windows")
    ax.title.set_fontsize(9)
    _save(fig, out / "rowsums_lengths.png", [ax])
    print(f"wrote {out}/rowsums_lengths.csv, rowsums_lengths.png", file=sys.stderr)


def decay(out: Path, dims=(64, 266), max_distance: int = 1024) -> None:
    bounds = {d: analysis.rope_decay_bound(d, max_distance) for d in dims}
    write_csv(out / "decay.csv", ["distance", *(f"bound_d{d}" for d in dims)],
              ([r, *(f"{bounds[d][r].item():.6f}" for d in dims)] for r in range(max_distance + 1)))
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for d in dims:
        label = f"d = {d}" + (" (head dim)" if d == 64 else " (features m, rotated by Eq. 19)")
        axes[0].plot(bounds[d].numpy(), label=label)
        axes[1].plot(range(1, max_distance + 1), (bounds[d][1:] / bounds[d][0]).numpy(), label=label)
    axes[0].set(xlabel="relative distance", ylabel="relative upper bound: mean_j |S_j|",
                title="Long-term decay of RoPE (RoFormer Fig. 2)")
    axes[1].set(xscale="log", xlabel="relative distance", ylabel="bound / bound at distance 0",
                title="Normalised by the value at distance 0")
    _save(fig, out / "decay.png", axes)
    print(f"wrote {out}/decay.csv, decay.png", file=sys.stderr)


