"""fla's layout against ours: ``chunk_rotary_linear_attn`` (`[B, T, H, .]`) against the op it wraps.

    python -m benchmarks.fla_layout [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.fla_layout``).
"""
from __future__ import annotations


import torch
from torch.profiler import profile

from linear_rope import FavorFeatures, chunk_rotary_linear_attn, rotary_linear_attention

from .common import cli, interleaved, load_average, machine_info, median, report, setup, target

NAME = "fla_layout"
B, H, D, M = 2, 6, 64, 266
FULL = dict(n=4096, rounds=9, budget_s=150.0)
QUICK = dict(n=96, rounds=1, budget_s=5.0)
TARGET = 1.1
BASELINE = {"fla/favor": "op/favor", "fla/favor+contiguous": "op/favor", "fla/features": "op/features"}


def profiled_ms(fn) -> dict:
    """One profiled call: its whole time and its time in copies (self CPU, ms)."""
    with profile() as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3
    return {"total_ms": total, "copy_ms": sum(e.self_cpu_time_total for e in events if e.key == "aten::copy_") / 1e3}


def make_calls(n: int, w: torch.Tensor) -> dict:
    """name -> zero-argument fwd+bwd call."""
    g = torch.Generator().manual_seed(0)

    def inputs(x: int, heads_first: bool, features: bool):
        shape = (B, H, n) if heads_first else (B, n, H)
        make = (lambda s: torch.rand(s, generator=g) + 0.01) if features else (lambda s: torch.randn(s, generator=g))
        q, k = make((*shape, x)), make((*shape, x))
        v, up = torch.randn(*shape, D, generator=g), torch.randn(*shape, D, generator=g)
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), up

    def call(fn, inp, proj, contiguous=False):
        q, k, v, up = inp

        def run():
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v, proj)
            out = out.contiguous() if contiguous else out
            out.backward(up)
        return run

    op = lambda q, k, v, p: rotary_linear_attention(q, k, v, projection=p)  # noqa: E731
    fla = lambda q, k, v, p: chunk_rotary_linear_attn(q, k, v, projection=p)[0]  # noqa: E731
    fav_op, fav_fla = inputs(D, True, False), inputs(D, False, False)
    fea_op, fea_fla = inputs(M, True, True), inputs(M, False, True)
    return {
        "op/favor": call(op, fav_op, w), "fla/favor": call(fla, fav_fla, w),
        "fla/favor+contiguous": call(fla, fav_fla, w, contiguous=True), "op/features": call(op, fea_op, None),
        "fla/features": call(fla, fea_fla, None),
    }


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    load_before = "load average: " + load_average()
    w = FavorFeatures(D, M).projection
    calls = make_calls(cfg["n"], w)
    times = interleaved(calls, warmup=1, rounds=cfg["rounds"], budget_s=cfg["budget_s"])
    ms = {k: 1e3 * median(t) for k, t in times.items()}
    ratio = {k: ms[k] / ms[b] for k, b in BASELINE.items()}
    prof = {k: profiled_ms(calls[k]) for k in ("op/favor", "fla/favor", "op/features", "fla/features")}
    copies = {k: (prof[k]["copy_ms"] - prof[b]["copy_ms"]) / prof[b]["total_ms"]
              for k, b in (("fla/favor", "op/favor"), ("fla/features", "op/features"))}
    rows = [[k, ms[k], BASELINE.get(k, "-"), ratio.get(k, "-")] for k in calls]
    rounds = len(times["op/favor"])
    result = {
        "name": NAME, "quick": quick,
        "config": {"n": cfg["n"], "B": B, "H": H, "d": D, "m": M, "e": D, "rounds": rounds, "dtype": "float32",
                   "threads": torch.get_num_threads()},
        "machine": machine_info(), "load": {"before": load_before, "after": "load average: " + load_average()},
        "ms": ms, "times_s": times, "ratio": ratio, "profile": prof, "extra_copy_share": copies,
        "table": {"headers": ["call (fwd+bwd)", "ms", "against", "ratio"], "rows": rows},
        "targets": [target(f"{k} / {BASELINE[k]} fwd+bwd time, N={cfg['n']}", ratio[k], "<=", TARGET)
                    for k in BASELINE]
        + [target(f"{k}: extra copy time / op time (profiled), N={cfg['n']}", copies[k], "<=", TARGET - 1)
           for k in copies],
        "notes": [f"medians of {rounds} interleaved rounds; causal Eq. 19, fp32, inputs contiguous in each call's "
                  f"own layout; the fla calls copy q, k, v transposed (contiguous) into the op and return its output transposed (a view)."]
        + [f"profiled {k}: {prof[k]['total_ms']:.0f} ms, of which copies {prof[k]['copy_ms']:.0f} ms" for k in prof],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
