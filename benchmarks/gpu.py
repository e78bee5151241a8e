"""The GPU window: the rows users compare, in order, in one call of at most 570 s (docs/gpu.md).

    python -m benchmarks.gpu --out OUT                         # CUDA: the rows of ROWS, in order
    python -m benchmarks.gpu --device cpu --quick --out OUT    # toy sizes (CI's dry run)
    python -m benchmarks.gpu --plan                            # the rows and their budgets, as JSON

A row starts only while the window (``--until``: gpu_plan.sh's start + 570 s) holds its budget,
else it is recorded as skipped with the reason; SIGALRM stops it at its budget plus ``GRACE_S``.
Each row writes ``OUT/<row>.json`` as it ends, and ``OUT/window.json`` / ``.md`` list the rows so
far. Labels come from what ran: the path the op recorded at the row's own shape (a compiled
graph holds the same path) and, on CUDA, the attention kernels a step launched.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from linear_rope import FavorFeatures, PerformerLM, rotary_linear_attention
from linear_rope.decode import Decoder
from linear_rope.enwik8.step import compile_blocks
from linear_rope.ops.backend import record_paths, use_backend

from . import gpu_checks
from .attention import ours_flops, sdpa_flops
from .common import (NEEDS_CUDA, RESULTS_DIR, PartTimeout, batch_of, deadline, device_info, fmt, format_table, is_oom,
                     load_corpus, measure, one_line, time_call, write_json)

WINDOW_S, SETUP_S, GRACE_S = 570, 30, 15  # the call, gpu_plan.sh's set-up (wheels, imports), a row's overrun
# (name, budget s, kind, keywords), run in this order: softmax beside Eq. 19 on the default path
# (the fused kernels on CUDA) at 1k and 4k (the paper preset, bf16 autocast, 16 x 1024 tokens a
# step; the fused rows' budgets hold the kernels' JIT compile), then Eq. 19 on the chunk-parallel
# path at 1k, decoding, the op on the default path, the checks. What no longer fits the 540 s
# (Eq. 18, ``none``, beside Eq. 19) is dropped from the end: docs/gpu.md.
ROWS = (("train_softmax_1k", 55, "train", dict(position="softmax", n=1024)),
        ("train_rope_1k", 90, "train", dict(position="rope", n=1024)),
        ("train_softmax_4k", 55, "train", dict(position="softmax", n=4096)),
        ("train_rope_4k", 80, "train", dict(position="rope", n=4096)),
        ("train_rope_parallel_1k", 65, "train", dict(position="rope", n=1024, backend="parallel")),
        ("decode_1k", 45, "decode", dict(context=1024)),  # the step's compile: 12 layers in one graph
        ("decode_16k", 35, "decode", dict(context=16384)),
        ("op", 55, "op", {}),
        ("checks", 55, "checks", {}))
FULL = dict(preset="paper", tokens=16 * 1024, row_s=10.0, warmup=2, corpus=1 << 26, scale=1, dec_batch=8,
            dec_warm=5, dec_steps=64, op_shape=(8, 12), op_ns=(1024, 4096, 16384), reps=10, cell_s=0.5)
QUICK = dict(preset="tiny", tokens=4 * 64, row_s=0.5, warmup=1, corpus=1 << 20, scale=1 / 16, dec_batch=2,
             dec_warm=3, dec_steps=8, op_shape=(1, 2), op_ns=(64, 128), reps=2, cell_s=0.1)
LR, D, M, FLA_MAX_CONFIGS = 3e-4, 64, 266, 4


class Skip(Exception):
    """A row that cannot run here; its message is the row's status."""


