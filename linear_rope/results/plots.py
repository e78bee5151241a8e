"""Results tables and figures from finished runs (matplotlib: ``pip install -e ".[plot]"``).

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
summary.json. Every figure is drawn from the CSV / JSON written beside it.
"""
from __future__ import annotations

import csv
import io
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from ..enwik8 import data
from ..enwik8.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint
from ..enwik8.cli import OneLineParser
from ..enwik8.files import atomic_write
from ..enwik8.sample import load_model
from ..enwik8.trainer import NONFINITE_FILE
from . import analysis

RUN = re.compile(r"^(?P<variant>[a-z_]+)-seed(?P<seed>\d+)$")
COLORS = {"rope": "tab:red", "none": "tab:gray", "absolute": "tab:blue", "rope_pre": "tab:green",
          "rope_norm": "tab:purple", "softmax": "black"}
ORDER = ("softmax", "rope", "rope_pre", "rope_norm", "absolute", "none")
FACTORS = (1, 2, 4, 8)
# The folder under results/ whose summary.json gives the README's headline table.
HEADLINE = "cpu40m"
BLOCK = re.compile(r"<!-- tables:(\w+) begin -->\n.*?<!-- tables:\1 end -->", re.S)
TAGS = ("train/loss", "train/bpc", "val/bpc", "lr", "grad/norm", "test/bpc", "train/skipped_steps")


class ResultsError(Exception):
    """Nothing to plot, or no matplotlib (the CLI prints it and exits 2)."""


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ResultsError('matplotlib is not installed; pip install -e ".[plot]"') from None
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


