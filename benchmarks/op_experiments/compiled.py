"""Prototype, run on issue27-ops-done (chunk_blocks.use_compile, removed since): the Inductor-compiled
block functions vs eager, side by side. Kept as the record of the measurement in docs/performance.md (issue 22 ops section)."""
import os, sys, time, statistics
import torch
from benchmarks.common import setup
setup(); torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from linear_rope import FavorFeatures, rotary_linear_attention
from linear_rope.ops import chunk_blocks
from benchmarks.op_experiments.prof import make, inside, featin, timeit, yard, gemm_rate
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
a = make(n)
t0 = time.perf_counter(); inside(*a); print("eager first call", time.perf_counter() - t0, flush=True)
eager = dict(chunk_blocks._compiled)
chunk_blocks.use_compile(True)
comp = dict(chunk_blocks._compiled)
t0 = time.perf_counter()
try:
    inside(*a)
    print("compiled first call (compile)", time.perf_counter() - t0, flush=True)
except Exception as e:
    print("compile failed:", type(e).__name__, str(e)[:500]); sys.exit()
ts = {"eager": [], "compiled": []}; rates = []
for r in range(5):
    rates.append(gemm_rate())
    for name, d in (("eager", eager), ("compiled", comp)) if r % 2 else (("compiled", comp), ("eager", eager)):
        chunk_blocks._compiled.clear(); chunk_blocks._compiled.update(d)
        ts[name].append(timeit(inside, a))
for k_, v_ in ts.items():
    print(k_, "median ms", round(statistics.median(v_) * 1e3, 1), "min", round(min(v_) * 1e3, 1), "rate", round(statistics.median(rates)))
print("compiled/eager median ratio", statistics.median(ts["compiled"]) / statistics.median(ts["eager"]))
