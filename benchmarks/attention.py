"""Attention op: ours (Eq. 19 `rope` / Eq. 18 `none` over FAVOR+) vs performer-pytorch and SDPA.

    python -m benchmarks.attention [--quick]

q, k, v `[1, 12, N, 64]` fp32, m = 266, causal, 2 threads, N in {1k, 2k, 4k, 16k}.

* ours_rope / ours_none: ``benchmarks.common.ours_attention``, Eq. 19 / Eq. 18 over FAVOR+
  features of q and k, through the public ``rotary_linear_attention`` with ``projection`` (features, RoPE and the
  chunked attention in one pass, hand-written backward) that ``RotaryLinearAttention`` uses.
* performer: performer-pytorch ``FastAttention(64, 266, causal=True)``, which on CPU falls back
  to ``causal_linear_attention_noncuda``.
* sdpa: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, exact softmax, O(N^2).

"fwd" runs under ``torch.no_grad()``; "fwd+bwd" is the forward plus ``backward`` of a fixed
random upstream gradient into q, k, v. Each N is timed in interleaved rounds (every impl and
mode once per round, the order rotating); the tables give medians. Every impl and mode is
warmed up once, at a small N (``warmup_n``) so that the warmup costs little: the rounds then
reuse warm code paths, and their calls take far longer than any first-call overhead. Rounds
stop at a time budget per N (at least one round).

The achieved rate of ours is compared with the GEMM rate measured in the same rounds at the
FLOP-count N (``common.gemm_probe``), not with a peak taken at another moment.

FLOPs of ours (``ours_flops``), per head, counting matmul work only (2 per multiply-add):

    feature projections   q and k, [N, d] @ [d, m] each              4 N d m
    chunked numerator     N/C chunks of C tokens, each:
        intra-chunk       (rq rk^T) C^2 m 2  +  (attn v) C^2 d 2
        inter-chunk       (rk^T v state) C m d 2  +  (rq S) C m d 2
    denominator           q . cumsum(k)                               2 N m

fwd+bwd = 3 x fwd (the usual estimate: the backward does two matmuls per forward matmul).
C = 64, fla's chunk size, whatever chunk the op runs with. Exp, rotation, masking and the
prefix sums are not counted, nor the masked half of each C^2 block. The op does more GEMM work
than this count: with rotation the denominator has its own masked GEMM per chunk (2 N C m in
the forward, twice that in the backward), and above ``KEEP_FEATURES_BYTES`` (N > ~20k here)
the backward recomputes the features (4 N d m) and the chunk states (2 N m d). The count leaves
these out: useful work is what the ratio to the GEMM rate should judge.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linear_rope import FavorFeatures

from .common import (
    cli,
    chunk_size, fmt, gemm_n, gemm_probe, interleaved, machine_peak, median, ours_attention, ours_path, quiet,
    report, setup, target,
)

NAME = "attention"
B, H, D, M = 1, 12, 64, 266
IMPLS = ("ours_rope", "ours_none", "performer", "sdpa")
MODES = ("fwd", "fwd+bwd")
# warmup_n: one warmup call of every impl and mode at this N before the first round.
# skip: (impl, N) -> reason, cuts on top of ``skip_reason`` (e.g. for the 15-minute budget); none now.
# N = 65536 is left to benchmarks.memory (its one target there): on a shared machine one round
# of it took minutes, and no timing target is set past 16384.
FULL = dict(ns=(1024, 2048, 4096, 16384), flop_n=4096, warmup_n=256, budget_s=80.0, max_rounds=7, skip={})
QUICK = dict(ns=(64, 128), flop_n=128, warmup_n=32, budget_s=3.0, max_rounds=1, skip={})
PERFORMER_MAX_N = 4096  # its CPU path keeps an [N, m, d] prefix-sum tensor for backward
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


def skip_reason(impl: str, mode: str, n: int) -> str | None:
    """Why (impl, mode, n) is not run, or None. Shared with ``benchmarks.memory``."""
    if impl == "performer" and n > PERFORMER_MAX_N:
        if mode == "fwd":  # chunk by chunk: the memory stays bounded, the time does not
            return "[N,m,d] prefix sums, too slow"
        return f"[N,m,d] prefix sums kept, {B * H * n * M * D * 4 / 2**30:.0f} GiB"
    if impl == "sdpa" and n > SDPA_MAX_N:
        tflop = sdpa_flops(n, backward=mode != "fwd") / 1e12
        return f"O(N^2), {tflop:.0f} TFLOP/call"
    return None


def make_op(impl: str, features: FavorFeatures, performer=None):
    """impl name -> f(q, k, v) -> out, all `[B, H, N, d]`."""
    if impl == "ours_rope":
        return lambda q, k, v: ours_attention(q, k, v, features, True)
    if impl == "ours_none":
        return lambda q, k, v: ours_attention(q, k, v, features, False)
    if impl == "performer":
        return performer
    if impl == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def make_performer():
    with quiet():
        from performer_pytorch import FastAttention

        return FastAttention(dim_heads=D, nb_features=M, causal=True)


def make_inputs(n: int, seed: int = 0):
    """q, k, v `[B, H, n, D]` (requiring grad) and an upstream gradient, from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, up = (torch.randn(B, H, n, D, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), up


def make_call(op, mode: str, q, k, v, up):
    """A zero-argument call running ``op`` once in ``mode``; it keeps no output alive."""
    if mode == "fwd":
        def call():
            with torch.no_grad():
                op(q, k, v)
    else:
        def call():
            for t in (q, k, v):
                t.grad = None
            op(q, k, v).backward(up)
    return call


# Issue 14's targets, fwd+bwd against ours_rope: sdpa / ours at each N, performer / ours.
SDPA_TARGETS = {1024: 1.0, 2048: 1.5, 4096: 3.0, 16384: 10.0}
PERFORMER_TARGET = 20.0
GEMM_TARGET = 0.6


def attention_targets(ratio, ns, fraction_of_gemm: float, quick: bool) -> list[dict]:
    """The issue's targets for the op, all on causal fwd+bwd, from ratios against ours_rope.
    Quick mode maps them onto its two sizes (the numbers mean nothing there)."""
    if quick:
        sdpa = {ns[0]: 1.0, ns[-1]: 3.0}
        perf = (ns[0], ns[-1])
    else:
        sdpa, perf = SDPA_TARGETS, (1024, 4096)
    return [
        *[target(f"sdpa / ours fwd+bwd, N={n}", ratio("sdpa", "fwd+bwd", n), ">=", t) for n, t in sdpa.items()],
        *[target(f"performer / ours fwd+bwd, N={n}", ratio("performer", "fwd+bwd", n), ">=", PERFORMER_TARGET)
          for n in perf],
        target("ours fwd+bwd rate / same-round GEMM rate (FLOP-count N)", fraction_of_gemm, ">=", GEMM_TARGET),
    ]


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    features = FavorFeatures(D, M)
    ops = {impl: make_op(impl, features, make_performer() if impl == "performer" else None) for impl in IMPLS}
    warm = make_inputs(cfg["warmup_n"])
    for impl in IMPLS:
        for mode in MODES:
            make_call(ops[impl], mode, *warm)()
    ms: dict[str, dict[str, dict[int, float | None]]] = {i: {m: {} for m in MODES} for i in IMPLS}
    raw, skipped, rounds = {}, {}, {}
    gemm = gemm_probe(gemm_n(quick))
    for n in cfg["ns"]:
        q, k, v, up = make_inputs(n)
        calls = {}
        for impl in IMPLS:
            for mode in MODES:
                why = skip_reason(impl, mode, n) or cfg["skip"].get((impl, n))
                if why:
                    skipped[f"{impl}/{mode}/{n}"] = why
                else:
                    calls[f"{impl}/{mode}"] = make_call(ops[impl], mode, q, k, v, up)
        if n == cfg["flop_n"]:
            calls["gemm"] = gemm
        times = interleaved(calls, warmup=0, rounds=cfg["max_rounds"], budget_s=cfg["budget_s"])
        times.pop("gemm", None)
        rounds[n] = max(len(t) for t in times.values())
        for key, ts in times.items():
            impl, mode = key.split("/")
            ms[impl][mode][n] = 1e3 * median(ts)
            raw[f"{key}/{n}"] = ts
        print(f"N={n}: {rounds[n]} round(s) " + ", ".join(f"{k} {fmt(1e3 * median(t))} ms" for k, t in times.items()), flush=True)
        del q, k, v, up

    def ratio(impl, mode, n):
        a, b = ms[impl][mode].get(n), ms["ours_rope"][mode].get(n)
        return a / b if a is not None and b else None

    rows = []
    for n in cfg["ns"]:
        for mode in MODES:
            cells = [n, mode]
            for impl in IMPLS:
                why = skipped.get(f"{impl}/{mode}/{n}")
                cells.append(f"skipped ({why})" if why else ms[impl][mode][n])
            cells += [ratio("performer", mode, n), ratio("sdpa", mode, n)]
            rows.append(cells)
    fn = cfg["flop_n"]
    flops = ours_flops(fn)
    sec = ms["ours_rope"]["fwd+bwd"][fn] / 1e3
    rate = flops / sec / 1e9
    peak = median(gemm.rates)
    result = {
        "name": NAME,
        "quick": quick,
        "config": {"B": B, "H": H, "d": D, "m": M, "chunk": chunk_size(), "ns": list(cfg["ns"]), "ours": ours_path(),
                   "budget_s_per_n": cfg["budget_s"], "max_rounds": cfg["max_rounds"], "rounds": rounds},
        "ms": ms,
        "times_s": raw,
        "skipped": skipped,
        "flops": {"n": fn, "gflop_fwd_bwd": flops / 1e9, "seconds": sec, "gflop_per_s": rate,
                  "gemm_gflop_per_s_same_rounds": peak, "gemm_peak_gflop_per_s_at_start": machine_peak(quick),
                  "fraction_of_gemm": rate / peak},
        "table": {"headers": ["N", "mode", *[f"{i} ms" for i in IMPLS], "performer/ours", "sdpa/ours"], "rows": rows},
        "targets": attention_targets(ratio, cfg["ns"], rate / peak, quick),
        "notes": [
            f"ours = {ours_path()}; ratios are against ours_rope (medians of interleaved rounds: {rounds}).",
            f"ours_rope fwd+bwd at N={fn}: {fmt(flops / 1e9)} GFLOP (analytic, see ours_flops) in "
            f"{fmt(sec * 1e3)} ms = {fmt(rate)} GFLOP/s, {fmt(100 * rate / peak)}% of the "
            f"{fmt(peak)} GFLOP/s fp32 GEMM rate measured in the same rounds.",
            f"skipped: performer above N={PERFORMER_MAX_N} (its CPU fallback keeps an [N, m, d] tensor of "
            f"prefix sums); sdpa above N={SDPA_MAX_N} (O(N^2): minutes per call)"
            + "".join(f", {i} at N={n} ({why})" for (i, n), why in cfg["skip"].items()) + ".",
        ],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
