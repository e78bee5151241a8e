"""Which products of the Triton kernels may take plain bf16 operands with bf16 inputs?

    python benchmarks/op_experiments/bf16_product_precision.py bf16x3,bf16x3 bf16,bf16 bf16,tf32r ...

Each argument is PREC,SPREC (``dispatch.pick_config``: ``PREC`` the intra-chunk products, scores
and scores times values; ``SPREC`` the products with the chunk states). For each, runs the five
half-precision cases of ``tests/test_triton.py`` (``HALF_CASES``) in bf16 under the tensor-core
emulation and prints each checked tensor's error over the device tolerance (the case fails at
the first tensor over 1). The numbers in docs/gpu.md ("Precision") come from this script.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import linear_rope.ops.tolerances as tolerances  # noqa: E402
import test_triton as T  # noqa: E402
from linear_rope.ops.triton import chunk as triton_chunk  # noqa: E402
from linear_rope.ops.triton import dispatch  # noqa: E402


def run(prec: str, sprec: str, case: str):
    def config(dtype):
        cfg = dispatch.pick_config(dtype)
        if dtype == torch.bfloat16:
            for part in ("chunk", "state"):
                cfg[part]["PREC"], cfg[part]["SPREC"] = prec, sprec
        return cfg

    rows, real_check = [], tolerances.check

    def check(a, b, tol, grad=False):
        r = real_check(a, b, tol, grad)
        rows.append(r["worst_over_tol"])
        return r

    triton_chunk.pick_config, tolerances.check = config, check
    try:
        N, kw = T.HALF_CASES[case]
        T._check_on_tensor_cores(torch.bfloat16, N, **dict(kw))
        verdict = "pass"
    except AssertionError as e:
        verdict = "FAIL " + str(e).split(" (")[0]
    finally:
        triton_chunk.pick_config, tolerances.check = dispatch.pick_config, real_check
    return verdict, rows


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for arg in argv:
        prec, sprec = arg.split(",")
        for case in T.HALF_CASES:
            verdict, rows = run(prec, sprec, case)
            print(f"PREC={prec} SPREC={sprec} {case}: {verdict}; error / tolerance per tensor: "
                  f"{', '.join(f'{r:.2f}' for r in rows)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
