"""Chunk and block sizes of the causal op, fwd+bwd, FAVOR+ inside, B*H = 12, d = 64, m = 266.

    python benchmarks/op_experiments/chunk_sweep.py THREADS N
"""
import sys, time, torch, statistics
from linear_rope import rotary_linear_attention
from linear_rope.features import draw_orthogonal_projection
torch.set_num_threads(int(sys.argv[1])); N = int(sys.argv[2])
torch.manual_seed(0)
q, k, v = (torch.randn(1, 12, N, 64, requires_grad=True) for _ in range(3))
w = draw_orthogonal_projection(266, 64)
cfgs = [(64, 256), (32, 256), (128, 256), (128, 512), (64, 128), (64, 512)]
res = {c: [] for c in cfgs}
for r in range(4):
    for c in cfgs:
        t0 = time.perf_counter()
        out = rotary_linear_attention(q, k, v, projection=w, chunk_size=c[0], block_size=c[1])
        out.sum().backward()
        res[c].append(time.perf_counter() - t0)
for c in cfgs:
    print(c, f"{1e3*statistics.median(res[c][1:]):.0f} ms")
