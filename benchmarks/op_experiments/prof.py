"""Phase-1 profile: the current causal op, fwd+bwd, B*H=12, d=64, m=266, fp32, both paths."""
import sys, time, statistics
import torch
from linear_rope import FavorFeatures, rotary_linear_attention
from benchmarks.common import setup

setup()
import os; torch.set_num_threads(int(os.environ.get("THREADS", "2")))
torch.manual_seed(0)
B, H, D = 1, 12, 64
feat = FavorFeatures(D)
w = feat.projection


def yard(n, C=64, d=64, m=266, heads=12):
    nc = -(-n // C)
    return 3 * heads * (4 * n * d * m + nc * (2 * C * C * m + 2 * C * C * d + 4 * C * m * d) + 2 * n * m)


def gemm_rate(n=2048, reps=3):
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    torch.mm(a, b, out=c)
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); torch.mm(a, b, out=c); best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def make(n):
    q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, n, D)
    return q, k, v, g


def inside(q, k, v, g):
    out = rotary_linear_attention(q, k, v, projection=w)
    out.backward(g)


def featin(q, k, v, g):
    out = rotary_linear_attention(feat(q, is_query=True), feat(k, is_query=False), v)
    out.backward(g)


def timeit(fn, args):
    for t in args[:3]:
        t.grad = None
    t0 = time.perf_counter(); fn(*args); return time.perf_counter() - t0


if __name__ == "__main__":
    ns = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1024, 4096, 16384]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    for n in ns:
        a = make(n)
        fns = {"inside": inside, "featin": featin}
        for f in fns.values():
            timeit(f, a)
        ts = {k: [] for k in fns}; rates = []
        for r in range(rounds if n < 16384 else max(2, rounds // 2)):
            rates.append(gemm_rate())
            for name, f in fns.items():
                ts[name].append(timeit(f, a))
        rate = statistics.median(rates)
        for name in fns:
            t = statistics.median(ts[name]); tmin = min(ts[name])
            print(f"N={n} {name}: median {t*1e3:.1f} ms min {tmin*1e3:.1f} ms; GEMM {rate:.0f} GFLOP/s; "
                  f"eff(median) {yard(n)/t/1e9/rate:.1%} eff(min) {yard(n)/tmin/1e9/max(rates):.1%}", flush=True)
    if "--profile" in sys.argv:
        n = 4096
        a = make(n)
        for name, f in (("inside", inside), ("featin", featin)):
            timeit(f, a)
            with torch.profiler.profile() as p:
                timeit(f, a)
            print(f"--- profile {name} N={n}")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
