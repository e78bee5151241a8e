"""Page faults per call of the causal op, fwd+bwd, B*H = 12, d = 64, m = 266, N from argv.

Under glibc's default allocator every tensor over 32 MiB is a fresh mmap, first touched page by
page. Compare the allocator settings from outside (they are read before torch starts):

    TH=2 python benchmarks/op_experiments/faults.py 4096
    TH=2 THP_MEM_ALLOC_ENABLE=1 python benchmarks/op_experiments/faults.py 4096
    TH=2 MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=536870912 \
        python benchmarks/op_experiments/faults.py 4096
"""
import sys, time, resource, torch
from linear_rope import FavorFeatures, rotary_linear_attention
import os; torch.set_num_threads(int(os.environ.get("TH", "1"))); torch.manual_seed(0)
N = int(sys.argv[1]); feat = FavorFeatures(64); w = feat.projection
q, k, v = (torch.randn(1, 12, N, 64, requires_grad=True) for _ in range(3)); g = torch.randn(1, 12, N, 64)
def featin():
    out = rotary_linear_attention(feat(q, is_query=True), feat(k, is_query=False), v); out.backward(g)
def inside():
    out = rotary_linear_attention(q, k, v, projection=w); out.backward(g)
for f in (featin, inside):
    f(); best = 1e9; flt = []
    for _ in range(5):
        r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter(); f(); dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF); best = min(best, dt); flt.append(r1.ru_minflt - r0.ru_minflt)
    print(f.__name__, f"{1e3*best:.0f} ms, minor faults per call {min(flt)} (~{min(flt)*4096/2**20:.0f} MiB first-touched)")
