"""Parts 3 and 4 of ``benchmarks.gpu``: LM training throughput and batched decoding.

How it measures: docs/performance.md, "Methods" (``benchmarks.gpu_train``).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from linear_rope import PerformerLM
from linear_rope.model import MODEL_PRESETS
from linear_rope.ops.triton import kernel_status, record_paths, use_backend

from .attention import ours_flops, sdpa_flops
from .common import NEEDS_CUDA, Ctx, batch_of, is_oom, load_corpus, one_line

LR, WARMUP = 3e-4, 20
# The training table (part 0, ``run_compare``): the comparison users make, in this order, each
# row (position, N) at the same tokens per step; softmax (flash SDPA) first. The rows after the
# first three run as the budget allows.
COMPARE_ROWS = (("softmax", 1024), ("rope", 1024), ("none", 1024), ("rope_pre", 1024),
                ("softmax", 4096), ("rope", 4096), ("none", 4096))
COMPARE = dict(preset="paper", tokens_per_step=16 * 1024, row_s=12.0, warmup_steps=2, corpus_bytes=1 << 26)
COMPARE_QUICK = dict(preset="tiny", tokens_per_step=2 * 64, row_s=0.5, warmup_steps=1, corpus_bytes=1 << 20,
                     seq_scale=1 / 16)
FULL = dict(preset="paper", seq=1024, batch=16, warmup_steps=3, max_steps=400, eager_share=0.3,
            gen_contexts=(1024, 16384), gen_batch=8, gen_steps=64, corpus_bytes=1 << 26)
QUICK = dict(preset="tiny", seq=64, batch=4, warmup_steps=1, max_steps=8, eager_share=0.5,
             gen_contexts=(64, 256), gen_batch=2, gen_steps=10, corpus_bytes=1 << 20)


def flops_per_token(model: PerformerLM, seq: int) -> float:
    c = model.cfg
    dense = model.num_params() - model.tok_emb.weight.numel()
    if c.position == "softmax":  # causal exact attention: the lower triangle of QK^T and PV
        attn = sdpa_flops(seq, d=c.dim_head, heads=c.heads, backward=True) / seq
    else:
        attn = ours_flops(seq, d=c.dim_head, m=c.nb_features, heads=c.heads, backward=True) / seq
    return 6 * dense + c.depth * attn


def compile_model(model: torch.nn.Module, device: torch.device) -> str:
    """Compile ``model`` in place as the trainer does (``--compile``: the whole model, one graph),
    and say how; on the CPU it stays eager (a CPU compile of even the tiny model takes minutes)."""
    if device.type != "cuda":
        return "eager (torch.compile is timed on CUDA only)"
    try:
        model.compile(fullgraph=True)
        return "torch.compile(fullgraph=True), the whole model"
    except Exception as e:  # noqa: BLE001 - an older torch without the keyword: the trainer's plain call
        model.compile()
        return f"torch.compile, the whole model (fullgraph=True refused: {one_line(e)})"


def _train_step(model, opt, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One AdamW step under bf16 autocast, gradients clipped at 1; the loss, not read back."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def _timed_steps(ctx: Ctx, step, seconds: float, max_steps: int = 1 << 30) -> tuple[list, float]:
    """Steps for about ``seconds`` (at least 2, at most ``max_steps``, none once the part has 5 s
    left): their losses, not read back but every tenth (so the clock sees the GPU's progress),
    and their wall time."""
    ctx.sync()
    t1, losses = time.perf_counter(), []
    while len(losses) < max_steps and (len(losses) < 2 or (time.perf_counter() - t1 < seconds and ctx.left() > 5)):
        losses.append(step())
        if len(losses) % 10 == 0:
            float(losses[-1])
    ctx.sync()
    return losses, time.perf_counter() - t1


def _compare_row(ctx: Ctx, cfg: dict, corpus, position: str, seq: int) -> dict:
    """One row of the training table: a fresh ``paper`` model at ``position`` and ``seq``,
    compiled as the trainer compiles it, AdamW; the first step (compile included) timed apart,
    then ``warmup_steps`` untimed and timed steps for about ``row_s`` seconds."""
    batch = max(1, cfg["tokens_per_step"] // seq)
    torch.manual_seed(0)
    model = PerformerLM.from_preset(cfg["preset"], position=position, seq_len=seq,
                                    feature_redraw_interval=0).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    fpt = flops_per_token(model, seq)
    how = compile_model(model, ctx.device)
    g = torch.Generator().manual_seed(0)

    def step():
        return _train_step(model, opt, *(t.to(ctx.device, non_blocking=True) for t in batch_of(corpus, batch, seq, g)))

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    with record_paths() as paths:
        first = float(step())  # compiles forward and backward
    compile_s = time.perf_counter() - t0
    for _ in range(cfg["warmup_steps"]):
        step()
    losses, dt = _timed_steps(ctx, step, cfg["row_s"])
    steps, last = len(losses), losses[-1]
    tps = steps * batch * seq / dt
    peak = ctx.peak_tflops()
    if position == "softmax":
        path = "F.scaled_dot_product_attention (flash on CUDA in bf16)"
    else:
        path = "; ".join(dict.fromkeys(paths)) or "the custom op linear_rope::chunk_causal inside the compiled graph"
    return {"position": position, "N": seq, "batch": batch, "path": path, "compile": how,
            "compile_s": compile_s, "first_step_loss": first, "timed_steps": steps, "timed_s": dt,
            "tokens_per_s": tps, "ms_per_step": 1e3 * dt / steps, "flops_per_token": fpt,
            "mfu": fpt * tps / (peak * 1e12) if peak else f"{NEEDS_CUDA} (no bf16 peak for the CPU)",
            "peak_memory_mib": _mem_mib(ctx), "last_loss": float(last)}


def run_compare(ctx: Ctx, res: dict) -> None:
    """The training table: ``COMPARE_ROWS`` in order, each row saved as it ends; a row starts
    only while the budget holds about what the slowest row so far took."""
    cfg = COMPARE_QUICK if ctx.quick else COMPARE
    corpus, source = load_corpus(ctx.data, cfg["corpus_bytes"])
    rows = [(p, max(16, int(n * cfg.get("seq_scale", 1)))) for p, n in COMPARE_ROWS]
    res.update(preset=cfg["preset"], model=MODEL_PRESETS[cfg["preset"]], data=source, autocast="bfloat16",
               backend="default (auto: the Triton kernels on CUDA where they run, else the torch path)",
               tokens_per_step=cfg["tokens_per_step"], optimizer=f"AdamW lr {LR}, betas (0.9, 0.95), weight decay 0.1, "
               "clip 1.0", rows=[])
    slowest = 0.0
    for position, seq in rows:
        if ctx.left() < 1.2 * slowest + 5:
            res["rows"].append({"position": position, "N": seq,
                                "status": f"skipped: part budget ({ctx.left():.0f} s left, a row took {slowest:.0f} s)"})
            continue
        t0 = time.perf_counter()
        try:
            row = dict(_compare_row(ctx, cfg, corpus, position, seq), status="ok")
        except Exception as e:  # recorded, and the next row runs (a spent budget is no Exception)
            row = {"position": position, "N": seq, "status": f"error: {'out of memory' if is_oom(e) else one_line(e)}"}
        slowest = max(slowest, time.perf_counter() - t0)
        res["rows"].append(row)
        if row["status"] == "ok":
            mfu = row["mfu"] if isinstance(row["mfu"], str) else f"{100 * row['mfu']:.1f}% MFU"
            print(f"[compare] {position:8s} N={seq}: {row['tokens_per_s']:.0f} tokens/s, {mfu}, "
                  f"compile {row['compile_s']:.0f} s; {row['path']}", flush=True)
        else:
            print(f"[compare] {position} N={seq}: {row['status']}", flush=True)
        if ctx.cuda:
            torch.cuda.empty_cache()
        ctx.save()
    ok = {(r["position"], r["N"]): r["tokens_per_s"] for r in res["rows"] if r.get("status") == "ok"}
    res["vs_softmax"] = {f"{p} N={n}": ok[(p, n)] / ok[("softmax", n)] for p, n in ok
                         if p != "softmax" and ("softmax", n) in ok}


def _mem_mib(ctx: Ctx):
    return torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.cuda else NEEDS_CUDA


class _Run:
    """Model, optimizer, data and loss curve, shared by the eager and the compiled phase."""

    def __init__(self, ctx: Ctx, cfg: dict, res: dict):
        self.ctx, self.cfg, self.res = ctx, cfg, res
        torch.manual_seed(0)
        self.model = PerformerLM.from_preset(cfg["preset"], seq_len=cfg["seq"]).to(ctx.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
        self.corpus, source = load_corpus(ctx.data, cfg["corpus_bytes"])
        self.gen = torch.Generator().manual_seed(0)
        self.batch, self.step_no = ctx.train_batch or cfg["batch"], 0
        self.curve = res.setdefault("loss_curve", [])
        res.update(preset=cfg["preset"], model=MODEL_PRESETS[cfg["preset"]], seq=cfg["seq"], data=source,
                   params=self.model.num_params(), optimizer=f"AdamW lr {LR} (linear warmup {WARMUP} steps), "
                   "betas (0.9, 0.95), weight decay 0.1, clip 1.0", autocast="bfloat16",
                   flops_per_token=flops_per_token(self.model, cfg["seq"]))

    def step(self, batch=None):
        x, y = batch or batch_of(self.corpus, self.batch, self.cfg["seq"], self.gen)
        x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
        for grp in self.opt.param_groups:
            grp["lr"] = LR * min(1.0, (self.step_no + 1) / WARMUP)
        self.step_no += 1
        return _train_step(self.model, self.opt, x, y)

    def fit_batch(self) -> None:
        """One step at the current batch, halving it on out-of-memory (CUDA)."""
        while True:
            try:
                self.curve.append([self.step_no, float(self.step()), "eager"])
                return
            except Exception as e:
                if not (self.ctx.cuda and is_oom(e)) or self.batch == 1:
                    raise
                self.res.setdefault("notes", []).append(f"batch {self.batch} ran out of memory; halved")
                self.opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                self.batch //= 2

    def phase(self, name: str, seconds: float, warmup: int) -> dict:
        """``warmup`` untimed steps, then timed steps for about ``seconds``; ``path``: the
        attention path the warmup steps took (``record_paths``)."""
        ctx, cfg = self.ctx, self.cfg
        t0 = time.perf_counter()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        with record_paths() as paths:
            for _ in range(max(1, warmup)):
                self.curve.append([self.step_no, float(self.step()), name])
        warm_s = time.perf_counter() - t0
        first = self.step_no
        losses, dt = _timed_steps(ctx, self.step, seconds - warm_s, cfg["max_steps"])
        steps = len(losses)
        self.curve += [[first + i, float(l), name] for i, l in enumerate(losses)]
        tps = steps * self.batch * cfg["seq"] / dt
        peak = ctx.peak_tflops()
        mfu = self.res["flops_per_token"] * tps / (peak * 1e12) if peak else None
        return {"path": "; ".join(dict.fromkeys(paths)) or "torch path (compiled: linear_rope::chunk_causal)",
                "batch": self.batch, "tokens_per_step": self.batch * cfg["seq"], "warmup_steps": warmup,
                "warmup_s": warm_s, "timed_steps": steps, "timed_s": dt, "tokens_per_s": tps,
                "ms_per_step": 1e3 * dt / steps, "mfu": mfu if peak else f"{NEEDS_CUDA} (no bf16 peak for the CPU)",
                "peak_memory_mib": _mem_mib(ctx), "last_loss": self.curve[-1][1]}


def run_training(ctx: Ctx, res: dict) -> None:
    """Eager for ``eager_share`` of the part's budget, then compiled for the rest."""
    cfg = QUICK if ctx.quick else FULL
    run = _Run(ctx, cfg, res)
    res["batch_note"] = "batch x seq tokens per step; the paper's batch is 128 (gradient accumulation not used here)"
    with use_backend("torch"):
        run.fit_batch()
        res["eager"] = run.phase("eager", ctx.left() * cfg["eager_share"] / 2, cfg["warmup_steps"])
    print(f"[training] eager, {res['eager']['path']}: {res['eager']['tokens_per_s']:.0f} tokens/s, "
          f"batch {run.batch}", flush=True)
    ctx.save()
    ok, why = kernel_status(ctx.device if ctx.cuda else None)
    if not ctx.cuda:
        res["eager_triton"] = f"{NEEDS_CUDA} (the Triton kernels are timed on CUDA only: interpreted, times mean nothing)"
    elif not ok:
        res["eager_triton"] = f"skipped: {why}"
    else:
        with use_backend("triton"):
            res["eager_triton"] = run.phase("eager, triton", ctx.left() * cfg["eager_share"] / 2, cfg["warmup_steps"])
        print(f"[training] eager, {res['eager_triton']['path']}: {res['eager_triton']['tokens_per_s']:.0f} tokens/s",
              flush=True)
        ctx.save()
    if not ctx.compile:
        res["compiled"] = (f"{NEEDS_CUDA} (torch.compile is timed on CUDA only: a CPU compile of even the "
                           "tiny model takes minutes here; --compile on forces it)" if not ctx.cuda else
                           "skipped: --compile off")
        return
    fixed = batch_of(run.corpus, run.batch, cfg["seq"], torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16), use_backend("torch"):
        eager_logits = run.model(fixed[0].to(ctx.device)).float()
    res["compiled"] = "error: did not finish compiling within the part's budget"
    t0 = time.perf_counter()
    run.model.compile()
    with use_backend("torch"):  # the compiled graph holds the torch path's custom op: eager is compared on it too
        first = float(run.step(fixed))  # compiles forward and backward
        compile_s = time.perf_counter() - t0
        run.curve.append([run.step_no - 1, first, "compiled (first step, compiling)"])
        eager_loss = float(F.cross_entropy(eager_logits.reshape(-1, eager_logits.shape[-1]),
                                           fixed[1].to(ctx.device).reshape(-1)))
        out = run.phase("compiled", ctx.left() - 5, cfg["warmup_steps"])
    out.update(compile_s=compile_s, first_step_loss_compiled=first, same_batch_loss_eager=eager_loss,
               loss_diff=abs(first - eager_loss))
    res["compiled"] = out
    res["compiled_speedup"] = out["tokens_per_s"] / res["eager"]["tokens_per_s"]
    res["compiled_speedup_note"] = "compiled over eager, both on the torch path"


def run_generation(ctx: Ctx, res: dict) -> None:
    """Decoding ms per step through ``PerformerLM.generate`` (what users call): a batch of
    random-byte prompts of C tokens, greedy, once with ``gen_steps`` new tokens and once with 2;
    the difference over ``gen_steps - 2`` steps is the time of one step, the prompt's parallel
    read cancelling out. The prefill is the 2-token call's time."""
    cfg = QUICK if ctx.quick else FULL
    torch.manual_seed(0)
    model = PerformerLM.from_preset(cfg["preset"]).to(ctx.device).eval()
    B, T = ctx.gen_batch or cfg["gen_batch"], cfg["gen_steps"]
    res.update(preset=cfg["preset"], batch=B, steps=T, autocast="bfloat16",
               decoding="greedy (top_k=1), PerformerLM.generate; ms/step = (time(T new) - time(2 new)) / (T - 2)",
               rows=[])
    g = torch.Generator().manual_seed(0)
    for C in cfg["gen_contexts"]:
        row = {"context": C}
        res["rows"].append(row)
        if ctx.left() < 2:
            row["status"] = f"skipped: part budget spent ({ctx.left():.0f} s left)"
            continue
        try:
            prompts = [bytes(torch.randint(0, 256, (C,), generator=g).tolist()) for _ in range(B)]
            if ctx.cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)

            def timed(n):  # the best of 3 on the CPU, whose clock a busy machine disturbs
                best = float("inf")
                for _ in range(1 if ctx.cuda else 3):
                    ctx.sync()
                    t0 = time.perf_counter()
                    model.generate(prompts, n, top_k=1)  # returns bytes: the GPU has finished
                    best = min(best, time.perf_counter() - t0)
                return best
            with torch.no_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                model.generate([p[:64] for p in prompts], 4, top_k=1)  # warm the kernels
                short = timed(2)
                full = timed(T)
            if full <= short:  # noise larger than the steps (a busy CPU): no figure rather than a false one
                row.update(status=f"error: {T} new tokens took no longer than 2 ({full:.3f} s vs {short:.3f} s)")
                continue
            step_s = (full - short) / (T - 2)
            row.update(status="ok", prefill_s=short, prefill_tokens_per_s=B * C / short, ms_per_step=1e3 * step_s,
                       decode_tokens_per_s=B / step_s, peak_memory_mib=_mem_mib(ctx))
            print(f"[generation] context {C}, batch {B}: {1e3 * step_s:.2f} ms/step", flush=True)
        except Exception as e:
            row["status"] = f"error: {'out of memory' if is_oom(e) else one_line(e)}"
            if ctx.cuda:
                torch.cuda.empty_cache()
