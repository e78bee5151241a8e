"""Keywords on the fast path: mask, packed documents, state in/out and per-row offsets, against the plain call.

    python -m benchmarks.keywords [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.keywords``).
"""
from __future__ import annotations

import torch

from linear_rope import FavorFeatures, LinearAttentionState, rotary_linear_attention

from .common import cli, interleaved, median, report, setup, target

NAME = "keywords"
D, M = 64, 266
FULL = dict(n=4096, docs=(1100, 300, 900, 45, 1500, 251), rounds=7, budget_s=90.0)
QUICK = dict(n=128, docs=(40, 3, 60, 25), rounds=1, budget_s=5.0)
TARGET = 1.2


def _inputs(B, H, n, g):
    q, k, v, up = (torch.randn(B, H, n, D, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), up


def make_calls(cfg, w):
    """name -> zero-argument fwd+bwd call: 'plain/2x6', 'mask', 'plain/1x12', 'cu_seqlens', 'initial_state', 'offsets'."""
    n = cfg["n"]
    assert sum(cfg["docs"]) == n
    g = torch.Generator().manual_seed(0)
    a = _inputs(2, 6, n, g)
    b = _inputs(1, 12, n, g)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, : n // 4] = False
    cu = torch.tensor([0, *torch.tensor(cfg["docs"]).cumsum(0).tolist()], dtype=torch.int32)
    S0 = torch.rand(1, 12, M, D, generator=g).requires_grad_()
    z0 = (torch.rand(1, 12, M, generator=g) + 1).requires_grad_()

    def call(inp, **kw):
        q, k, v, up = inp

        def run():
            for t in (q, k, v, S0, z0):
                t.grad = None
            res = rotary_linear_attention(q, k, v, projection=w, **kw)
            if isinstance(res, tuple):
                out, st = res
                (out * up).sum().add(st.S.sum() + st.z.sum()).backward()
            else:
                res.backward(up)
        return run

    return {
        "plain/2x6": call(a), "mask": call(a, mask=mask), "plain/1x12": call(b), "cu_seqlens": call(b, cu_seqlens=cu),
        "initial_state": call(b, initial_state=LinearAttentionState(S0, z0), output_final_state=True),
        "offsets": call(a, offset=torch.tensor([0, 1000])),
    }


BASELINE = {"mask": "plain/2x6", "cu_seqlens": "plain/1x12", "initial_state": "plain/1x12", "offsets": "plain/2x6"}


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    w = FavorFeatures(D, M).projection
    calls = make_calls(cfg, w)
    times = interleaved(calls, warmup=1, rounds=cfg["rounds"], budget_s=cfg["budget_s"])
    ms = {k: 1e3 * median(t) for k, t in times.items()}
    ratio = {k: ms[k] / ms[b] for k, b in BASELINE.items()}
    rows = [[k, ms[k], BASELINE.get(k, "-"), ratio.get(k, "-")] for k in calls]
    result = {
        "name": NAME, "quick": quick,
        "config": {"n": cfg["n"], "d": D, "m": M, "docs": list(cfg["docs"]), "rounds": len(times["mask"]),
                   "mask": "B=2, H=6; row 1 has its first n/4 tokens masked (25% left padding on half the rows)"},
        "ms": ms, "times_s": times, "ratio": ratio,
        "table": {"headers": ["call (fwd+bwd)", "ms", "against", "ratio"], "rows": rows},
        "targets": [target(f"{k} / plain fwd+bwd time, N={cfg['n']}", ratio[k], "<=", TARGET) for k in BASELINE],
        "notes": [f"medians of {len(times['mask'])} interleaved rounds; Eq. 19 over FAVOR+ (projection inside), "
                  f"causal, fp32; cu_seqlens documents: {list(cfg['docs'])}."],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
