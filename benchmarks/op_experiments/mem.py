"""Peak RSS above baseline of ours_rope fwd+bwd at N (VmHWM), this tree."""
import os, sys, torch
from benchmarks.common import peak_rss_mib, reset_peak_rss
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from linear_rope import FavorFeatures, rotary_linear_attention
n = int(sys.argv[1])
torch.manual_seed(0)
w = FavorFeatures(64).projection
q, k, v = (torch.randn(1, 12, n, 64, requires_grad=True) for _ in range(3)); g = torch.randn(1, 12, n, 64)
reset_peak_rss(); base = peak_rss_mib()
rotary_linear_attention(q, k, v, projection=w).backward(g)
print(f"N={n} fwd+bwd peak above baseline {peak_rss_mib() - base:.0f} MiB")
