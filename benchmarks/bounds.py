"""What bounds the targets: profiles of the op (both paths), of SDPA and of a training step per preset.

    python -m benchmarks.bounds [--quick]

How it measures: docs/performance.md, "Methods" (``benchmarks.bounds``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import profile

from linear_rope import FavorFeatures

from .attention import D, M, make_inputs, ours_flops, sdpa_flops
from .common import RESULTS_DIR, cli, fmt, gemm_n, gemm_probe, ours_attention, ours_features_in, report, setup, threads

NAME = "bounds"
FULL = dict(n=4096, presets=("cpu20m", "cpu"))
QUICK = dict(n=128, presets=("tiny",))
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


OP_MARKERS = ("chunkcausal", "linear_rope")  # the op's events, before and after the custom op
PARTS = ("attention op", "GEMM outside the op", "LayerNorm", "GELU", "loss", "optimizer + clip", "copies",
         "compiled regions", "other")


def _part(e, inside_op: bool, in_optimizer: bool) -> str:
    name = e.name.lower()
    if inside_op:
        return "attention op"
    if in_optimizer or "_foreach" in name or "adam" in name:
        return "optimizer + clip"
    if e.name in GEMM_OPS or name in ("aten::linear", "aten::matmul"):
        return "GEMM outside the op"
    for part, keys in (("LayerNorm", ("layer_norm",)), ("GELU", ("gelu",)),
                       ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
                       ("copies", ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat")),
                       ("compiled regions", ("compiled", "cpp_fused", "graph_"))):
        if any(k in name for k in keys):
            return part
    return "other"


def step_parts(events) -> dict[str, float]:
    """Self CPU ms of a profiled step by part (``PARTS``): each event goes to the op if any
    ancestor is the op, to the optimizer if any ancestor is an ``Optimizer.*`` region."""
    ms = dict.fromkeys(PARTS, 0.0)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        inside_op = in_opt = False
        a = e
        while a is not None:
            n = a.name.lower()
            inside_op |= any(k in n for k in OP_MARKERS)
            in_opt |= n.startswith("optimizer.")
            a = a.cpu_parent
        ms[_part(e, inside_op, in_opt)] += e.self_cpu_time_total / 1e3
    return ms


def train_step_profile(preset: str, threads: int, steps: int = 3) -> dict:
    """One profiled training step of ``preset`` with this tree's Trainer (after ``steps`` warm-up
    steps, where a compiled model compiles): ms by part, the unprofiled step time, and the step
    time with a free attention op."""
    import tempfile

    import numpy as np

    from linear_rope.enwik8.config import TRAIN_PRESETS, TrainConfig
    from linear_rope.enwik8.trainer import Trainer
    from linear_rope.model import MODEL_PRESETS, ModelConfig

    raw = np.random.default_rng(0).integers(0, 256, 400_000, dtype=np.uint8)
    splits = {"train": raw[:300_000], "valid": raw[300_000:350_000], "test": raw[350_000:]}
    with tempfile.TemporaryDirectory() as out:
        tr = Trainer("rope-seed0", ModelConfig(**MODEL_PRESETS[preset]),
                     TrainConfig(**{**TRAIN_PRESETS[preset], "out": out, "threads": threads}), splits)
        tr._open()
        try:
            for s in range(steps):
                tr.train_step(s)
            times = []
            for s in range(steps, steps + 3):
                t0 = time.perf_counter()
                tr.train_step(s)
                times.append(time.perf_counter() - t0)
            with profile() as p:
                tr.train_step(steps + 3)
        finally:
            tr._close()
    parts = step_parts(p.events())
    whole = sum(parts.values())
    share = parts["attention op"] / whole if whole else None
    step_s = sorted(times)[1]
    return {"preset": preset, "compiled": bool(getattr(tr, "compiled", tr.tc.compile)), "step_s_unprofiled": step_s,
            "profiled_ms": whole, "parts_ms": parts, "attention_share": share,
            "step_s_if_attention_free": step_s * (1 - share) if share is not None else None}


def _op_note(label: str, op: dict, counted: float, peak: float) -> str:
    tot = sum(op["self_ms"].values())
    return (f"{label}: its GEMMs executed {fmt(op['gemm_gflop'])} GFLOP ({fmt(op['gemm_gflop'] / counted)}x the "
            f"{fmt(counted)} GFLOP yardstick) at {fmt(op['gemm_gflop_per_s'])} GFLOP/s, "
            f"{fmt(100 * op['gemm_gflop_per_s'] / peak)}% of the {fmt(peak)} GFLOP/s [2048]^2 GEMM rate measured around "
            f"the profile; GEMMs are {fmt(100 * op['self_ms']['gemm'] / tot)}% of the op's self time, exp "
            f"{fmt(100 * op['self_ms']['exp'] / tot)}%, everything else {fmt(100 * op['self_ms']['other'] / tot)}%. "
            f"Busiest ops (self ms): " + ", ".join(f"{k} {fmt(v)}" for k, v in op["busiest_ms"].items()) + ".")


def main(quick: bool = False, out_dir=None) -> dict:
    cfg = QUICK if quick else FULL
    setup(quick)
    n = cfg["n"]
    features = FavorFeatures(D, M)
    q, k, v, up = make_inputs(n)

    def call(op):
        def run():
            for t in (q, k, v):
                t.grad = None
            op(q, k, v).backward(up)
        return run

    gemm = gemm_probe(gemm_n(quick))
    gemm()
    ops = {"inside": profile_call(call(lambda q, k, v: ours_attention(q, k, v, features, True))),
           "features_in": profile_call(call(lambda q, k, v: ours_features_in(q, k, v, features, True))),
           "sdpa": profile_call(call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)))}
    gemm()
    peak = max(gemm.rates)
    counted = ours_flops(n) / 1e9
    sd_flops = sdpa_flops(n) / 1e9
    base = {}
    tj = Path(out_dir or RESULTS_DIR) / "training.json"
    if tj.is_file():
        tr = json.loads(tj.read_text())
        if tr.get("quick") == quick and "presets" in tr:
            base = {p: r["step_s"]["base"] for p, r in tr["presets"].items()}
    steps = {p: train_step_profile(p, 1 if quick else threads()) for p in cfg["presets"]}
    op, sd = ops["inside"], ops["sdpa"]
    op_rate, sd_rate = counted / (op["wall_ms"] / 1e3), sd_flops / (sd["wall_ms"] / 1e3)
    rows = [[f"{name} fwd+bwd (profiled)", o["wall_ms"], o["self_ms"]["gemm"], o["self_ms"]["exp"], o["self_ms"]["other"],
             o["gemm_gflop"] if name != "sdpa" else "-", o["gemm_gflop_per_s"] if name != "sdpa" else "-"]
            for name, o in ops.items()]
    notes = [
        _op_note(f"inside, N={n}", op, counted, peak),
        _op_note(f"features in, N={n}", ops["features_in"], counted, peak),
        f"sdpa at N={n} does {fmt(sd_flops)} GFLOP, {fmt(sd_flops / counted)}x the yardstick of ours, at "
        f"{fmt(sd_rate)} GFLOP/s ({fmt(100 * sd_rate / peak)}% of the GEMM rate); ours (inside) ran the yardstick at "
        f"{fmt(op_rate)} GFLOP/s. sdpa / ours = FLOP ratio x (our rate / sdpa's rate) = {fmt(sd_flops / counted)} x "
        f"{fmt(op_rate / sd_rate)} here; a target above the FLOP ratio needs ours to run faster than SDPA's kernel.",
    ]
    for p, st in steps.items():
        parts = ", ".join(f"{k} {fmt(100 * v / st['profiled_ms'])}%" for k, v in st["parts_ms"].items())
        notes.append(
            f"{p} training step ({'compiled' if st['compiled'] else 'eager'}, {fmt(st['step_s_unprofiled'])} s "
            f"unprofiled): {parts} of the profiled step's self time; with a free attention op the step would take "
            f"{fmt(st['step_s_if_attention_free'])} s"
            + (f", so ours / base tokens/s could reach {fmt(base[p] / st['step_s_if_attention_free'])}x with the rest "
               f"as it is (base step {fmt(base[p])} s in training.json)." if p in base else "."))
    result = {
        "name": NAME, "quick": quick, "config": {"n": n, "d": D, "m": M, "presets": list(cfg["presets"])},
        "ours": op, "ours_features_in": ops["features_in"], "sdpa": sd, "gemm_gflop_per_s": peak,
        "ours_counted_gflop": counted, "sdpa_gflop": sd_flops, "training_steps": steps, "base_step_s": base,
        "table": {"headers": ["profile", "wall ms", "GEMM ms", "exp ms", "other ms", "GEMM GFLOP executed",
                              "GEMM GFLOP/s"], "rows": rows},
        "targets": [], "notes": notes,
    }
    return report(result, out_dir)


if __name__ == "__main__":
    cli(main, __doc__)
