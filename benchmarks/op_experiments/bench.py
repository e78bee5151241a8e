"""Before/after side by side in one process: base (92ee694), pre (issue27-ops-done) and this tree,
fwd+bwd, causal, B*H=12, d=64, m=266, fp32. The earlier trees are imported as renamed packages:

    git archive 92ee694 linear_rope | tar -x -C /tmp/base22 && mv /tmp/base22/linear_rope /tmp/base22/linear_rope_base
    git archive issue27-ops-done linear_rope | tar -x -C /tmp/pre22 && mv /tmp/pre22/linear_rope /tmp/pre22/linear_rope_pre
    PYTHONPATH=$PWD THREADS=1 python benchmarks/op_experiments/bench.py 1024,4096 5
"""
import os, sys, time, statistics
sys.path.insert(0, "/tmp/base22"); sys.path.insert(0, "/tmp/pre22")
import torch
from benchmarks.common import setup
setup(); torch.set_num_threads(int(os.environ.get("THREADS", "2")))
import linear_rope_base
from linear_rope import FavorFeatures, rotary_linear_attention as new_op
from linear_rope_base import rotary_linear_attention as base_op
from linear_rope_pre import rotary_linear_attention as pre_op
torch.manual_seed(0)
feat = FavorFeatures(64); w = feat.projection
def yard(n, C=64, d=64, m=266, heads=12):
    nc = -(-n // C)
    return 3 * heads * (4 * n * d * m + nc * (2 * C * C * m + 2 * C * C * d + 4 * C * m * d) + 2 * n * m)
A = torch.randn(2048, 2048); Bm = torch.randn(2048, 2048); Cm = torch.empty(2048, 2048)
def gemm():
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter(); torch.mm(A, Bm, out=Cm); best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best / 1e9
ns = [int(x) for x in sys.argv[1].split(",")]
rounds = int(sys.argv[2])
for n in ns:
    q, k, v = (torch.randn(1, 12, n, 64, requires_grad=True) for _ in range(3)); g = torch.randn(1, 12, n, 64)
    def mk(op, inside):
        def f():
            for t in (q, k, v): t.grad = None
            out = op(q, k, v, projection=w) if inside else op(feat(q, is_query=True), feat(k, is_query=False), v)
            out.backward(g)
        return f
    fns = {"base/inside": mk(base_op, True), "pre/inside": mk(pre_op, True), "new/inside": mk(new_op, True),
           "base/featin": mk(base_op, False), "pre/featin": mk(pre_op, False), "new/featin": mk(new_op, False)}
    for f in fns.values(): f()
    ts = {k_: [] for k_ in fns}; rates = []
    names = list(fns)
    for r in range(rounds):
        rates.append(gemm())
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter(); fns[name](); ts[name].append(time.perf_counter() - t0)
    rate = statistics.median(rates)
    line = [f"N={n} threads={torch.get_num_threads()} rounds={rounds} GEMM {rate:.0f} GFLOP/s (median of rounds);"]
    for name in names:
        t = statistics.median(ts[name])
        line.append(f"{name} {t*1e3:.0f} ms (min {min(ts[name])*1e3:.0f}) eff {yard(n)/t/1e9/rate:.1%}")
    for p in ("inside", "featin"):
        line.append(f"new/base {p} {statistics.median(ts['new/'+p]) / statistics.median(ts['base/'+p]):.3f}; "
                    f"new/pre {p} {statistics.median(ts['new/'+p]) / statistics.median(ts['pre/'+p]):.3f}")
    print("\n  ".join(line), flush=True)