class Window:
    """One call: the device, the sizes, the clock of the window and of the row now running."""

    def __init__(self, device: torch.device, quick: bool, window_s: float, compile: bool, data: str | None):
        self.device, self.quick, self.compile, self.data, self.cuda = device, quick, compile, data, device.type == "cuda"
        self.cfg, self.start, self.window_s, self.row_end = QUICK if quick else FULL, time.perf_counter(), window_s, 0.0

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left to the row now running (its budget, within the window's)."""
        return min(self.row_end, self.start + self.window_s) - time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def peak_mib(self, reset: bool = False):
        """The peak allocated since the last reset, MiB (``reset``: start a new one)."""
        if self.cuda and reset:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else NEEDS_CUDA


def compiles() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def compiled_label(paths: list[str], compiled: bool) -> str:
    """The attention path of ``paths`` (recorded eagerly: a compiled graph holds the same path)."""
    label = "; ".join(dict.fromkeys(paths)) or "no linear attention call"
    return label + (", compiled" if compiled else "")


def attention_kernels(w: Window, step) -> list[str] | str:
    """The GPU kernels of one call of ``step`` whose names say attention (flash, fmha, sdpa, ...)."""
    if not w.cuda:
        return f"{NEEDS_CUDA} (kernel names)"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        w.sync()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    return sorted(n[:120] for n in names if any(s in n.lower() for s in ("flash", "fmha", "attention", "sdpa")))


def flops_per_token(model: PerformerLM, seq: int) -> float:
    """6 x the parameters but the embedding, plus each layer's attention (fwd + bwd)."""
    c = model.cfg
    attn = sdpa_flops(seq, d=c.dim_head, heads=c.heads) if c.position == "softmax" else \
        ours_flops(seq, d=c.dim_head, m=c.nb_features, heads=c.heads)
    return 6 * (model.num_params() - model.tok_emb.weight.numel()) + c.depth * attn / seq


def _train_step(model, opt, x, y) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def train_row(w: Window, rec: dict, position: str, n: int, backend: str | None = None) -> None:
    """``_train_row`` on the default path (``LINEAR_ROPE_BACKEND`` as the user has it), or with
    ``backend`` forced for the whole row (its graphs are traced under it)."""
    rec["backend"] = backend or "default (LINEAR_ROPE_BACKEND as set: auto unless given)"
    with use_backend(backend) if backend else contextlib.nullcontext():
        _train_row(w, rec, position, n)


def _train_row(w: Window, rec: dict, position: str, n: int) -> None:
    """Training steps of a fresh model at ``position`` and N = ``n``, the same tokens a step at
    every N; dynamo reset first, so no row inherits another's graphs or dynamic shapes."""
    c = w.cfg
    seq = max(16, int(n * c["scale"]))
    batch = max(1, c["tokens"] // seq)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PerformerLM.from_preset(c["preset"], position=position, seq_len=seq,
                                    feature_redraw_interval=0).to(w.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    corpus, source = load_corpus(w.data, c["corpus"])
    g = torch.Generator().manual_seed(0)
    x0, _ = batch_of(corpus, batch, seq, g)
    with record_paths() as paths, torch.no_grad(), torch.autocast(w.device.type, dtype=torch.bfloat16):
        model(x0.to(w.device))  # eager, at the row's shape: the path its calls take
    how = compile_blocks(model) if w.compile else "eager (compiled on CUDA; --compile on forces it)"
    rec.update(preset=c["preset"], position=position, N=seq, batch=batch, data=source, compile=how,
               autocast="bfloat16", optimizer=f"AdamW lr {LR}, betas (0.9, 0.95), weight decay 0.1, clip 1.0",
               path=compiled_label(paths, w.compile))

    def step():
        x, y = (t.to(w.device, non_blocking=True) for t in batch_of(corpus, batch, seq, g))
        return _train_step(model, opt, x, y)

    w.peak_mib(reset=True)
    c0 = compiles()
    rec["compile_s"] = time_call(step, w.device)  # the first step compiles forward and backward
    rec["graphs_compiled"] = compiles() - c0
    for _ in range(c["warmup"]):
        step()
    w.sync()
    t1, losses = time.perf_counter(), []
    while len(losses) < 2 or (time.perf_counter() - t1 < c["row_s"] and w.left() > 8):
        losses.append(step())
    w.sync()
    dt = time.perf_counter() - t1
    tps, fpt, peak = len(losses) * batch * seq / dt, flops_per_token(model, seq), device_info(w.device)["bf16_peak_tflops"]
    rec.update(timed_steps=len(losses), timed_s=dt, tokens_per_s=tps, ms_per_step=1e3 * dt / len(losses),
               flops_per_token=fpt, mfu=fpt * tps / (peak * 1e12) if peak else f"{NEEDS_CUDA} (no bf16 peak)",
               peak_memory_mib=w.peak_mib(), last_loss=float(losses[-1]), graphs_after_first_step=compiles() - c0 - rec["graphs_compiled"])
    rec["attention_kernels"] = kernels = attention_kernels(w, step)
    if position == "softmax":  # what SDPA launched, where the profiler saw it
        rec["path"] = ("flash SDPA" if any("flash" in k.lower() for k in kernels) else "SDPA, not flash") + \
            f" (kernels: {', '.join(kernels) or 'none named'})" if isinstance(kernels, list) else \
            "F.scaled_dot_product_attention (the CPU's kernel)"


def decode_row(w: Window, rec: dict, context: int, compile: bool | None = None) -> None:
    """Decoding ms a token on one ``Decoder`` (batch, max_len = prompt + warm-up + timed steps):
    the prompt read in parallel, warm-up steps (the compile, the CUDA graph's recording), then
    the timed steps on the same decoder: the shapes timed are the shapes warmed up, and the
    graphs compiled inside the timed steps are counted (0 expected)."""
    c = w.cfg
    C, B, W, T = max(16, int(context * c["scale"])), c["dec_batch"], c["dec_warm"], c["dec_steps"]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PerformerLM.from_preset(c["preset"]).to(w.device).eval()
    dec = Decoder(model, batch_size=B, max_len=C + W + T, compile=compile)
    ids = torch.randint(0, 256, (B, C), generator=torch.Generator().manual_seed(0)).to(w.device)
    rec.update(preset=c["preset"], context=C, batch=B, autocast="bfloat16", greedy=True, shapes={})
    w.peak_mib(reset=True)
    tok = [None]

    def steps(n):
        for _ in range(n):
            tok[0] = dec.step(tok[0]).argmax(-1)
    with torch.no_grad(), torch.autocast(w.device.type, dtype=torch.bfloat16):
        rec["prefill_s"] = time_call(lambda: tok.__setitem__(0, dec.prefill(ids).argmax(-1)), w.device)
        for phase, n in (("warmup", W), ("timed", T)):
            rec["shapes"][phase] = {"batch": dec.B, "max_len": dec.max_len, "token": list(tok[0].shape)}
            c0 = compiles()
            rec[f"{phase}_s"] = time_call(lambda: steps(n), w.device)
            rec[f"graphs_compiled_{phase}"] = compiles() - c0
    rec.update(compiled=compile if compile is not None else w.cuda, ms_per_step=1e3 * rec["timed_s"] / T, timed_steps=T,
               decode_tokens_per_s=B * T / rec["timed_s"], prefill_tokens_per_s=B * C / rec["prefill_s"],
               peak_memory_mib=w.peak_mib())


def _op_impls(w: Window) -> dict:
    """name -> (fn(q, k, v) or None, what it is or why not)."""
    W = FavorFeatures(D, M).projection.to(w.device)
    impls = {"ours": (lambda q, k, v: rotary_linear_attention(q, k, v, projection=W),
                      "linear_rope.rotary_linear_attention(projection=W [266, 64]), the default path "
                      "(LINEAR_ROPE_BACKEND unset: auto), eager")}
    if w.cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        impls["sdpa"] = (flash, "flash SDPA (SDPBackend.FLASH_ATTENTION), causal")
    else:
        impls["sdpa"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         f"SDPA, the CPU's kernel (flash: {NEEDS_CUDA})")
    impls["fla"] = (None, f"{NEEDS_CUDA} (fla's kernels are Triton GPU kernels)")
    try:
        if w.cuda:
            from fla.ops.linear_attn import chunk_linear_attn
            from triton.runtime.autotuner import Autotuner

            for mod in [m for n, m in list(sys.modules.items()) if n.startswith("fla.") and m is not None]:
                for obj in vars(mod).values():  # fla autotunes every config on a first call: keep the first few
                    while hasattr(obj, "fn") and not isinstance(obj, Autotuner):  # under triton.heuristics
                        obj = obj.fn
                    if isinstance(obj, Autotuner):
                        obj.configs = obj.configs[:FLA_MAX_CONFIGS]
            impls["fla"] = (lambda q, k, v: chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v, normalize=True)[0],
                            f"fla chunk_linear_attn, elu+1 features, normalize=True, autotune capped at {FLA_MAX_CONFIGS}")
    except Exception as e:  # noqa: BLE001 - not installed, or a Triton / torch mismatch at import
        impls["fla"] = (None, f"skipped: fla not importable ({one_line(e)})")
    return impls


def op_row(w: Window, rec: dict) -> None:
    """The op alone, bf16, B x H x N x 64, forward and forward + backward: ours on the default
    path against flash SDPA and fla; each cell the median of CUDA-synchronised calls."""
    c = w.cfg
    B, H = c["op_shape"]
    impls = _op_impls(w)
    rec.update(B=B, H=H, d=D, m=M, dtype="bfloat16", impls={n: d for n, (_, d) in impls.items()}, cells=[])
    g = torch.Generator(device=w.device).manual_seed(0)
    for n in c["op_ns"]:
        q, k, v = (torch.randn(B, H, n, D, device=w.device, dtype=torch.bfloat16, generator=g) for _ in range(3))
        for name, (fn, _) in impls.items():
            for mode in ("fwd", "fwd+bwd"):
                cell = {"impl": name, "N": n, "mode": mode}
                rec["cells"].append(cell)
                if fn is None or w.left() < 5:
                    cell["status"] = "skipped: row budget spent" if fn else impls[name][1]
                    continue
                lay = (lambda t: t.transpose(1, 2).contiguous()) if name == "fla" else torch.clone  # fla: [B, N, H, D]
                leaves = [lay(t).requires_grad_(mode != "fwd") for t in (q, k, v)]

                def call(fn=fn, leaves=leaves, mode=mode):
                    with torch.set_grad_enabled(mode != "fwd"):
                        out = fn(*leaves)
                        if mode != "fwd":
                            torch.autograd.grad(out, leaves, torch.ones_like(out))
                try:
                    with record_paths() as paths:
                        r = measure(call, device=w.device, reps=c["reps"], max_s=c["cell_s"])
                    cell.update(status="ok", **r, path=(paths[0] if paths else None) if name == "ours" else name)
                except Exception as e:  # noqa: BLE001 - recorded, and the next cell runs (PartTimeout is no Exception)
                    cell["status"] = "error: " + ("out of memory" if is_oom(e) else one_line(e))
                    if w.cuda:
                        torch.cuda.empty_cache()
        del q, k, v
    rec["paths"] = sorted({x["path"] for x in rec["cells"] if x.get("impl") == "ours" and x.get("path")})


RUNNERS = {"train": train_row, "decode": decode_row, "op": op_row, "checks": lambda w, rec: rec.update(gpu_checks.run(w))}


def plan() -> dict:
    rows = [{"row": n, "budget_s": b} for n, b, _, _ in ROWS]
    return {"window_s": WINDOW_S, "setup_s": SETUP_S, "rows": rows, "total_s": SETUP_S + sum(r["budget_s"] for r in rows)}


def render(res: dict) -> str:
    out = [f"## The GPU window (`{res['command']}`)", "", f"- Device: {res['device'].get('name')}; torch "
           f"{res['device'].get('torch')}; started {res['started_utc']} UTC; {fmt(res.get('wall_s'))} s of a "
           f"{fmt(res['window_s'])} s window" + ("; **quick: toy sizes, figures mean nothing**" if res["quick"] else ""), ""]
    rows = res["rows"]
    tr = [[r["row"], r.get("path", "-"), r.get("tokens_per_s"), r.get("mfu"), r.get("ms_per_step"), r.get("compile_s"),
           r.get("peak_memory_mib"), r["status"]] for r in rows if r["row"].startswith("train")]
    out += [format_table(["row", "attention path", "tokens/s", "MFU", "ms/step", "compile s", "peak MiB", "status"], tr), ""]
    de = [[r["row"], r.get("batch"), r.get("context"), r.get("ms_per_step"), r.get("graphs_compiled_timed"),
           r["status"]] for r in rows if r["row"].startswith("decode")]
    out += [format_table(["row", "batch", "context", "ms/token", "graphs compiled while timed", "status"], de), ""]
    for r in rows:
        if r["row"] == "op" and r.get("cells"):
            out += [format_table(["impl", "N", "mode", "ms", "path / status"],
                                 [[x["impl"], x["N"], x["mode"], x.get("ms"), x.get("path") or x["status"]]
                                  for x in r["cells"]]), ""]
        if r["row"] == "checks" and "passed" in r:
            out += [f"Checks on the default path: {r['passed']} passed, {len(r['failed'])} failed"
                    + (": " + "; ".join(r["failed"]) if r["failed"] else "") + f"; paths: {r.get('paths')}", ""]
    out += [f"- {r['row']}: {r['status']}" for r in rows if r["status"] != "ok"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes (the CPU dry run)")
    p.add_argument("--out", default=str(RESULTS_DIR / "gpu"), help="folder of the rows' JSON, window.json and .md")
    p.add_argument("--rows", default=None, help=f"comma-separated subset of {', '.join(r[0] for r in ROWS)}")
    p.add_argument("--window-s", type=float, default=WINDOW_S - SETUP_S, help="seconds for the rows (default %(default)s)")
    p.add_argument("--until", type=float, default=None, help="the window ends at this time (seconds since the epoch; "
                   "gpu_plan.sh: its start + 570 s), instead of --window-s from now")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="compile the training rows' "
                   "blocks (auto: on CUDA)")
    p.add_argument("--data", default=None, help="byte corpus for the training rows (default: the sample, or random bytes)")
    p.add_argument("--plan", action="store_true", help="print the rows and their budgets as JSON, run nothing")
    a = p.parse_args(argv)
    if a.plan:
        print(json.dumps(plan()))
        return 0
    names = [r[0] for r in ROWS]
    keep = names if a.rows is None else [s.strip() for s in a.rows.split(",") if s.strip()]
    if set(keep) - set(names) or not keep:
        p.error(f"--rows: unknown {sorted(set(keep) - set(names))}; choose from {', '.join(names)}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here; use --device cpu")
    if device.type == "cpu" and a.quick:
        torch.set_num_threads(1)
    if a.until is not None:
        a.window_s = a.until - time.time()
    w = Window(device, a.quick, a.window_s, a.compile == "on" or (a.compile == "auto" and device.type == "cuda"), a.data)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": " ".join(["python -m benchmarks.gpu", *(argv if argv is not None else sys.argv[1:])]),
           "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "device": device_info(device),
           "quick": a.quick, "window_s": a.window_s, "plan": plan(), "rows": [], "finished": False}
    code = 0

    def save():
        write_json(res, out / "window.json")
        (out / "window.md").write_text(render(res))
    for name, budget, kind, kw in (r for r in ROWS if r[0] in keep):
        rec = {"row": name, "budget_s": budget, "start_s": w.spent(), "_out": str(out / f"{name}.json")}
        left = a.window_s - w.spent()
        if left < budget and not a.quick:  # quick: toy sizes; the budgets are the GPU's
            rec["status"] = f"skipped: {left:.0f} s left in the window, the row's budget is {budget} s"
        else:
            print(f"== {name} (budget {budget} s, {w.spent():.0f} s into the window)", flush=True)
            w.row_end = time.perf_counter() + (max(budget, left) if a.quick else budget) + GRACE_S
            try:
                with deadline(w.left()):
                    RUNNERS[kind](w, rec, **kw)
                rec["status"] = "ok"
            except PartTimeout as e:
                rec["status"] = f"timed out: {e}; what it measured is kept"
            except Skip as e:
                rec["status"] = str(e.args[0])
            except Exception as e:  # noqa: BLE001 - recorded with its one-line message, and the next row runs
                rec["status"], code = "error: " + ("out of memory" if is_oom(e) else one_line(e)), 2
                traceback.print_exc()
            if w.cuda:
                torch.cuda.empty_cache()
        rec["wall_s"], code = w.spent() - rec["start_s"], max(code, 1 if rec.get("failed") else 0)
        rec.pop("_out")
        res["rows"].append(rec)
        res["wall_s"] = w.spent()
        write_json(rec, out / f"{name}.json")
        save()
        print(f"   {name}: {rec['status']}, {rec['wall_s']:.1f} s", flush=True)
    res.update(finished=True, exit_code=code)
    save()
    print(f"wrote {out / 'window.json'}")
    return code

if __name__ == "__main__":
    sys.exit(main())
