"""Key norms and FAVOR+ denominators of trained runs, on the first 16 x 256 validation bytes:
per layer the largest |k|, the smallest causal denominator sum_{n<=m} phi(q_m).phi(k_n) (float32
features, the layer's own map), and the share of key feature exponents below the float32
floor (``linear_rope.features.key_exponent_floor``). The floor changes only those.

    python results/cpu20m/key_norms.py RUN_DIR ... > results/cpu20m/key_norms.txt
"""
import sys

import torch

from linear_rope.enwik8 import data
from linear_rope.enwik8.checkpoint import resolve_checkpoint
from linear_rope.enwik8.sample import load_model
from linear_rope.features import key_exponent_floor, pair_shift

torch.set_num_threads(1)
val = data.load_split(data.prepare_corpus("../shared/data/enwiki-sample.xml.bz2", "data")["valid"])
ids = torch.from_numpy(val[:16 * 256].astype("int64")).view(16, 256)
floor = key_exponent_floor(torch.float32)
for run in sys.argv[1:]:
    path = resolve_checkpoint(run)
    model = load_model(path).eval()
    seen = {}
    for i, b in enumerate(model.blocks):
        b.attn.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0]))
    rows = []
    with torch.no_grad():
        model(ids)
        for i, b in enumerate(model.blocks):
            q, k, _ = b.attn._qkv(seen[i], None)
            fq, fk = b.attn.features(q, is_query=True), b.attn.features(k, is_query=False)
            w = b.attn.features.projection
            ks = k * k.shape[-1] ** -0.25  # the exponent of each key feature, before the floor
            expo = ks @ w.t() - 0.5 * (ks * ks).sum(-1, keepdim=True) - pair_shift(w)
            rows.append((k.norm(dim=-1).max().item(), (fq * fk.cumsum(2)).sum(-1).min().item(),
                         (expo < floor).float().mean().item()))
    print(f"{path.parent.name} {path.name}: max |k| per layer {[round(r[0], 1) for r in rows]}; "
          f"min denominator {min(r[1] for r in rows):.1e}; key exponents below the floor "
          f"{max(r[2] for r in rows):.2%} (worst layer)")
