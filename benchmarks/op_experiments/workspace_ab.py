"""The causal op with and without its workspace pool (ops/workspace.py), interleaved in one
process: fwd+bwd, FAVOR+ inside, B*H = 12, d = 64, m = 266, glibc's default allocator.

    TH=2 python benchmarks/op_experiments/workspace_ab.py 4096 6     # N, rounds
"""
import os
import resource
import statistics
import sys
import time

import torch

from linear_rope import FavorFeatures, rotary_linear_attention
from linear_rope.ops import workspace

torch.set_num_threads(int(os.environ.get("TH", "1")))
torch.manual_seed(0)
N, rounds = int(sys.argv[1]), int(sys.argv[2])
w = FavorFeatures(64).projection
q, k, v = (torch.randn(1, 12, N, 64, requires_grad=True) for _ in range(3))
g = torch.randn(1, 12, N, 64)
limit, pool = workspace.LIMIT_BYTES, workspace._pool
res = {"no pool": [], "pool": []}
for r in range(rounds + 1):
    for mode in (("no pool", "pool") if r % 2 else ("pool", "no pool")):
        # no pool: an empty one that takes nothing; the pool's buffers wait for the next "pool" call
        workspace.LIMIT_BYTES, workspace._pool = (limit, pool) if mode == "pool" else (0, {})
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        rotary_linear_attention(q, k, v, projection=w).backward(g)
        dt = time.perf_counter() - t0
        if r:  # the first round warms up (and fills the pool)
            res[mode].append((dt, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
for mode, xs in res.items():
    print(f"{mode}: median {1e3 * statistics.median(t for t, _ in xs):.0f} ms, min {1e3 * min(t for t, _ in xs):.0f} ms, "
          f"faults per call {statistics.median(f for _, f in xs):.0f}")
print(f"no pool / pool (medians): {statistics.median(t for t, _ in res['no pool']) / statistics.median(t for t, _ in res['pool']):.3f}")
