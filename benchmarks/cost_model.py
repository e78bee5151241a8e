"""A roofline cost model of causal Eq. 19 fwd+bwd on an H200: five paths, arithmetic only.

    python -m benchmarks.cost_model        # prints the table, writes benchmarks/results/cost_model.json

How it measures: docs/performance.md, "Methods" (``benchmarks.cost_model``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

D, M, E = 64, 266, 64
DEVICE = "H200"
PEAK = {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}  # H200 dense, FLOP/s (the H100 SXM's GH100 die)
BW = 4.8e12  # H200 HBM3e, bytes/s
US_PER_CALL = 9.0  # host time per dispatcher call (benchmarks.launches' calibration)
BLOCK = 256  # the torch path's block walk: its calls grow per block of 256 tokens
# Dispatcher calls of one fwd+bwd call, counted by benchmarks.launches (``torch_path_calls``,
# ``fla_path_calls``, ``triton_path_calls``; B = 1, H = 12, bf16, FAVOR+ inside; tests/
# test_cost_model.py recounts them). The torch path: fixed + per block of 256 tokens, for the
# buffers its forward keeps for the backward at the call's size (``chunk_fwd.keep_plan``: what
# does not fit 512 MiB is recomputed block by block, more calls).
TORCH_CALLS = {("A", "S", "phk", "phq", "z"): (154, 305), ("A", "S", "z"): (156, 326), ("A",): (156, 344),
               (): (157, 345)}
FLA_CALLS = 353  # the fla-backed path's eager torch ops (features, RoPE, pads, casts, sums) + 4 x 6 fla kernels
TRITON_CALLS = 105  # 3 + 4 kernels and the wrapper's torch ops (the backward differs a little at N = 4096)
SDPA_CALLS = 10  # flash SDPA's op and its backward with their copies (counted on the CPU's flash op)
SHAPES = [(32, 12, 1024), (8, 12, 4096), (8, 12, 16384), (8, 12, 32768)]  # (B, H, N): B*H = 384, 96, 96, 96
OUT = Path(__file__).resolve().parent / "results" / "cost_model.json"


def chunked(N, K, V, C, Vtile=None):
    """Forward FLOPs of one chunked linear attention (Vtile: V as the tensor cores compute it)."""
    Vc = V if Vtile is None else max(V, Vtile)
    return 2 * N * C * K + 2 * N * C * Vc + 4 * N * K * Vc


def phase(name, flops, nbytes, peak):
    return {"phase": name, "flops": flops, "bytes": nbytes, "peak": peak,
            "ms": 1e3 * max(flops / PEAK[peak], nbytes / BW)}


def torch_path(N, peak="fp32"):
    """The torch path (linear_rope/ops/chunk*.py), float32 inside, C = 64. Its FLOP and byte counts: docs/performance.md, "Methods"."""
    C = 64
    f = 4 * N * D * M + chunked(N, M, E, C) + chunked(N, M, 1, C)
    b = 4 * (2 * 11 * N * M + 8 * N * M + 2 * 4 * N * C + 4 * (N / C) * M * E + 6 * N * E) + 2 * 3 * N * D
    return [phase("all (torch GEMMs + elementwise)", 3 * f, 3 * b, peak)]


def fla_path(N):
    """The fla-backed path (linear_rope/ops/fla_path.py), priced by its work. Its FLOP and byte counts: docs/performance.md, "Methods"."""
    C, blocks = 64, math.ceil(M / 256)
    f_feat = 3 * 4 * N * D * M * 3
    b_feat = 2 * (2 * N * D * 2) + 2 * (4 * N * M * 2) + 3 * 4 * 4 * N * E

    def fla_bytes(K, V, nb):
        return 2 * (11 * N * K + 9 * N * V * nb + 7 * (N / C) * K * V)
    f_fla = chunked(N, M, E, C) + chunked(N, M, 2, C, Vtile=16)
    b_fla = fla_bytes(M, E, blocks) + fla_bytes(M, 2, blocks)
    return [phase("features + RoPE (by their work, TF32x3)", f_feat, b_feat, "tf32"),
            phase("fla chunk_linear_attn x2 (bf16)", 3 * f_fla, b_fla, "bf16")]


def triton_path(N):
    """Our Triton kernels (linear_rope/ops/triton), the chunk-parallel design, bf16 inputs. Its FLOP and byte counts: docs/performance.md, "Methods"."""
    C, mp = 64, 2 * 8 * math.ceil(M / 2 / 8)
    feat = 12 * 2 * N * D * mp * 3
    fwd = 2 * N * mp * E * 2 + 2 * N * C * mp * 3 * 2 + 2 * N * mp * E * 3 + 2 * N * C * E * 2
    dq = 2 * N * C * E * 2 + 2 * N * E * mp * 3 + 2 * N * C * mp * 3 + 2 * N * C * mp * 2 + 2 * N * mp * D * 3
    dk = 2 * N * C * E * 2 + 2 * N * E * mp * 2 + 2 * N * C * mp * 3 + 2 * N * C * mp * 2 + 2 * N * mp * D * 3
    dv = 2 * N * C * mp * 3 + 2 * N * mp * E * 3 + 2 * N * C * E * 3
    bwd = 2 * N * mp * E * 3 + dq + dk + dv
    x, st, tab = 2 * N * D, 4 * (N / C) * M * (E + 1), 2 * 4 * N * M / 2
    b_fwd = (x + 4 * N) + (x + 2 * N * E + st + tab) + (2 * x + 2 * N * E + 4 * N + st + tab + 4 * N * E + 4 * N) \
        + (4 + 2) * N * E
    grad = 2 * x + 2 * N * E + 4 * N * E + 4 * N + st + tab  # what each of dq, dk, dv reads
    b_bwd = ((2 + 4 + 4) * N * E + 4 * N + 4 * N + 4 * N * E) + (x + 4 * N * E + 4 * N + st + tab) \
        + (grad + 4 * N * D) + (grad + 4 * N * D) + (grad + 4 * N * E) + 3 * (4 + 2) * N * D
    return [phase("kernels (bf16 tensor cores)", feat + fwd + bwd, b_fwd + b_bwd, "bf16")]


def sdpa_path(N):
    """Flash SDPA (exact causal softmax attention, bf16). Its FLOP and byte counts: docs/performance.md, "Methods"."""
    f = 2 * N * N * D * 3.5
    b = 2 * 4 * N * D + 4 * N + 2 * 8 * N * D + 2 * 4 * N * D + 2 * 4 * N
    return [phase("flash kernels (bf16)", f, b, "bf16")]


def torch_calls(G, N):
    """The torch path's dispatcher calls for one call of G = B*H heads of N tokens."""
    from linear_rope.ops.chunk_fwd import keep_plan

    C = 64
    kept = tuple(sorted(keep_plan((N // C, G, C, M, E), True, True, _F32, sizes_only=True)))
    fixed, per_block = TORCH_CALLS[kept]
    return fixed + per_block * math.ceil(N / BLOCK)


_F32 = None  # a float32 tensor for keep_plan's element size (made at first use: torch imports then)

PATHS = {"torch path (fp32)": torch_path, "torch path (TF32 allowed)": lambda N: torch_path(N, "tf32"),
         "fla-backed": fla_path, "our Triton kernels": triton_path, "flash SDPA": sdpa_path}
CALLS = {"torch path (fp32)": torch_calls, "torch path (TF32 allowed)": torch_calls,
         "fla-backed": lambda G, N: FLA_CALLS, "our Triton kernels": lambda G, N: TRITON_CALLS,
         "flash SDPA": lambda G, N: SDPA_CALLS}


def table():
    global _F32
    if _F32 is None:
        import torch

        _F32 = torch.empty(0)
    rows = []
    for B, H, N in SHAPES:
        G = B * H
        for name, fn in PATHS.items():
            ph = fn(N)
            device_ms = G * sum(p["ms"] for p in ph)
            calls = CALLS[name](G, N)
            host_ms = calls * US_PER_CALL / 1e3
            rows.append({"B": B, "H": H, "N": N, "path": name, "gflop": G * sum(p["flops"] for p in ph) / 1e9,
                         "gbyte": G * sum(p["bytes"] for p in ph) / 1e9,
                         "device_ms": device_ms, "host_calls": calls, "host_ms": host_ms,
                         "ms": max(device_ms, host_ms), "bound": "host" if host_ms > device_ms else "device",
                         "phases": [dict(p, flops=G * p["flops"], bytes=G * p["bytes"], ms=G * p["ms"]) for p in ph]})
    return rows


def main() -> None:
    rows = table()
    head = (f"{'B':>3} {'H':>3} {'N':>6}  {'path':<26} {'GFLOP':>8} {'GB':>7} {'dev. ms':>8} {'calls':>6} "
            f"{'host ms':>8} {'est. ms':>8}  bound (phases)")
    print(f"ESTIMATES (roofline arithmetic, {DEVICE}: bf16 989, TF32 494, FP32 67 TFLOP/s, {BW / 1e12:.1f} TB/s; "
          f"host {US_PER_CALL:g} us per dispatcher call); no GPU measured these.")
    print(head)
    for r in rows:
        bound = ", ".join(f"{p['peak']}:{'FLOPs' if p['flops'] / PEAK[p['peak']] >= p['bytes'] / BW else 'bytes'}"
                          for p in r["phases"])
        print(f"{r['B']:>3} {r['H']:>3} {r['N']:>6}  {r['path']:<26} {r['gflop']:>8.1f} {r['gbyte']:>7.2f} "
              f"{r['device_ms']:>8.3f} {r['host_calls']:>6} {r['host_ms']:>8.3f} {r['ms']:>8.3f}  "
              f"{r['bound']} ({bound})")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"note": "estimates from arithmetic (benchmarks/cost_model.py); no GPU measured them",
                               "device": DEVICE, "peaks_flop_s": PEAK, "hbm_bytes_s": BW,
                               "us_per_dispatcher_call": US_PER_CALL, "d": D, "m": M, "e": E,
                               "dtype": "bf16 inputs", "mode": "fwd+bwd", "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(OUT.parents[2])}")


if __name__ == "__main__":
    main()