def attention(runs: Path, out: Path, corpus: str, data_dir: str, layer: int | None = None,
              head: int = 0, windows: int = 16) -> None:
    """Seed 0 of each variant, middle layer: one head's W on the first test window, and every
    head's row sums, averaged over the first ``windows`` test windows."""
    from torch.utils.tensorboard import SummaryWriter

    plt = _plt()
    test = data.load_split(data.prepare_corpus(corpus, data_dir)["test"])
    models = [m for m in _final_models(runs) if m[2] == 0]
    if not models:
        print(f"attention: no seed-0 run in {runs}; its figures stay as they are", file=sys.stderr)
        return
    rows, sums = [], {}
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 4), squeeze=False)
    for ax, (name, variant, _, _, model) in zip(axes[0], models):
        L, li = model.cfg.seq_len, model.cfg.depth // 2 if layer is None else layer
        acc = torch.zeros(model.cfg.heads, L, dtype=torch.float64)
        for i in range(windows):
            ids = torch.from_numpy(test[i * L:(i + 1) * L].astype("int64"))
            for h in range(model.cfg.heads):
                wh, s = analysis.eq19_weights(model, ids, li, h)
                acc[h] += s / windows
                if i == 0 and h == head:
                    w = wh
        sums[variant] = acc  # (H, N)
        rows += [[variant, li, h, n, f"{acc[h, n].item():.6f}"] for h in range(model.cfg.heads)
                 for n in range(L)]
        lim = w.tril().abs().flatten().quantile(0.99).item()  # a few spikes would wash it out
        im = ax.imshow(w.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set(xlabel="key n", ylabel="query m")
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_title(f"{variant}: layer {li}, head {head}\n(colours clipped at the 99th pct of |W|)",
                     fontsize=10)
        with SummaryWriter(runs / name) as writer:  # beside the run's curves in TensorBoard
            step = load_checkpoint(resolve_checkpoint(runs / name))["step"]
            img = ((w / lim).clamp(-1, 1) + 1) / 2  # [-lim, lim] -> [0, 1]
            writer.add_image(f"attention/eq19_weights_layer{li}_head{head}", img[None].float(), step)
            f2, a2 = plt.subplots(figsize=(5, 3))
            for h in range(model.cfg.heads):
                a2.plot(acc[h].numpy(), lw=0.8, label=f"head {h}")
            a2.axhline(1.0, color="k", lw=0.5)
            a2.set(xlabel="query position m", ylabel="row sum of W", title=f"{variant}, layer {li}")
            a2.legend(fontsize=7)
            writer.add_figure(f"attention/row_sums_layer{li}", f2, step)  # closes f2
    _save(fig, out / "attention_weights.png")
    write_csv(out / "attention_rowsums.csv", ["variant", "layer", "head", "position", "row_sum"], rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, s in sorted(sums.items()):
        ax.plot(s.mean(0).numpy(), color=COLORS.get(variant), label=f"{variant} (mean of heads)")
        ax.fill_between(range(s.shape[1]), s.min(0).values.numpy(), s.max(0).values.numpy(),
                        color=COLORS.get(variant), alpha=0.15)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set(xlabel="query position m", ylabel="sum_n W[m, n]")
    ax.set_title(f"Row sums of W, layer {li}: mean of {windows} test windows\n"
                 f"(line: mean of heads; band: min-max over heads)", fontsize=10)
    _save(fig, out / "attention_rowsums.png", [ax])
    print(f"wrote {out}/attention_*.png", file=sys.stderr)


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


def _mean_std(xs: list[float]) -> dict:
    return {"mean": statistics.mean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "n": len(xs), "values": xs}


def summary(runs: Path, out: Path) -> dict:
    """summary.json from the exported curves (and extrapolation.csv when present); val figure."""
    meta = _read_meta(out)
    if not meta:
        raise ResultsError(f"no exported runs in {out} (run export first)")
    variants, cfgs = defaultdict(dict), {}
    for name, m in meta.items():
        variants[m["variant"]][m["seed"]] = read_csv(out / "curves" / f"{name}.csv")
        cfgs[name] = m

    col = _col
    result = {"variants": {}}
    none_final = None
    if "none" in variants:
        none_final = statistics.mean(col(rs, "val/bpc")[-1][1] for rs in variants["none"].values())
    for variant, seeds in sorted(variants.items()):
        seeds = dict(sorted(seeds.items()))  # every per-seed list below follows "seeds"
        val = [col(rs, "val/bpc")[-1][1] for rs in seeds.values()]
        # per seed, None where a non-finite step ended the run before its test
        test_per_seed = [c[-1][1] if (c := col(rs, "test/bpc")) else None for rs in seeds.values()]
        test = [x for x in test_per_seed if x is not None]
        entry = {"seeds": sorted(seeds), "steps": [col(rs, "val/bpc")[-1][0] for rs in seeds.values()],
                 "wall_minutes": [cfgs[f"{variant}-seed{s}"]["wall_minutes"] for s in seeds],
                 "final_val_bpc": _mean_std(val), "final_test_bpc": _mean_std(test) if test else None,
                 # the lowest val BPC of each seed and its step: did it get worse after it?
                 "best_val_bpc": [list(min(col(rs, "val/bpc"), key=lambda sv: sv[1])) for rs in seeds.values()],
                 "test_bpc_per_seed": test_per_seed,
                 # per seed: the largest rise of val BPC from one evaluation to the next (0: none)
                 "max_val_rise": [_max_rise(col(rs, "val/bpc")) for rs in seeds.values()],
                 # the training BPC of the last few hundred steps (EMA) beside val: do they part?
                 "final_train_bpc_smoothed": _mean_std([_smooth(col(rs, "train/bpc"))[-1][1]
                                                        for rs in seeds.values()]),
                 "train_bytes": [col(rs, "val/bpc")[-1][0] * _bytes_per_step(cfgs[f"{variant}-seed{s}"]["config"])
                                 for s, rs in seeds.items()],
                 "val_bpc_by_step": {str(step): _mean_std([dict(col(rs, "val/bpc"))[step] for rs in seeds.values()
                                                           if step in dict(col(rs, "val/bpc"))])
                                     for step in sorted({st for rs in seeds.values() for st, _ in col(rs, "val/bpc")})},
                 "ended_nonfinite_at_step": [(cfgs[f"{variant}-seed{s}"].get("ended_nonfinite") or {}).get("step")
                                             for s in seeds],
                 # updates skipped as non-finite (--on-nonfinite skip), per seed
                 "skipped_steps": [int(c[-1][1]) if (c := col(rs, "train/skipped_steps")) else 0
                                   for rs in seeds.values()]}
        if none_final is not None:
            entry["steps_to_none_final_val"] = [analysis.steps_to_reach(col(rs, "val/bpc"), none_final)
                                                for rs in seeds.values()]
            entry["steps_to_none_final_val_smoothed_train"] = [
                analysis.steps_to_reach(_smooth(col(rs, "train/bpc")), none_final)
                for rs in seeds.values()]
        mean_curve = [(int(st), d["mean"]) for st, d in entry["val_bpc_by_step"].items() if d["n"] == len(seeds)]
        fit = analysis.fit_power_law(mean_curve)
        if fit:  # where the mean val curve points, and how far that kind of projection has been off
            to = analysis.power_law_steps_to(fit, TARGET_VAL_BPC)
            per_step = _bytes_per_step(cfgs[f"{variant}-seed{min(seeds)}"]["config"])
            entry["val_power_law"] = {**fit, "target": TARGET_VAL_BPC, "steps_to_target": to,
                                      "train_bytes_to_target": None if to is None else to * per_step,
                                      "backtest": analysis.backtest_power_law(mean_curve)}
        jumps = [_redraw_jumps(col(rs, "train/bpc"),
                               cfgs[f"{variant}-seed{s}"]["config"]["model"].get("feature_redraw_interval", 0))
                 for s, rs in seeds.items()]
        if any(jumps):
            entry["redraw_jump_train_bpc"] = _mean_std([statistics.mean(j) for j in jumps if j])
        result["variants"][variant] = entry
    result["none_final_val_bpc_mean"] = none_final
    result["paired_final_val_bpc"] = _paired(result["variants"])
    if (out / "extrapolation.csv").is_file():
        ext = defaultdict(lambda: defaultdict(list))
        for r in read_csv(out / "extrapolation.csv"):
            for c, v in r.items():
                if c.startswith("bpc_") and v:
                    ext[r["variant"]][c[4:]].append(float(v))
        result["extrapolation_test_bpc"] = {v: {k: _mean_std(xs) for k, xs in d.items()}
                                            for v, d in ext.items()}
    if (out / "attention_rowsums.csv").is_file():
        rs = defaultdict(list)
        for r in read_csv(out / "attention_rowsums.csv"):
            rs[r["variant"]].append(float(r["row_sum"]))
        result["attention_row_sums"] = {v: {"min": min(x), "max": max(x),
                                            "mean_abs_dev_from_1": statistics.mean(abs(a - 1) for a in x)}
                                        for v, x in rs.items()}
    if (out / "rowsums_lengths.csv").is_file():
        rl = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
        for r in read_csv(out / "rowsums_lengths.csv"):
            for c in ("mean", "median", "p05", "p95", "min", "max", "mean_last_L", "median_last_L",
                      "frac_below_floor", "frac_abs_above_2"):
                rl[r["variant"]][f"{r['factor']}L"][c].append(float(r[c]))
        result["row_sums_at_lengths"] = {v: {f: {c: _mean_std(xs) for c, xs in cs.items()}
                                             for f, cs in d.items()} for v, d in rl.items()}
    atomic_write(out / "summary.json", json.dumps(result, indent=2) + "\n")
    _curves_figure(variants, out / "val_bpc.png")
    print(f"wrote {out}/summary.json, val_bpc.png", file=sys.stderr)
    return result


def _max_rise(curve: list[tuple[int, float]]) -> float:
    """The largest increase from one point of ``curve`` to the next (0.0 if it never rises)."""
    return max([b - a for (_, a), (_, b) in zip(curve, curve[1:])] + [0.0])


TARGET_VAL_BPC = 2.0  # issue 24's target for the best linear variant (mean of 3 seeds)
PAIRS = (("rope", "rope_pre"), ("rope_norm", "rope_pre"), ("none", "rope_pre"),
         ("rope", "none"), ("rope_pre", "none"), ("rope_norm", "none"))


def _paired(variants: dict) -> dict:
    """Final val BPC differences ``a - b`` over the seeds both variants ran (runs with the same
    seed share the initial weights, the projections and the data order): every variant against
    ``softmax``, and the pairs of ``PAIRS``. ``{"a - b": mean, std, n, values, seeds}``."""
    pairs = [(v, "softmax") for v in ORDER if v != "softmax"] + list(PAIRS)
    out = {}
    for a, b in pairs:
        if a not in variants or b not in variants:
            continue
        va, vb = (dict(zip(variants[x]["seeds"], variants[x]["final_val_bpc"]["values"])) for x in (a, b))
        seeds = sorted(set(va) & set(vb))
        if seeds:
            out[f"{a} - {b}"] = {**_mean_std([va[s] - vb[s] for s in seeds]), "seeds": seeds}
    return out


def _redraw_jumps(curve: list[tuple[int, float]], interval: int, width: int = 50) -> list[float]:
    """Train BPC in the ``width`` steps after each FAVOR+ redraw minus the ``width`` steps before
    it: what a new random projection costs the model at once (one value per redraw)."""
    if not interval:
        return []
    last = curve[-1][0] if curve else 0
    out = []
    for r in range(interval, last - width + 1, interval):
        before = [v for s, v in curve if r - width < s <= r]
        after = [v for s, v in curve if r < s <= r + width]
        if before and after:
            out.append(statistics.mean(after) - statistics.mean(before))
    return out


def _bytes_per_step(cfg: dict) -> int:
    t = cfg["train"]
    return t["batch_size"] * t["grad_accum"] * cfg["model"]["seq_len"] * cfg.get("world_size", 1)


def _col(rows, tag):
    return [(int(r["step"]), float(r[tag])) for r in rows if r.get(tag)]


def _curves_figure(variants: dict, path: Path) -> None:
    """Val BPC (left) and smoothed train BPC (right), mean +- std over seeds, per variant."""
    col = _col
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for variant, seeds in sorted(variants.items()):
        for ax, tag in zip(axes, ("val/bpc", "train/bpc")):
            series = [col(rs, tag) for rs in seeds.values()]
            if tag == "train/bpc":
                series = [_smooth(s) for s in series]
            n = min(len(s) for s in series)
            steps = [s for s, _ in series[0][:n]]
            ys = torch.tensor([[v for _, v in s[:n]] for s in series])
            mean, std = ys.mean(0), ys.std(0) if len(series) > 1 else torch.zeros(n)
            ax.plot(steps, mean, "o-" if tag == "val/bpc" else "-", ms=3,
                    color=COLORS.get(variant), label=f"{variant} (n={len(series)})")
            ax.fill_between(steps, mean - std, mean + std, color=COLORS.get(variant), alpha=0.2)
    axes[0].set(xlabel="step", ylabel="val BPC (whole split)", title="Validation BPC, mean ± std")
    axes[1].set(xlabel="step", ylabel="train BPC (EMA 0.9)", title="Training BPC, mean ± std",
                ylim=(None, 5))
    _save(fig, path, axes)


def _ms(d, digits=3) -> str:
    """``mean ± std`` of a summary entry (``mean`` alone for one seed, ``–`` for none)."""
    return "–" if not d else (f"{d['mean']:.{digits}f} ± {d['std']:.{digits}f}" if d["n"] > 1
                              else f"{d['mean']:.{digits}f}")


def headline(out: Path) -> str:
    """The top-level README's one results table: final val and test BPC per variant, mean ± std
    over seeds, from ``summary.json``."""
    s = json.loads((out / "summary.json").read_text())
    lines = ["| variant | seeds | final val BPC | final test BPC |", "|---|---|---|---|"]
    for v in (v for v in ORDER if v in s["variants"]):
        e = s["variants"][v]
        lines.append(f"| `{v}` | {len(e['seeds'])} | {_ms(e['final_val_bpc'])} | {_ms(e['final_test_bpc'])} |")
    return "\n".join(lines)


def tables(out: Path) -> str:
    """The results report's tables (markdown, the reports under ``results/``) from ``summary.json``."""
    s = json.loads((out / "summary.json").read_text())
    ms = _ms
    order = [v for v in ORDER if v in s["variants"]]
    lines = ["| variant | seeds | training bytes per run | final val BPC | final test BPC | final train "
             "BPC (EMA) | steps to reach `none`'s final val BPC (val curve / smoothed train curve) | "
             "train BPC jump at a FAVOR+ redraw | updates skipped (non-finite) | minutes per run |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v in order:
        e = s["variants"][v]

        def reach(key):
            xs = e.get(key) or []
            return ", ".join("never" if x is None else f"{x:.0f}" for x in xs) or "–"
        ended = e.get("ended_nonfinite_at_step") or [None] * len(e.get("train_bytes") or [])
        tb = sorted(set(f"{b / 1e6:.1f}M" + (f" (stopped: non-finite at step {x})" if x else "")
                        for b, x in zip(e.get("train_bytes") or [], ended)))
        lines.append(f"| `{v}` | {len(e['seeds'])} | {', '.join(tb) or '–'} | "
                     f"{ms(e['final_val_bpc'])} | {ms(e['final_test_bpc'])} | "
                     f"{ms(e.get('final_train_bpc_smoothed'))} | {reach('steps_to_none_final_val')} / "
                     f"{reach('steps_to_none_final_val_smoothed_train')} | {ms(e.get('redraw_jump_train_bpc'))} | "
                     f"{', '.join(str(n) for n in e['skipped_steps']) if 'skipped_steps' in e else '–'} | "
                     f"{', '.join(f'{m:.0f}' for m in e['wall_minutes'])} |")
    if order:  # every seed: its lowest val and its largest rise, which the means hide
        lines += ["", "| variant | seed | final val BPC | final test BPC | lowest val BPC (step) | "
                  "largest val BPC rise between evaluations | updates skipped | minutes |",
                  "|---|---|---|---|---|---|---|---|"]
        for v in order:
            e = s["variants"][v]
            test = e.get("test_bpc_per_seed") or [None] * len(e["seeds"])
            for i, seed in enumerate(e["seeds"]):
                best = (e.get("best_val_bpc") or [None] * len(e["seeds"]))[i]
                lines.append(f"| `{v}` | {seed} | {e['final_val_bpc']['values'][i]:.3f} | "
                             + ("–" if test[i] is None else f"{test[i]:.3f}") + " | "
                             + (f"{best[1]:.3f} ({best[0]})" if best else "–") + " | "
                             + (f"{e['max_val_rise'][i]:.3f}" if "max_val_rise" in e else "–") + " | "
                             f"{e['skipped_steps'][i] if 'skipped_steps' in e else '–'} | "
                             f"{e['wall_minutes'][i]:.0f} |")
    paired = s.get("paired_final_val_bpc")
    if paired:
        lines += ["", "| final val BPC difference (same seeds) | mean ± std | per seed |", "|---|---|---|"]
        for name, d in paired.items():
            a, b = name.split(" - ")
            lines.append(f"| `{a}` − `{b}` | {ms(d)} | "
                         + ", ".join(f"{x:+.3f} (seed {sd})" for x, sd in zip(d["values"], d["seeds"])) + " |")
    by_step = {v: s["variants"][v].get("val_bpc_by_step") for v in order}
    steps = sorted({int(k) for d in by_step.values() if d for k in d})
    if steps:
        lines += ["", "| val BPC at step (mean over seeds) | " + " | ".join(str(x) for x in steps) + " |",
                  "|---|" + "---|" * len(steps)]
        for v in order:
            d = by_step[v] or {}
            lines.append(f"| `{v}` | " + " | ".join(f"{d[str(x)]['mean']:.3f}" if str(x) in d else "–"
                                                   for x in steps) + " |")
    fits = {v: s["variants"][v]["val_power_law"] for v in order if s["variants"][v].get("val_power_law")}
    if fits:
        lines += ["", "| variant: mean val curve fitted as a + b·step^−c | from step (points; rmse) | fitted floor a "
                  "| step where the fit reaches " + f"{TARGET_VAL_BPC} val BPC (training bytes) | backtest: fitted "
                  "to half the run, predicted − measured final val BPC |", "|---|---|---|---|---|"]
        for v, f in fits.items():
            to, bt, last = f["steps_to_target"], f.get("backtest"), max(s["variants"][v]["steps"])
            reach = ("not projected (rmse above 0.05: the curve is too rough)" if f["rmse"] > 0.05 else
                     "never (floor above target)" if to is None else
                     "beyond 100× this run" if to > 100 * last else
                     f"{to:.0f} ({f['train_bytes_to_target'] / 1e6:.0f}M)")
            lines.append(f"| `{v}` | {f['from_step']} ({f['n']}; {f['rmse']:.3f}) | {f['a']:.3f} | {reach} | "
                         + ("–" if not bt else f"{bt['predicted']:.3f} − {bt['measured']:.3f} = {bt['error']:+.3f} "
                                               f"(fit to step {bt['fit_to_step']})") + " |")
    ext = s.get("extrapolation_test_bpc")
    if ext:
        cols = ["1L", "2L", "4L", "8L"]
        lines += ["", "| variant | " + " | ".join(f"test BPC at {c}" for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for v in order:
            if v in ext:
                lines.append(f"| `{v}` | " + " | ".join(ms(ext[v].get(c)) for c in cols) + " |")
    rl = s.get("row_sums_at_lengths")
    if rl:
        cols = [c for c in ("1L", "2L", "4L", "8L") if any(c in rl[v] for v in rl)]
        lines += ["", "| variant: row sums of W, all layers and heads (mean over seeds) | "
                  + " | ".join(f"at {c}: median (5th, 95th pct); mean; share with abs > 2; last L median"
                               for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for v in order:
            if v in rl:
                cells = []
                for c in cols:
                    d = rl[v].get(c)
                    cells.append("–" if not d or "median" not in d else
                                 f"{d['median']['mean']:.3f} ({d['p05']['mean']:.3f}, {d['p95']['mean']:.3f}); "
                                 f"{d['mean']['mean']:.3f}; {d['frac_abs_above_2']['mean']:.2%}; "
                                 f"{d['median_last_L']['mean']:.3f}")
                lines.append(f"| `{v}` (n={len(rl[v][cols[0]]['mean']['values'])}) | " + " | ".join(cells) + " |")
    rs = s.get("attention_row_sums")
    if rs:
        lines += ["", "| variant (seed 0, middle layer) | min row sum | max row sum | "
                  "mean abs(row sum − 1) |", "|---|---|---|---|"]
        for v in order:
            if v in rs:
                r = rs[v]
                lines.append(f"| `{v}` | {r['min']:.3f} | {r['max']:.3f} | "
                             f"{r['mean_abs_dev_from_1']:.3f} |")
    return "\n".join(lines)


def fill(root: Path) -> list[Path]:
    """Rewrite every ``tables:<name>`` block of ``root``/README.md and ``root``/results/**/README.md
    from results/<name>/summary.json (``headline``: from results/``HEADLINE``). Returns the files
    changed."""
    changed = []
    for doc in [root / "README.md", *sorted((root / "results").glob("**/README.md"))]:
        text = doc.read_text()

        def block(m):
            name = m.group(1)
            body = headline(root / "results" / HEADLINE) if name == "headline" else tables(root / "results" / name)
            return f"<!-- tables:{name} begin -->\n{body}\n<!-- tables:{name} end -->"
        new = BLOCK.sub(block, text)
        if new != text:
            atomic_write(doc, new)
            changed.append(doc)
    return changed


def _smooth(curve: list[tuple[int, float]], beta: float = 0.9) -> list[tuple[int, float]]:
    """Exponential moving average with bias correction (TensorBoard-style smoothing)."""
    out, avg = [], 0.0
    for i, (s, v) in enumerate(curve):
        avg = beta * avg + (1 - beta) * v
        out.append((s, avg / (1 - beta ** (i + 1))))
    return out


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m linear_rope.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["all", "export", "extrapolate", "attention", "rowsums", "decay",
                                    "summary", "tables", "headline", "fill"])
    p.add_argument("--runs", default="runs/results", help="experiment dir of <variant>-seed<k> runs")
    p.add_argument("--data", default=None,
                   help="the corpus the runs trained on (for test windows; default: enwik8, as in training)")
    p.add_argument("--data-dir", default="data", help="split cache dir (default data)")
    p.add_argument("--out", default="results", help="where CSV/JSON/PNG files go (default results)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    out, runs = Path(args.out), Path(args.runs)
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
