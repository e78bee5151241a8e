"""Kernel launches and host syncs per step, counted on the CPU: what a GPU would wait on.

    python -m benchmarks.launches                  # paper preset, N = 1024 and 4096 -> benchmarks/results/launches.json
    python -m benchmarks.launches --quick          # tiny sizes, seconds (the smoke test)
    python -m benchmarks.launches --backend torch --n 1024 4096 --out benchmarks/results/launches_baseline.json

The third made the baseline (the library as of commit 775219b; 2 to 4 minutes on one CPU thread).
``--backend`` sets ``LINEAR_ROPE_BACKEND`` for the run (recorded in the JSON). No GPU is needed:
a count depends on shapes, the path and the plan of what the forward keeps, not on the device.

Counting rules: ``benchmarks/counting.py`` (the one counter, which the tests use too).

Sizes: B = 1 (counts do not depend on B while the forward's keep plan is the same; the run checks
B = 2 against B = 4 on a small model: at B = 1 the parallel path's reshapes can be views where
B > 1 copies, 3 launches fewer a layer), bf16 autocast on the CPU. The model step and
``Trainer.train_step`` are counted at depths 1 and 2 and extrapolated to the preset's depth
(launches = fixed + depth x per layer); at the first N also at depth 3, and the run asserts the
three lie on a line. The compiled decode step is counted at depths 1 and 2 the same way.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from .common import commit
from . import counting
from .counting import US_PER_CALL, Counter, count

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "launches.json"


# ---------------------------------------------------------------------------------------------
# What is counted


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def attention_layer(cfg, N: int, B: int = 1) -> dict:
    """One RotaryLinearAttention of the preset, fwd and bwd under bf16 autocast; and the op alone
    (``rotary_linear_attention`` with FAVOR+ inside, bf16 q, k, v `[B, H, N, d]`), as a GPU times it."""
    from linear_rope import RotaryLinearAttention, rotary_linear_attention

    torch.manual_seed(0)
    layer = RotaryLinearAttention(cfg.dim, heads=cfg.heads, dim_head=cfg.dim_head, nb_features=cfg.nb_features,
                                  base=cfg.rope_base)
    x = torch.randn(B, N, cfg.dim, requires_grad=True)
    with _autocast():
        fwd, y = count(layer, x)
    bwd, _ = count(y.float().sum().backward)
    res = {"layer_fwd": fwd.as_dict(), "layer_bwd": bwd.as_dict()}
    q, k, v = (torch.randn(B, cfg.heads, N, cfg.dim_head, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    w = layer.features.projection
    fwd, y = count(rotary_linear_attention, q, k, v, projection=w)
    bwd, _ = count(y.backward, torch.ones_like(y))
    res.update(op_fwd=fwd.as_dict(), op_bwd=bwd.as_dict())
    for part in ("layer", "op"):
        f, b = res[f"{part}_fwd"], res[f"{part}_bwd"]
        g = collections.Counter(f["gemm_gflop"]) + collections.Counter(b["gemm_gflop"])
        res[f"{part}_fwd_bwd"] = {**_with_host({k: f[k] + b[k] for k in METRICS}),
                                  "gemm_gflop": {k: round(v, 4) for k, v in sorted(g.items())}}
    return res


def model_step(cfg, N: int, B: int = 1) -> dict:
    """One step of the model: forward (bf16 autocast), loss (fp32 cross-entropy), backward, clip."""
    from linear_rope import PerformerLM

    torch.manual_seed(0)
    model = PerformerLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, N + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    out = {}
    with _autocast():
        out["forward"], logits = count(model, x)
    out["loss"], loss = count(lambda: torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    out["backward"], _ = count(loss.backward)
    out["clip"], _ = count(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0)
    return out


def train_step(cfg, N: int, B: int = 1) -> dict:
    """``Trainer.train_step`` (bf16, fused AdamW): the first step (the optimizer's state is made)
    and the second (steady)."""
    import numpy as np

    from linear_rope.enwik8.config import TrainConfig
    from linear_rope.enwik8.trainer import Trainer

    raw = np.random.default_rng(0).integers(0, 256, 4 * B * N + 64 * N, dtype=np.uint8)
    splits = {"train": raw, "valid": raw[: 2 * N], "test": raw[: 2 * N]}
    with tempfile.TemporaryDirectory() as tmp:
        tc = TrainConfig(batch_size=B, steps=10, warmup_steps=1, out=tmp, precision="bf16")
        t = Trainer("rope-seed0", cfg, tc, splits)
        first, _ = count(t.train_step, 0)
        steady, _ = count(t.train_step, 1)
    return {"first": first, "steady": steady}


def _prefill(model, B: int):
    ids = torch.randint(0, model.cfg.vocab_size, (B, 8))
    with torch.no_grad(), _autocast():
        logits, states = model(ids, output_final_state=True)
    return logits[:, -1], states, ids.shape[1]


def _decode_step(model, B: int):
    """``PerformerLM.step`` and a greedy pick, bf16 autocast, no grad: the step ``benchmarks.gpu``
    times (its 25.4 ms per step on the H200, B = 8)."""
    logits, states, pos = _prefill(model, B)

    @torch.no_grad()
    def one():
        with _autocast():
            return model.step(logits.argmax(-1), states, pos)[0]
    return one


def _decoder_step(model, B: int):
    """``Decoder.step`` (what ``generate`` runs): state preallocated and updated in place, after a
    prefill of 16 tokens; the next token is the last logits' argmax, on the device."""
    from linear_rope.decode import Decoder

    dec = Decoder(model, B, 16 + 64, compile=False)
    tok = dec.prefill(torch.randint(0, 256, (B, 16))).argmax(-1)

    @torch.no_grad()
    def one():
        return dec.step(tok)
    return one


# What a decode step is: name -> make(model, B) -> a callable running one step. A new decoder
# is one more line here.
DECODERS = {"PerformerLM.step": _decode_step, "Decoder.step": _decoder_step}


def decode(cfg, decoder: str, B: int = 1, compiled: bool = False) -> dict:
    from linear_rope import PerformerLM

    torch.manual_seed(0)
    model = PerformerLM(cfg).eval()
    fn = DECODERS[decoder](model, B)
    fn()  # warm: lazy tables and caches
    if not compiled:
        return count(fn)[0].as_dict()
    return compiled_counts(fn)


def compiled_counts(fn) -> dict:
    """``fn`` under ``torch.compile`` (inductor): graphs and breaks from ``torch._dynamo.explain``,
    launches = the kernel calls in the generated wrapper code (one per generated kernel call,
    one per extern kernel such as a GEMM) plus the ATen ops that run outside the graphs."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)()
    t0 = time.perf_counter()
    cfn = torch.compile(fn, backend="inductor")
    _, codes = run_and_get_code(cfn)
    compile_s = time.perf_counter() - t0
    kernels = 0
    for code in codes:
        body = code.split("def call(", 1)[-1].split("\ndef ", 1)[0]
        kernels += sum(line.strip().startswith(("cpp_fused", "extern_kernels.", "triton_")) or ".run(" in line
                       for line in body.splitlines())
    return {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count,
            "break_reasons": sorted({_short(r.reason) for r in ex.break_reasons}),
            "kernel_calls_in_wrapper": kernels, "compile_s": round(compile_s, 1)}


def _short(reason: str) -> str:
    return " ".join(str(reason).split())[:160]


def dynamo(cfg, N: int) -> dict:
    """``torch._dynamo.explain`` of the model forward (the given depth), eager backend."""
    import torch._dynamo

    from linear_rope import PerformerLM

    torch.manual_seed(0)
    model = PerformerLM(cfg)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(torch.randint(0, cfg.vocab_size, (1, N)))
    return {"depth": cfg.depth, "N": N, "graphs": ex.graph_count, "graph_breaks": ex.graph_break_count,
            "break_reasons": sorted({_short(r.reason) for r in ex.break_reasons}),
            "ops_per_graph": [len(g) for g in ex.ops_per_graph]}


# ---------------------------------------------------------------------------------------------
# Depth extrapolation and the run

METRICS = ("launches", "syncs", "dispatcher_calls")


def _m(c: Counter) -> dict:
    return {"launches": c.launches, "syncs": c.syncs, "dispatcher_calls": c.calls}


def extrapolate(by_depth: dict, depth: int) -> dict:
    """{depth: {metric: value}} at depths 1, 2 (, 3) -> fixed, per_layer and the value at ``depth``;
    AssertionError where depth 3 is off the line through depths 1 and 2."""
    one, two = by_depth[1], by_depth[2]
    per = {k: two[k] - one[k] for k in one}
    fixed = {k: one[k] - per[k] for k in one}
    if 3 in by_depth:
        off = {k: (by_depth[3][k], fixed[k] + 3 * per[k]) for k in one if by_depth[3][k] != fixed[k] + 3 * per[k]}
        assert not off, f"counts are not linear in depth (depth 3: counted, predicted): {off}"
    return {"fixed": fixed, "per_layer": per, f"depth_{depth}": {k: fixed[k] + depth * per[k] for k in one}}


def _sources(c1: Counter, c2: Counter, depth: int, top: int = 12) -> dict:
    """Sync sources at ``depth``, extrapolated from depths 1 and 2 as the totals are."""
    keys = set(c1.sync_at) | set(c2.sync_at)
    est = {k: c1.sync_at[k] + (depth - 1) * (c2.sync_at[k] - c1.sync_at[k]) for k in keys}
    return {f"{w} ({what})": v for (w, what), v in sorted(((k, v) for k, v in est.items() if v), key=lambda kv: -kv[1])[:top]}


def _with_host(d: dict) -> dict:
    return {**d, "host_ms_est": round(d["dispatcher_calls"] * US_PER_CALL / 1e3, 2)}


def run(preset: str, ns, depth: int, decode_batch: int, compiled: bool, log=print) -> dict:
    from dataclasses import replace

    from linear_rope.model import MODEL_PRESETS, ModelConfig

    base = ModelConfig(**MODEL_PRESETS[preset])
    depths = {n: (1, 2, 3) if n == ns[0] else (1, 2) for n in ns}  # depth 3 checks the line once
    res = {"preset": preset, "attention": {}, "model_step": {}, "train_step": {}, "decode": {}}
    small = ModelConfig(**MODEL_PRESETS["tiny"])
    attention_layer(small, 64, B=1)  # warm: what the first call at a length builds and keeps (RoPE tables)
    # B = 2 against 4: at B = 1 a reshape can be a view where B > 1 needs a copy (a few launches fewer)
    b1, b2 = (attention_layer(small, 64, B=b) for b in (2, 4))
    res["b_independent"] = {"config": "tiny preset layer, N = 64, B = 2 vs 4", "equal": all(
        b1[p][k] == b2[p][k] for p in ("layer_fwd", "layer_bwd") for k in METRICS)}
    assert res["b_independent"]["equal"], "counts differ between B = 2 and B = 4"
    for n in ns:
        t0 = time.perf_counter()
        res["attention"][n] = attention_layer(base, n)
        steps = {d: model_step(replace(base, depth=d, seq_len=n), n) for d in depths[n]}
        ms = {}
        for phase in ("forward", "loss", "backward", "clip"):
            e = extrapolate({d: _m(steps[d][phase]) for d in depths[n]}, depth)
            ms[phase] = {**e, f"depth_{depth}": _with_host(e[f"depth_{depth}"])}
        tot = extrapolate({d: {k: sum(_m(steps[d][p])[k] for p in ms) for k in METRICS} for d in depths[n]}, depth)
        ms["total"] = {**tot, f"depth_{depth}": _with_host(tot[f"depth_{depth}"])}
        att = res["attention"][n]["layer_fwd_bwd"]["launches"] * depth
        ms["attention_share_of_launches"] = round(att / tot[f"depth_{depth}"]["launches"], 3)
        res["model_step"][n] = ms
        ts = {d: train_step(replace(base, depth=d, seq_len=n), n) for d in depths[n]}
        res["train_step"][n] = {
            which: {**(e := extrapolate({d: _m(ts[d][which]) for d in depths[n]}, depth)),
                    f"depth_{depth}": _with_host(e[f"depth_{depth}"]),
                    "sync_sources": _sources(ts[1][which], ts[2][which], depth)}
            for which in ("first", "steady")}
        log(f"N = {n}: counted in {time.perf_counter() - t0:.0f} s")
    full = replace(base, depth=depth)
    for i, name in enumerate(DECODERS):
        res["decode"][name] = {"eager": decode(full, name, B=decode_batch)}
        if i == 0 and compiled:
            t0 = time.perf_counter()
            c = {d: decode(replace(base, depth=d), name, B=decode_batch, compiled=True) for d in (1, 2)}
            k1, k2 = c[1]["kernel_calls_in_wrapper"], c[2]["kernel_calls_in_wrapper"]
            res["decode"][name]["compiled"] = {
                **c[2], "counted_depth": 2, "kernel_calls_in_wrapper": None,
                "kernel_calls_by_depth": {1: k1, 2: k2}, f"launches_depth_{depth}": k1 + (depth - 1) * (k2 - k1),
                "syncs": "none outside _assert_async when the step is one graph" if c[2]["graphs"] == 1 else
                         "graph breaks: see break_reasons"}
            log(f"compiled decode counted in {time.perf_counter() - t0:.0f} s")
        elif i == 0:
            res["decode"][name]["compiled"] = {"status": "not measured: --quick or --no-compile"}
    res["dynamo"] = dynamo(replace(base, depth=2, seq_len=ns[0]), ns[0])
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.launches", allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=None, help="LINEAR_ROPE_BACKEND for the run (torch, auto, ...; default: "
                   "as the environment has it, else auto)")
    p.add_argument("--n", type=int, nargs="+", default=None, help="sequence lengths (default 1024 4096)")
    p.add_argument("--quick", action="store_true", help="tiny preset, N = 64, no compile: seconds")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled decode step (minutes on a CPU)")
    p.add_argument("--out", default=None, help=f"JSON path (default {OUT.relative_to(ROOT)})")
    a = p.parse_args(argv)
    ns = a.n or ([64] if a.quick else [1024, 4096])
    if any(n < 1 for n in ns):
        p.exit(2, f"launches: error: --n must be positive, got {ns}\n")
    with mock.patch.dict(os.environ, {} if a.backend is None else {"LINEAR_ROPE_BACKEND": a.backend}):
        return _main(a, ns, argv)  # then the caller's environment again (a test's, say)


def _main(a, ns, argv) -> dict:
    from linear_rope.ops.backend import backend

    try:
        chosen = backend()
    except ValueError as e:
        print(f"launches: error: --backend: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.set_num_threads(1)
    preset, depth = ("tiny", 2) if a.quick else ("paper", 12)
    t0 = time.perf_counter()
    res = run(preset, ns, depth, decode_batch=2 if a.quick else 8, compiled=not (a.quick or a.no_compile))
    cmd = "python -m benchmarks.launches" + (f" {' '.join(argv)}" if argv is not None else
                                             (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""))
    out = {"name": "launches", "command": cmd.strip(), "commit": commit(), "backend": chosen,
           "torch": torch.__version__, "quick": a.quick, "depth": depth, "B": 1,
           "decode_batch": 2 if a.quick else 8, "autocast": "bf16 on the CPU", "ns": ns,
           "rules": counting.__doc__.split("Rules:")[1].strip(),
           "us_per_call": US_PER_CALL, **res, "seconds": round(time.perf_counter() - t0, 1)}
    path = Path(a.out) if a.out else OUT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    _print(out)
    print(f"wrote {path}")
    return out


def _print(out: dict) -> None:
    d = out["depth"]
    for n in out["ns"]:
        a, ms, ts = out["attention"][n], out["model_step"][n], out["train_step"][n]["steady"][f"depth_{d}"]
        print(f"N = {n}: attention layer fwd+bwd {a['layer_fwd']['launches']} + {a['layer_bwd']['launches']} launches, "
              f"{a['layer_fwd_bwd']['syncs']} syncs; op alone {a['op_fwd_bwd']['launches']} launches, "
              f"{a['op_fwd_bwd']['dispatcher_calls']} calls (~{a['op_fwd_bwd']['host_ms_est']} ms host)")
        for ph in ("forward", "loss", "backward", "clip", "total"):
            v = ms[ph][f"depth_{d}"]
            print(f"  model step {ph:<8} depth {d}: {v['launches']:>6} launches {v['syncs']:>3} syncs "
                  f"~{v['host_ms_est']} ms host")
        print(f"  attention share of the step's launches: {ms['attention_share_of_launches']:.0%}; "
              f"Trainer.train_step (steady): {ts['launches']} launches, {ts['syncs']} syncs")
    for name, dec in out["decode"].items():
        e = dec["eager"]
        print(f"decode {name}: {e['launches']} launches, {e['syncs']} syncs, ~{e['host_ms_est']} ms host"
              + (f"; compiled: {dec['compiled'].get(f'launches_depth_{d}', dec['compiled'].get('status'))} "
                 f"kernel calls" if "compiled" in dec else ""))
    dy = out["dynamo"]
    print(f"dynamo (depth {dy['depth']} forward): {dy['graphs']} graph(s), {dy['graph_breaks']} break(s)")


if __name__ == "__main__":
    main()
