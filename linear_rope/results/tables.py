"""The numbers of the reports: ``summary`` (summary.json and the val-BPC figure), the markdown
``tables`` and ``headline``, and ``fill``, which rewrites the tables blocks of the README and reports."""
from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from ..enwik8.files import atomic_write
from . import analysis
from .runs import (
    COLORS,
    ORDER,
    ResultsError,
    _plt,
    _read_meta,
    _save,
    read_csv,
)

# The folder under results/ whose summary.json gives the README's headline table.
HEADLINE = "cpu40m"
BLOCK = re.compile(r"<!-- tables:(\w+) begin -->\n.*?<!-- tables:\1 end -->", re.S)


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
        result["variants"][variant] = _variant_entry(variant, seeds, cfgs, none_final)
    result["none_final_val_bpc_mean"] = none_final
    result["paired_final_val_bpc"] = _paired(result["variants"])
    result.update(_measured_extras(out))
    atomic_write(out / "summary.json", json.dumps(result, indent=2) + "\n")
    _curves_figure(variants, out / "val_bpc.png")
    print(f"wrote {out}/summary.json, val_bpc.png", file=sys.stderr)
    return result


def _variant_entry(variant: str, seeds: dict, cfgs: dict, none_final: float | None) -> dict:
    """One variant's part of summary.json: its seeds' final, best and per-step BPC, and what they
    say (rises, the power-law projection, redraw jumps)."""
    col = _col
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
    return entry


def _measured_extras(out: Path) -> dict:
    """What the sweeps beside the curves measured, where their CSVs exist: extrapolation, the
    attention rows' sums, and those sums at longer lengths."""
    result = {}
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
    return result


def _max_rise(curve: list[tuple[int, float]]) -> float:
    """The largest increase from one point of ``curve`` to the next (0.0 if it never rises)."""
    return max([b - a for (_, a), (_, b) in zip(curve, curve[1:])] + [0.0])


TARGET_VAL_BPC = 2.0  # the target val BPC for the best linear variant (mean of 3 seeds)
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
    order = [v for v in ORDER if v in s["variants"]]
    return "\n".join(_run_tables(s, order) + _curve_tables(s, order) + _sweep_tables(s, order))


def _run_tables(s: dict, order: list[str]) -> list[str]:
    """Each variant's runs: the means over seeds, then every seed."""
    ms = _ms
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
    return lines


def _curve_tables(s: dict, order: list[str]) -> list[str]:
    """The curves: paired differences, val BPC by step, the power-law fits."""
    ms, lines = _ms, []
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
    return lines


def _sweep_tables(s: dict, order: list[str]) -> list[str]:
    """The sweeps beside the runs: extrapolation, row sums at lengths, the attention rows' sums."""
    ms, lines = _ms, []
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
    return lines


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


