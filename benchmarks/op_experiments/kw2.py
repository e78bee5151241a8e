"""Keywords against the plain call, before (issue27-ops-done, as /tmp/pre22/linear_rope_pre; see bench.py)
and now, N=4096, FAVOR+ inside, fwd+bwd, 1 thread, interleaved."""
import sys, time, statistics, torch
sys.path.insert(0, "/tmp/pre22")
from benchmarks.common import setup
setup(); torch.set_num_threads(1)
from linear_rope import FavorFeatures, rotary_linear_attention as new
from linear_rope_pre import rotary_linear_attention as pre
torch.manual_seed(0)
n = 4096; w = FavorFeatures(64).projection
q, k, v = (torch.randn(2, 6, n, 64, requires_grad=True) for _ in range(3)); g = torch.randn(2, 6, n, 64)
q1, k1, v1 = (torch.randn(1, 12, n, 64, requires_grad=True) for _ in range(3)); g1 = torch.randn(1, 12, n, 64)
mask = torch.ones(2, n, dtype=torch.bool); mask[1, : n // 4] = False
cu = torch.tensor([0, 1100, 1400, 2300, 2345, 3845, 4096], dtype=torch.int32)
def mk(op, m):
    if m == "cu":
        return lambda: op(q1, k1, v1, projection=w, cu_seqlens=cu).backward(g1)
    return lambda: op(q, k, v, projection=w, mask=mask if m else None).backward(g)
fns = {f"{nm}/{m}": mk(op, m) for nm, op in (("pre", pre), ("new", new)) for m in (None, "mask", "cu")}
for f in fns.values(): f()
ts = {x: [] for x in fns}; names = list(fns)
for r in range(4):
    for nm in names[r % 6:] + names[:r % 6]:
        t0 = time.perf_counter(); fns[nm](); ts[nm].append(time.perf_counter() - t0)
m = {x: statistics.median(y) for x, y in ts.items()}
print({x: round(y * 1e3) for x, y in m.items()})
for nm in ("pre", "new"):
    print(nm, "mask/plain", round(m[f"{nm}/mask"] / m[f"{nm}/None"], 3), "cu/plain(2x6)", round(m[f"{nm}/cu"] / m[f"{nm}/None"], 3))
