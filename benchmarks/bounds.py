"""What bounds the targets: profiles of the op, of SDPA and of a cpu-preset training step.

    python -m benchmarks.bounds [--quick]

Runs last in ``benchmarks.run``, so that BENCHMARKS.md can say, for each MISS, what bounds it
with figures from the same run rather than a guess:

* **op, N = 4096, fwd+bwd** (Eq. 19 over FAVOR+, the attention benchmark's shapes), under
  ``torch.profiler`` (``record_shapes``): self time per kind of kernel (GEMM = mm / bmm /
  baddbmm / addmm; exp; other ops), the GEMM FLOPs actually executed (from the recorded shapes)
  and the rate the GEMMs ran at, against the [2048]^2 GEMM rate measured just before and after.
* **SDPA, same shapes**: its analytic FLOPs (2 N^2 d per head and pass, x3 for fwd+bwd) and rate.
  At equal efficiency, sdpa / ours can be no larger than the ratio of FLOPs: that ratio is
  the ceiling of the sdpa targets for an op that does this much GEMM work.
* **cpu-preset training step** (this tree): the share of the step inside the attention op
  (forward and backward), and the step time with that share removed: how fast the step could
  be with a free attention op (Amdahl), against the base commit's step from ``training.json``
  when that benchmark ran in the same run.

Profiler times carry the profiler's overhead; read the shares, not the absolute times.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import profile

from linear_rope import FavorFeatures

from .attention import D, M, make_inputs, ours_attention, ours_flops, sdpa_flops
from .common import RESULTS_DIR, cli, fmt, gemm_probe, gemm_n, report, setup

NAME = "bounds"
FULL = dict(n=4096, preset="cpu", batch=8)
QUICK = dict(n=128, preset="tiny", batch=2)
GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
            "aten::baddbmm_": (1, 2)}  # op -> positions of its two matrix operands


def _gemm_flops(name: str, shapes) -> float:
    i, j = GEMM_OPS[name]
    a, b = shapes[i], shapes[j]
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def profile_call(fn) -> dict:
    """Self CPU ms per kind (gemm, exp, other), executed GEMM GFLOP and the wall ms of one call."""
    fn()
    with profile(record_shapes=True) as p:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    ms = {"gemm": 0.0, "exp": 0.0, "other": 0.0}
    flops, top = 0.0, {}
    for e in p.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        t = e.self_cpu_time_total / 1e3
        if e.name in GEMM_OPS:
            ms["gemm"] += t
            flops += _gemm_flops(e.name, e.input_shapes)
        elif e.name in ("aten::exp", "aten::exp_"):
            ms["exp"] += t
        else:
            ms["other"] += t
        top[e.name] = top.get(e.name, 0.0) + t
    busiest = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    return {"wall_ms": 1e3 * wall, "self_ms": ms, "gemm_gflop": flops / 1e9,
            "gemm_gflop_per_s": flops / 1e9 / (ms["gemm"] / 1e3) if ms["gemm"] else None,
            "busiest_ms": dict(busiest)}


def train_step_share(preset: str, batch: int) -> dict:
    """One cpu-preset training step (this tree): ms in the attention op's forward and backward."""
    from linear_rope.model import PerformerLM

    torch.manual_seed(0)
    model = PerformerLM.from_preset(preset).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (batch, model.cfg.seq_len + 1))

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(2):
        step()
    t0 = time.perf_counter()
    step()
    step_s = time.perf_counter() - t0
    with profile() as p:
        step()
    tot = {e.key: e.cpu_time_total for e in p.key_averages()}
    attn = (tot.get("linear_rope::chunk_causal", 0.0) + tot.get("linear_rope::chunk_causal_backward", 0.0)) / 1e3
    whole = sum(e.self_cpu_time_total for e in p.key_averages()) / 1e3
    share = attn / whole if whole else None
    return {"step_s_unprofiled": step_s, "profiled_ms": whole, "attention_ms": attn, "attention_share": share,
            "step_s_if_attention_free": step_s * (1 - share) if share is not None else None}


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    n = cfg["n"]
    features = FavorFeatures(D, M)
    q, k, v, up = make_inputs(n)

    def ours():
        for t in (q, k, v):
            t.grad = None
        ours_attention(q, k, v, features, True).backward(up)

    def sdpa():
        for t in (q, k, v):
            t.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(up)

    gemm = gemm_probe(gemm_n(quick))
    gemm()
    op = profile_call(ours)
    sd = profile_call(sdpa)
    gemm()
    peak = max(gemm.rates)
    counted = ours_flops(n) / 1e9
    sd_flops = sdpa_flops(n) / 1e9
    share = train_step_share(cfg["preset"], cfg["batch"])
    base = None
    tj = Path(out_dir or RESULTS_DIR) / "training.json"
    if tj.is_file():
        with open(tj) as f:
            tr = json.load(f)
        if tr.get("quick") == quick:
            base = tr["step_s"]["base"]
    op_rate = counted / (op["wall_ms"] / 1e3)
    sd_rate = sd_flops / (sd["wall_ms"] / 1e3)
    rows = [
        ["ours fwd+bwd (profiled)", op["wall_ms"], op["self_ms"]["gemm"], op["self_ms"]["exp"], op["self_ms"]["other"],
         op["gemm_gflop"], op["gemm_gflop_per_s"]],
        ["sdpa fwd+bwd (profiled)", sd["wall_ms"], sd["self_ms"]["gemm"], sd["self_ms"]["exp"], sd["self_ms"]["other"],
         "-", "-"],
    ]
    notes = [
        f"N={n}: the counted work of ours is {fmt(counted)} GFLOP (attention.ours_flops); its GEMMs executed "
        f"{fmt(op['gemm_gflop'])} GFLOP ({fmt(op['gemm_gflop'] / counted)}x the count) at {fmt(op['gemm_gflop_per_s'])} "
        f"GFLOP/s, {fmt(100 * op['gemm_gflop_per_s'] / peak)}% of the {fmt(peak)} GFLOP/s [2048]^2 GEMM rate measured "
        f"around the profile; GEMMs are {fmt(100 * op['self_ms']['gemm'] / sum(op['self_ms'].values()))}% of the op's "
        f"self time, exp {fmt(100 * op['self_ms']['exp'] / sum(op['self_ms'].values()))}%, everything else "
        f"{fmt(100 * op['self_ms']['other'] / sum(op['self_ms'].values()))}%.",
        f"Busiest ops of ours (self ms): " + ", ".join(f"{k} {fmt(v)}" for k, v in op["busiest_ms"].items()) + ".",
        f"sdpa at N={n} does {fmt(sd_flops)} GFLOP, {fmt(sd_flops / counted)}x the counted work of ours, at "
        f"{fmt(sd_rate)} GFLOP/s ({fmt(100 * sd_rate / peak)}% of the GEMM rate); ours ran its counted work at "
        f"{fmt(op_rate)} GFLOP/s. sdpa / ours = FLOP ratio x (our rate / sdpa's rate) = {fmt(sd_flops / counted)} x "
        f"{fmt(op_rate / sd_rate)} here; a target above the FLOP ratio needs ours to run faster than SDPA's kernel.",
        f"{cfg['preset']}-preset training step ({cfg['batch']} x seq): the attention op (forward + backward) takes "
        f"{fmt(100 * share['attention_share'])}% of the profiled step; with a free attention op the step would take "
        f"{fmt(share['step_s_if_attention_free'])} s (measured {fmt(share['step_s_unprofiled'])} s)"
        + (f", so ours / base tokens/s could reach at most {fmt(base / share['step_s_if_attention_free'])}x "
           f"(base step {fmt(base)} s in training.json)." if base else "."),
    ]
    result = {
        "name": NAME,
        "quick": quick,
        "config": {"n": n, "d": D, "m": M, "preset": cfg["preset"], "batch": cfg["batch"]},
        "ours": op, "sdpa": sd, "gemm_gflop_per_s": peak, "ours_counted_gflop": counted, "sdpa_gflop": sd_flops,
        "training_step": share, "base_step_s": base,
        "table": {"headers": ["profile", "wall ms", "GEMM ms", "exp ms", "other ms", "GEMM GFLOP executed",
                              "GEMM GFLOP/s"], "rows": rows},
        "targets": [],
        "notes": notes,
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
