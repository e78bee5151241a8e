"""The Triton kernels' accuracy with bf16 / fp16 inputs as the GPU computes it, on the CPU.

    python -m benchmarks.tensor_core_precision [--out benchmarks/results/tensor_core_precision.json]

How it measures: docs/performance.md, "Methods" (``benchmarks.tensor_core_precision``).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.language is imported

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import linear_rope  # noqa: E402
from linear_rope.features import FavorFeatures  # noqa: E402
from linear_rope.ops import naive_rotary_linear_attention  # noqa: E402
from linear_rope.ops.triton import rotary_linear_attention as kernels  # noqa: E402
from linear_rope.ops.triton.emulation import tensor_core_dots  # noqa: E402

from .common import commit  # noqa: E402

NAMES = ("out", "S", "z", "dq", "dk", "dv")


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def _rounded(f, dtype):
    """float32 rounded to ``dtype``'s precision at the tensor's own (power-of-two) scale."""
    f = f.detach().float()
    scale = 2.0 ** torch.tensor(float(f.abs().max())).log2().floor().item()
    return (f / scale).to(dtype).double() * scale


def measure(B=2, H=1, N=300, d=64, m=266) -> dict:
    torch.manual_seed(0)
    W = FavorFeatures(d, m).projection
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for _ in range(3))
    res = {}
    for dtype in (torch.bfloat16, torch.float16):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        up = torch.randn(B, H, N, d, generator=g, dtype=torch.float64).to(dtype)

        def run(op, x, w):
            o, st = op(*x, projection=w, output_final_state=True, offset=3)
            return [o, st.S, st.z, *torch.autograd.grad((o * up.to(o.dtype)).sum(), x)]
        ref = run(naive_rotary_linear_attention, [t.detach().double().requires_grad_() for t in xs], W.double())
        base = run(naive_rotary_linear_attention, [t.detach().float().requires_grad_() for t in xs], W.float())
        t0 = time.perf_counter()
        with tensor_core_dots():
            got = run(kernels, xs, W.float())
        res[str(dtype)[6:]] = {n: {"kernels": _rel(a, r), "fp32_rounded": _rel(_rounded(b, dtype), r),
                                   "ratio": _rel(a, r) / _rel(_rounded(b, dtype), r)}
                               for n, a, b, r in zip(NAMES, got, base, ref)}
        res[str(dtype)[6:]]["interpreter_s"] = time.perf_counter() - t0
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/tensor_core_precision.json"))
    args = ap.parse_args(argv)
    res = measure()
    doc = {"command": "python -m benchmarks.tensor_core_precision", "code": str(Path(linear_rope.__file__).parent),
           "commit": commit(Path(linear_rope.__file__).parent), "case": "B=2, H=1, N=300, d=64, m=266, offset 3, final state", "errors": res}
    for dt, r in res.items():
        print(dt + ": " + ", ".join(f"{n} {r[n]['kernels']:.1e} ({r[n]['ratio']:.2f}x)" for n in NAMES))
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
