"""Attention maps: one head's Eq. 19 weight matrix and every head's row sums, per variant (PNG and
TensorBoard images)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..enwik8 import data
from ..enwik8.checkpoint import load_checkpoint, resolve_checkpoint
from . import analysis
from .runs import COLORS, _final_models, _plt, _save, write_csv


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


