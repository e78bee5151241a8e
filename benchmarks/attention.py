"""Attention op, both ways in: FAVOR+ inside (`projection=`) and features in, vs SDPA.

    python -m benchmarks.attention [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.attention``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linear_rope import FavorFeatures
from linear_rope.ops.chunk import CHUNK

from .common import (
    cli, fmt, gemm_n, gemm_probe, interleaved, machine_peak, median, ours_attention, ours_features_in,
    ours_path, report, setup, target,
)

NAME = "attention"
B, H, D, M = 1, 12, 64, 266
IMPLS = ("ours_inside", "ours_features_in", "sdpa")
OURS = ("ours_inside", "ours_features_in")
# warmup_n: one warmup call of every impl before the first round. efficiency_ns: where the
# efficiency targets are read (the FAVOR+-inside path; features in at the middle one only).
FULL = dict(ns=(1024, 1536, 2048, 4096, 16384), efficiency_ns=(1024, 4096, 16384), warmup_n=256,
            budget_s={16384: 110.0}, default_budget_s=45.0, max_rounds=5)
QUICK = dict(ns=(64, 96, 128), efficiency_ns=(64, 96, 128), warmup_n=32, budget_s={},
             default_budget_s=3.0, max_rounds=1)
SDPA_MAX_N = 16384  # exact attention is O(N^2) work
FLOP_CHUNK = 64  # the C of the FLOP count (fla's chunk size), independent of the op's own


def ours_flops(n: int, *, d: int = D, m: int = M, heads: int = B * H, chunk: int | None = None, backward: bool = True) -> float:
    """Analytic FLOPs of one ours call over all heads (formula in the module docstring)."""
    C = min(chunk or FLOP_CHUNK, n)
    nc = math.ceil(n / C)
    per_head = 4 * n * d * m + nc * (2 * C * C * m + 2 * C * C * d + 4 * C * m * d) + 2 * n * m
    return per_head * heads * (3 if backward else 1)


def sdpa_flops(n: int, *, d: int = D, heads: int = B * H, backward: bool = True) -> float:
    """Causal exact attention: QK^T and PV over the lower triangle, 2 N^2 d per head."""
    return 2 * n * n * d * heads * (3 if backward else 1)


def skip_reason(impl: str, n: int) -> str | None:
    """Why (impl, n) is not run, or None."""
    return f"O(N^2), {sdpa_flops(n) / 1e12:.0f} TFLOP/call" if impl == "sdpa" and n > SDPA_MAX_N else None


def make_op(impl: str, features: FavorFeatures):
    """impl name -> f(q, k, v) -> out, all `[B, H, N, d]`; Eq. 19 for ours."""
    if impl == "ours_inside":
        return lambda q, k, v: ours_attention(q, k, v, features, True)
    if impl == "ours_features_in":
        return lambda q, k, v: ours_features_in(q, k, v, features, True)
    if impl == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def make_inputs(n: int, seed: int = 0):
    """q, k, v `[B, H, n, D]` (requiring grad) and an upstream gradient, from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, up = (torch.randn(B, H, n, D, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), up


def make_call(op, q, k, v, up):
    """A zero-argument call running ``op`` once forward and backward; it keeps no output alive."""
    def call():
        for t in (q, k, v):
            t.grad = None
        op(q, k, v).backward(up)
    return call


def crossover(ratios: dict[int, float]) -> tuple[float | None, str]:
    """The N where sdpa / ours reaches 1, from {N: ratio}: interpolated in log N and log ratio
    between the last length below 1 and the next; (None, why) when it is not in the range."""
    ns = sorted(n for n, r in ratios.items() if r is not None)
    if not ns:
        return None, "not measured"
    if ratios[ns[0]] >= 1:
        return float(ns[0]), f"at or below N={ns[0]}, the shortest measured"
    for a, b in zip(ns, ns[1:]):
        ra, rb = ratios[a], ratios[b]
        if ra < 1 <= rb:
            t = -math.log(ra) / (math.log(rb) - math.log(ra))
            return math.exp(math.log(a) + t * (math.log(b) - math.log(a))), f"between N={a} and N={b}"
    return None, f"sdpa / ours < 1 up to N={ns[-1]}"


# The targets, all fwd+bwd.
EFFICIENCY_TARGETS = {("ours_inside", 1024): 0.5, ("ours_inside", 4096): 0.6, ("ours_inside", 16384): 0.6,
                      ("ours_features_in", 4096): 0.5}
SDPA_TARGETS = {4096: 2.5, 16384: 8.0}
CROSSOVER_TARGET = 1536


def attention_targets(ratio, efficiency, cross, quick: bool, ns) -> list[dict]:
    """The targets from the measured ratios, efficiencies and crossovers. Quick mode maps the
    lengths onto its own (the numbers mean nothing there)."""
    if quick:
        lo, mid, hi = ns[0], ns[1], ns[-1]
        eff = {("ours_inside", lo): 0.5, ("ours_inside", mid): 0.6, ("ours_inside", hi): 0.6,
               ("ours_features_in", mid): 0.5}
        sdpa, cross_t = {mid: 2.5, hi: 8.0}, mid
    else:
        eff, sdpa, cross_t = EFFICIENCY_TARGETS, SDPA_TARGETS, CROSSOVER_TARGET
    out = [target(f"{i} efficiency (yardstick / time / same-round GEMM rate), N={n}", efficiency.get((i, n)), ">=", t)
           for (i, n), t in eff.items()]
    for i in OURS:
        t = target(f"{i}: crossover N where sdpa / ours = 1", cross[i][0], "<=", cross_t)
        if cross[i][0] is None and cross[i][1] != "not measured":  # no crossover in the range: a MISS
            t["pass"] = False
        out.append(t)
        out += [target(f"sdpa / {i}, N={n}", ratio(i, n), ">=", t) for n, t in sdpa.items()]
    return out


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    features = FavorFeatures(D, M)
    impls = list(IMPLS)
    ops = {impl: make_op(impl, features) for impl in impls}
    warm = make_inputs(cfg["warmup_n"])
    for impl in impls:
        make_call(ops[impl], *warm)()
    ms: dict[str, dict[int, float]] = {i: {} for i in impls}
    raw, skipped, rounds, gemm_rate = {}, {}, {}, {}
    for n in cfg["ns"]:
        q, k, v, up = make_inputs(n)
        calls = {}
        for impl in impls:
            if why := skip_reason(impl, n):
                skipped[f"{impl}/{n}"] = why
            else:
                calls[impl] = make_call(ops[impl], q, k, v, up)
        gemm = calls["gemm"] = gemm_probe(gemm_n(quick))
        times = interleaved(calls, warmup=0, rounds=cfg["max_rounds"],
                            budget_s=cfg["budget_s"].get(n, cfg["default_budget_s"]))
        times.pop("gemm")
        gemm_rate[n] = median(gemm.rates)
        rounds[n] = max(len(t) for t in times.values())
        for impl, ts in times.items():
            ms[impl][n] = 1e3 * median(ts)
            raw[f"{impl}/{n}"] = ts
        print(f"N={n}: {rounds[n]} round(s), GEMM {fmt(gemm_rate[n])} GFLOP/s, "
              + ", ".join(f"{k} {fmt(1e3 * median(t))} ms" for k, t in times.items()), flush=True)
        del q, k, v, up

    def ratio(impl, n, over="sdpa"):
        a, b = ms[over].get(n), ms[impl].get(n)
        return a / b if a is not None and b else None

    eff = {(i, n): ours_flops(n) / (ms[i][n] / 1e3) / 1e9 / gemm_rate[n] for i in OURS for n in cfg["ns"] if n in ms[i]}
    cross = {i: crossover({n: ratio(i, n) for n in cfg["ns"]}) for i in OURS}
    rows = []
    for n in cfg["ns"]:
        cells = [n, ours_flops(n) / 1e9, gemm_rate[n]]
        for impl in impls:
            why = skipped.get(f"{impl}/{n}")
            cells.append(f"skipped ({why})" if why else ms[impl][n])
        cells += [eff[(i, n)] for i in OURS] + [ratio(i, n) for i in OURS]
        rows.append(cells)
    result = {
        "name": NAME, "quick": quick,
        "config": {"B": B, "H": H, "d": D, "m": M, "chunk": CHUNK, "ns": list(cfg["ns"]), "ours": ours_path(),
                   "max_rounds": cfg["max_rounds"], "rounds": rounds},
        "ms": ms, "times_s": raw, "skipped": skipped, "gemm_gflop_per_s_same_rounds": gemm_rate,
        "gemm_peak_gflop_per_s_at_start": machine_peak(quick),
        "yardstick_gflop": {n: ours_flops(n) / 1e9 for n in cfg["ns"]},
        "efficiency": {f"{i}/{n}": e for (i, n), e in eff.items()},
        "crossover": {i: {"n": c, "where": w} for i, (c, w) in cross.items()},
        "table": {"headers": ["N", "yardstick GFLOP", "GEMM GFLOP/s (same rounds)", *[f"{i} ms" for i in impls],
                              "inside efficiency", "features-in efficiency", "sdpa/inside", "sdpa/features-in"],
                  "rows": rows},
        "targets": attention_targets(ratio, eff, cross, quick, cfg["ns"]),
        "notes": [
            f"ours_inside = {ours_path()}; ours_features_in = FavorFeatures(q), FavorFeatures(k), then the op; "
            f"fwd+bwd, Eq. 19, medians of interleaved rounds: {rounds}.",
            *[f"{i}: crossover with sdpa {('at N ~ ' + fmt(c)) if c else 'not found'} ({w})." for i, (c, w) in cross.items()],
            "efficiency = yardstick GFLOP (the chunk-64 count, see ours_flops) / median time / the fp32 GEMM rate "
            "measured in the same rounds; glibc's default allocator (no mallopt).",
            f"skipped: {', '.join(f'{k} ({v})' for k, v in skipped.items()) or 'nothing'}.",
        ],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
