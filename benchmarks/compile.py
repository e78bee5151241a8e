"""The op under torch.compile: graphs and breaks, fullgraph, compiled against eager, recompiles.

    python -m benchmarks.compile [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.compile``).
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from linear_rope import RotaryLinearAttention
from linear_rope.model import PerformerLM

from .common import cli, fmt, one_line, report, setup, target

NAME = "compile"
FULL = dict(user=dict(dim=128, heads=4, dim_head=32, nb_features=64), lm=dict(preset="cpu", depth=2),
            n=256, batch=2, ns=(256, 384, 512, 1000, 2048, 4096), backend="inductor")
QUICK = dict(user=dict(dim=16, heads=2, dim_head=8, nb_features=8), lm=dict(preset="tiny", depth=1),
             n=24, batch=2, ns=(16, 24), backend="aot_eager")
REL_TARGET = 1e-5
RECOMPILE_TARGET = 2


class UserModel(nn.Module):
    """A user's model holding the layer: `[B, N, dim]` -> `[B, N, dim]`."""

    def __init__(self, dim: int, **layer):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = RotaryLinearAttention(dim, **layer)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        return self.out(x + self.attn(self.ln(x)))


def _models(cfg):
    """name -> (model, input maker n -> input)."""
    torch.manual_seed(0)
    user = UserModel(cfg["user"]["dim"], **{k: v for k, v in cfg["user"].items() if k != "dim"})
    lm = PerformerLM.from_preset(cfg["lm"]["preset"], depth=cfg["lm"]["depth"])
    g = torch.Generator().manual_seed(0)
    return {
        "user": (user, lambda n: torch.randn(cfg["batch"], n, cfg["user"]["dim"], generator=g)),
        "lm": (lm, lambda n: torch.randint(0, 256, (cfg["batch"], n), generator=g)),
    }


def _fwd_bwd(model, x):
    """Outputs and gradients (parameters, and x when it is float) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    if x.is_floating_point():
        x = x.detach().requires_grad_()
    out = model(x)
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [out.detach()] + grads + ([x.grad] if x.is_floating_point() else [])


def max_rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max over tensors of max |a - b| / max |b| (inf where a gradient is missing)."""
    if len(got) != len(want):
        return float("inf")
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, want))


def check_model(model, make, cfg) -> dict:
    """explain, fullgraph, and compiled against eager, for one model."""
    x = make(cfg["n"])
    torch._dynamo.reset()
    t0 = time.perf_counter()
    ex = torch._dynamo.explain(model)(x)
    res = {"graphs": ex.graph_count, "breaks": ex.graph_break_count,
           "first_break": one_line(ex.break_reasons[0].reason) if ex.break_reasons else None,
           "explain_s": time.perf_counter() - t0}
    want = _fwd_bwd(model, x)
    torch._dynamo.reset()
    compiled = copy.deepcopy(model)
    t0 = time.perf_counter()
    try:
        got = _fwd_bwd(torch.compile(compiled, fullgraph=True, backend=cfg["backend"]), x)
        res["fullgraph"], res["fullgraph_error"] = True, None
    except Exception as e:  # noqa: BLE001 - what it raises is the finding
        res["fullgraph"], res["fullgraph_error"] = False, one_line(e)
        torch._dynamo.reset()
        compiled = copy.deepcopy(model)
        got = _fwd_bwd(torch.compile(compiled, backend=cfg["backend"]), x)
    res["compile_s"] = time.perf_counter() - t0
    res["max_rel_diff"] = max_rel_diff(got, want)
    torch._dynamo.reset()
    return res


def count_recompiles(model, make, ns) -> dict:
    """Graphs compiled at each length (a counting backend over aot_eager), forward + backward."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(model, backend=cnt)
    per_n = {}
    for n in ns:
        before = cnt.frame_count
        fn(make(n)).square().mean().backward()
        per_n[n] = cnt.frame_count - before
    torch._dynamo.reset()
    first = per_n[ns[0]]
    return {"graphs_per_n": per_n, "first": first, "recompiles": sum(per_n.values()) - first}


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    models = _models(cfg)
    checks = {}
    for name, (model, make) in models.items():
        checks[name] = check_model(model, make, cfg)
        c = checks[name]
        print(f"{name}: {c['graphs']} graph(s), {c['breaks']} break(s), fullgraph "
              f"{'ok' if c['fullgraph'] else 'fails'}, compiled vs eager {fmt(c['max_rel_diff'])}", flush=True)
    rec = count_recompiles(models["user"][0], models["user"][1], cfg["ns"])
    rows = [[name, c["graphs"], c["breaks"], "works" if c["fullgraph"] else f"raises ({c['fullgraph_error'][:80]})",
             c["max_rel_diff"], c["compile_s"]] for name, c in checks.items()]
    targets = []
    for name, c in checks.items():
        targets += [target(f"{name}: graphs under torch._dynamo.explain", c["graphs"], "<=", 1),
                    target(f"{name}: graph breaks", c["breaks"], "<=", 0),
                    target(f"{name}: fullgraph=True works (1 = yes)", int(c["fullgraph"]), ">=", 1),
                    target(f"{name}: compiled vs eager, max relative difference (outputs, gradients)",
                           c["max_rel_diff"], "<=", REL_TARGET)]
    targets.append(target(f"user: recompiles over N = {', '.join(map(str, cfg['ns']))}", rec["recompiles"], "<=",
                          RECOMPILE_TARGET))
    result = {
        "name": NAME, "quick": quick,
        "config": {**{k: v for k, v in cfg.items() if k != "ns"}, "ns": list(cfg["ns"])}, "checks": checks,
        "recompiles": rec,
        "table": {"headers": ["model", "graphs", "breaks", "fullgraph=True", "compiled vs eager (max rel)",
                              "compile + first step s"], "rows": rows},
        "targets": targets,
        "notes": [
            f"compiled with backend {cfg['backend']!r}, fp32; relative difference = max |a - b| / max |b| per tensor, "
            "the largest over the output and every gradient.",
            *[f"{name}: first graph break: {c['first_break']}" for name, c in checks.items() if c["first_break"]],
            f"recompiles (user model, counting backend over aot_eager): graphs compiled per length "
            f"{rec['graphs_per_n']}; {rec['recompiles']} after the first length.",
        ],
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
