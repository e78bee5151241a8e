"""Strict causality: how much do outputs at positions < t move when only keys at >= t change?

    python -m benchmarks.leak [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.leak``).
"""
from __future__ import annotations

import statistics
import warnings

import torch

from linear_rope import FavorFeatures
from linear_rope import rotary_linear_attention

from .common import cli, fmt, report, target

NAME = "leak"


def measure(trials: int = 20, N: int = 1024, t: int = 400, d: int = 64, m: int = 266, heads: int = 4) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from performer_pytorch.performer_pytorch import FastAttention
    theirs_abs, theirs_rel, ours_abs, ours_rel = [], [], [], []
    for trial in range(trials):
        g = torch.Generator().manual_seed(trial)
        q, k, v = (torch.randn(1, heads, N, d, generator=g, dtype=torch.float64) for _ in range(3))
        k2 = k.clone()
        k2[:, :, t:] = torch.randn(k2[:, :, t:].shape, generator=g, dtype=torch.float64)
        torch.manual_seed(trial)
        f = FavorFeatures(d, m).double()
        fa = FastAttention(d, m, causal=True).double()
        fa.projection_matrix.copy_(f.projection)
        for fn, a_list, r_list in (
            (lambda kk: fa(q, kk, v), theirs_abs, theirs_rel),
            (lambda kk: rotary_linear_attention(q, kk, v, projection=f.projection, rotary=False), ours_abs, ours_rel),
        ):
            before, after = fn(k)[:, :, :t], fn(k2)[:, :, :t]
            diff = (after - before).abs().amax(-1)  # per position
            a_list.append(diff.max().item())
            r_list.append((diff / before.abs().amax(-1)).max().item())
    summary = lambda xs: {"max": max(xs), "median": statistics.median(xs)}
    return {
        "setup": dict(trials=trials, N=N, t=t, d=d, m=m, heads=heads, dtype="float64"),
        "performer_pytorch": {"abs": summary(theirs_abs), "rel": summary(theirs_rel)},
        "ours": {"abs": summary(ours_abs), "rel": summary(ours_rel)},
    }


def main(quick: bool = False, out_dir=None) -> dict:
    res = measure(trials=3, N=128, t=50, heads=1) if quick else measure()
    s = res["setup"]
    rows = [[name, fmt(r["abs"]["max"]), fmt(r["rel"]["median"]), fmt(r["rel"]["max"])]
            for name, r in (("performer", res["performer_pytorch"]), ("ours", res["ours"]))]
    result = {
        "name": NAME, "quick": quick, "config": s, **res,
        "table": {"headers": ["impl", "abs change, max", "rel change, median", "rel change, max"], "rows": rows},
        "targets": [target("ours: max change of past outputs when only future keys change", res["ours"]["abs"]["max"], "<=", 1e-12)],
        "notes": [f"keys at positions >= {s['t']} replaced; change of the outputs at positions < {s['t']} "
                  f"(N={s['N']}, d={s['d']}, m={s['m']}, {s['heads']} heads, {s['trials']} trials, float64, same "
                  "projection); rel = per-position max change / that position's max |output|."],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
