"""Train the Enwik8 ablation: PerformerLM variants x seeds, with TensorBoard, checkpoints and DDP.

Commands, from the repository root::

    # smoke test on the shared Wikipedia sample (seconds)
    python train_enwik8.py --preset tiny --data ../shared/data/enwiki-sample.xml.bz2 --out runs/tiny
    # the CPU-scale ablation, RoPE against no position, two seeds
    python -m linear_rope.train --preset cpu --variants rope,none --seeds 0,1 \\
        --data ../shared/data/enwiki-sample.xml.bz2 --out runs/cpu
    # the paper's setting (RoFormer section 4.4) on enwik8 (downloaded into --data-dir):
    # global batch 128 = --batch-size 16 per rank x 8 ranks (x --grad-accum 1)
    torchrun --standalone --nproc_per_node=8 -m linear_rope.train --preset paper --batch-size 16 \\
        --compile --out runs/paper
    # DDP (gloo on CPU, nccl on CUDA): global batch = batch_size * grad_accum * ranks
    torchrun --standalone --nproc_per_node=2 train_enwik8.py --preset tiny --steps 30 \\
        --data ../shared/data/enwiki-sample.xml.bz2 --out runs/ddp
    # continue a finished or interrupted run to more steps, in the same log dirs
    python -m linear_rope.train --preset cpu --out runs/cpu --resume --steps 4000
    tensorboard --logdir runs/cpu
    python -m linear_rope.sample runs/cpu/rope-seed0 --prompt "The "

Every variant x seed is one run in ``<out>/<variant>-seed<k>/`` (TensorBoard events, config.json,
``ckpt-<step>.pt``, the newest ``--keep-checkpoints`` kept; see ``linear_rope.checkpoint``).
Runs with the same seed share the initial weights (``torch.manual_seed(seed)`` before the model
is built), the initial FAVOR+ projections and every redraw (a generator seeded
``seed + 1_000_003``) and the data order (a generator seeded ``seed * 1000``), so variants differ
only in where position enters the model. Each step draws one global batch of crop starts; rank
``r`` takes micro-batch ``j``'s slice ``(j * world + r) * batch_size``, so ranks see distinct crops
and 2 ranks x batch b train on the same global batches as 1 rank x batch 2b.

Resume is exact: the checkpoint holds the model, optimizer, step, metrics and the states of the
torch (dropout), data and feature generators, so ``--resume`` reproduces every ``train/loss`` of
an uninterrupted run bit for bit on CPU. SIGTERM / SIGINT checkpoint at the end of the current
step and exit 0 with the resume command. A non-finite loss or gradient norm stops the run at that
step before the update (exit 3), naming the last good checkpoint.

The learning rate is a pure function of the step: linear warmup over ``warmup_steps``, then a
cosine from ``lr`` down to ``lr * min_lr_ratio`` (10%) at ``decay_steps`` (default ``steps``),
flat after. To extend a run with ``--resume --steps`` on exactly the schedule an uninterrupted
run would have had, fix ``--decay-steps`` from the start.

``--compile`` calls ``model.compile()`` in place; on CUDA it is worth it, on CPU it is optional
(it needs a C++ compiler, and the first step and first eval each wait minutes for compilation).
On CUDA the forward runs under bf16 autocast. On a CPU shared with other jobs, ``--threads 1``
can be several times faster than torch's default of one thread per core.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from . import data
from .checkpoint import (CheckpointError, check_out_dir, latest_checkpoint, list_checkpoints,
                         load_checkpoint, save_checkpoint)
from .config import RESUMABLE, TRAIN_PRESETS, ConfigError, TrainConfig, build_parser, configs_from_args, lr_at
from .model import ModelConfig, PerformerLM
from .runtime import Dist, StopSignals, init_distributed, param_digest, resume_command

__all__ = ["TrainConfig", "TRAIN_PRESETS", "lr_at", "build_run", "evaluate", "main"]

FEATURE_SEED_OFFSET = 1_000_003  # feature generator seed = run seed + this
EXIT_NONFINITE = 3


class NonFiniteError(Exception):
    """The loss or the gradient norm is NaN / inf (the run stops, exit 3)."""


def build_run(mc: ModelConfig, seed: int):
    """Model, data generator and feature generator of one run at step 0 (on CPU).

    The same ``seed`` gives every variant (and every rank) the same initial weights, FAVOR+
    projections and data stream.
    """
    torch.manual_seed(seed)
    model = PerformerLM(mc)
    feature_gen = torch.Generator().manual_seed(seed + FEATURE_SEED_OFFSET)
    model.redraw_features(feature_gen)
    data_gen = torch.Generator().manual_seed(seed * 1000)
    return model, data_gen, feature_gen


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model, split, seq_len: int, batch_size: int, dd: Dist = Dist()) -> float:
    """BPC over the whole split: summed nats / summed bytes / ln 2, both summed across ranks."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=dd.device)  # nats, predicted bytes
    for i, (x, y) in enumerate(data.eval_batches(split, seq_len, batch_size)):
        if i % dd.world != dd.rank:
            continue
        with _autocast(dd.device):
            logits = model(x.to(dd.device))
        sums[0] += F.cross_entropy(logits.float().flatten(0, 1), y.to(dd.device).flatten(),
                                   reduction="sum").double()
        sums[1] += y.numel()
    if dd.world > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    nats, n_bytes = sums.tolist()
    assert n_bytes == data.count_eval_bytes(split), (n_bytes, data.count_eval_bytes(split))
    return nats / n_bytes / math.log(2)


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr)


def _check_resumable(ckpt: dict, mc: ModelConfig, tc: TrainConfig, dd: Dist, path: Path):
    old_m, old_t = ckpt["config"]["model"], ckpt["config"]["train"]
    diffs = [f"{k}: checkpoint {old_m.get(k)!r}, now {v!r}" for k, v in asdict(mc).items()
             if old_m.get(k) != v]
    old_t = {**asdict(TrainConfig()), **old_t}  # fields newer than the checkpoint: defaults
    diffs += [f"{k}: checkpoint {old_t.get(k)!r}, now {v!r}" for k, v in asdict(tc).items()
              if k not in RESUMABLE and old_t.get(k) != v]
    if ckpt.get("world", 1) != dd.world:
        diffs.append(f"ranks: checkpoint {ckpt.get('world', 1)}, now {dd.world} (the global "
                     f"batch and data slices depend on it)")
    if diffs:
        raise ConfigError(f"cannot resume from {path}: config differs ({'; '.join(diffs)})")


def train_run(name: str, mc: ModelConfig, tc: TrainConfig, splits: dict, dd: Dist,
              resume: bool, stop: StopSignals | None = None) -> dict:
    """Train (or continue) one run; return ``{"step", "val_bpc", "test_bpc", "stopped"}``.

    ``stopped`` is the signal's name when a SIGTERM / SIGINT ended the run early (checkpointed).
    """
    run_dir = Path(tc.out) / name
    try:
        model, data_gen, feature_gen = build_run(mc, tc.seed)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from e
    if dd.rank:  # rank 0 keeps the seed's stream; the others draw their own dropout masks
        torch.manual_seed(tc.seed * 1000 + FEATURE_SEED_OFFSET * dd.rank)
    model.to(dd.device)
    opt = make_optimizer(model, tc)
    start, metrics = 0, {"val_bpc": None, "test_bpc": None}
    last_ckpt = latest_checkpoint(run_dir) if resume else None
    if last_ckpt is not None:
        try:
            ckpt = load_checkpoint(last_ckpt)
        except CheckpointError as e:
            older = [p for _, p in list_checkpoints(run_dir)[:-1]]
            hint = f"; move it away to resume from {older[-1].name}" if older else ""
            raise ConfigError(f"cannot resume: {e}{hint}") from None
        _check_resumable(ckpt, mc, tc, dd, last_ckpt)
        start, metrics = ckpt["step"], ckpt["metrics"]
        if start >= tc.steps:
            if dd.lead:
                print(f"{name}: already done (step {start} >= --steps {tc.steps}); skipping",
                      file=sys.stderr)
            return {"step": start, **metrics, "stopped": None}
        metrics["test_bpc"] = None  # of the shorter run; measured again at the new end
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"]["torch_ranks"][dd.rank] if dd.world > 1
                            else ckpt["rng"]["torch"])
        if dd.device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda_ranks"][dd.rank] if dd.world > 1
                                     else ckpt["rng"]["cuda"])
        data_state = ckpt["rng"]["data"]
        data_gen.set_state(data_state[0] if isinstance(data_state, list) else data_state)  # <= 0.1
        feature_gen.set_state(ckpt["rng"]["features"])
        if (tc.decay_steps is None and ckpt["config"]["train"]["decay_steps"] is None
                and ckpt["config"]["train"]["steps"] != tc.steps and dd.lead):
            print(f"{name}: note: the cosine now ends at step {tc.steps}, not "
                  f"{ckpt['config']['train']['steps']} (fix --decay-steps to avoid this)",
                  file=sys.stderr)
        del ckpt
    if tc.compile:
        model.compile()
    net = model
    if dd.world > 1:
        ids = [dd.device.index] if dd.device.type == "cuda" else None
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    config = {"model": asdict(mc), "train": asdict(tc)}
    writer = None
    if dd.lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # purge_step: readers drop events a killed process wrote after the checkpoint we resume
        writer = SummaryWriter(run_dir, purge_step=start + 1)
        writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```", start)
        print(f"{name}: {model.num_params():,} params, steps {start} -> {tc.steps}, "
              f"device {dd.device}, ranks {dd.world}, global batch "
              f"{tc.batch_size * tc.grad_accum * dd.world}", file=sys.stderr)

    def checkpoint(step: int) -> None:
        cuda = dd.device.type == "cuda"
        digests, torch_states = [param_digest(model)], [torch.get_rng_state()]
        cuda_states = [torch.cuda.get_rng_state()] if cuda else []
        if dd.world > 1:  # every rank takes part; identical weights are checked, not assumed
            digests, torch_states = [None] * dd.world, [None] * dd.world
            dist.all_gather_object(digests, param_digest(model))
            dist.all_gather_object(torch_states, torch.get_rng_state())
            if cuda:
                cuda_states = [None] * dd.world
                dist.all_gather_object(cuda_states, torch.cuda.get_rng_state())
            if len(set(digests)) != 1:
                raise RuntimeError(f"ranks hold different weights at step {step}: {digests}")
        if dd.lead:
            rng = {"torch": torch.get_rng_state(), "data": data_gen.get_state(),
                   "features": feature_gen.get_state()}
            if cuda:
                rng["cuda"] = cuda_states[0]
            if dd.world > 1:  # each rank's dropout stream
                rng["torch_ranks"] = torch_states
                if cuda:
                    rng["cuda_ranks"] = cuda_states
            save_checkpoint(
                run_dir, step, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "step": step, "rng": rng, "config": config, "metrics": metrics,
                                "world": dd.world, "param_sha256": digests},
                keep=tc.keep_checkpoints)

    train, per_step = splits["train"], tc.batch_size * tc.grad_accum * dd.world
    bar = tqdm(total=tc.steps, initial=start, desc=name, file=sys.stderr, disable=not dd.lead,
               dynamic_ncols=True)
    t0, n_steps, stopped = time.perf_counter(), 0, None
    model.train()
    for step in range(start, tc.steps):
        if mc.feature_redraw_interval and step > 0 and step % mc.feature_redraw_interval == 0:
            model.redraw_features(feature_gen)
        lr = lr_at(step, tc)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = data.draw_starts(train, per_step, mc.seq_len, data_gen)  # the global batch
        opt.zero_grad(set_to_none=True)
        loss_sum = None
        for j in range(tc.grad_accum):
            lo = (j * dd.world + dd.rank) * tc.batch_size
            x, y = data.crops(train, starts[lo:lo + tc.batch_size], mc.seq_len)
            x, y = x.to(dd.device, non_blocking=True), y.to(dd.device, non_blocking=True)
            sync = net is model or j == tc.grad_accum - 1  # DDP all-reduces on the last one
            with contextlib.nullcontext() if sync else net.no_sync():
                with _autocast(dd.device):
                    logits = net(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                (loss / tc.grad_accum).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or math.inf)
        # one small collective per step: mean loss, non-finite flag, stop request
        stats = torch.stack([loss_sum.float() / tc.grad_accum,
                             (~torch.isfinite(loss_sum)).float() + (~torch.isfinite(grad_norm)).float(),
                             torch.tensor(float(stop is not None and stop.received is not None))])
        if dd.world > 1:
            stats = stats.to(dd.device)
            dist.all_reduce(stats)
            stats[0] /= dd.world
        loss_v, bad, stop_now = stats.tolist()
        if bad:
            what = "loss" if not math.isfinite(loss_v) else "gradient norm"
            good = latest_checkpoint(run_dir)
            where = (f"last good checkpoint: {good} (resume from it with --resume, e.g. with a "
                     f"lower --lr)" if good else "no checkpoint was written yet")
            bar.close()
            if writer is not None:
                writer.close()
            raise NonFiniteError(f"{name}: non-finite {what} at step {step + 1}; the update was "
                                 f"not applied and the run stopped; {where}")
        opt.step()
        done, n_steps = step + 1, n_steps + 1
        bar.update(1)
        last = done == tc.steps
        if dd.lead and (done % tc.log_every == 0 or last):
            tok_s = n_steps * per_step * mc.seq_len / (time.perf_counter() - t0)
            for tag, v in (("train/loss", loss_v), ("train/bpc", loss_v / math.log(2)), ("lr", lr),
                           ("perf/tokens_per_sec", tok_s), ("grad/norm", grad_norm.item())):
                writer.add_scalar(tag, v, done)
            bar.set_postfix(loss=f"{loss_v:.4f}", bpc=f"{loss_v / math.log(2):.3f}")
            t0, n_steps = time.perf_counter(), 0
        saved = False
        if (tc.eval_every and done % tc.eval_every == 0) or last:
            t_eval = time.perf_counter()
            metrics["val_bpc"] = evaluate(model, splits["valid"], mc.seq_len, tc.eval_batch_size, dd)
            if dd.lead:
                writer.add_scalar("val/bpc", metrics["val_bpc"], done)
                bar.write(f"{name} step {done}: val bpc {metrics['val_bpc']:.4f} "
                          f"(eval {time.perf_counter() - t_eval:.1f} s)", file=sys.stderr)
            if last:
                metrics["test_bpc"] = evaluate(model, splits["test"], mc.seq_len,
                                               tc.eval_batch_size, dd)
            checkpoint(done)
            saved = True
            t0, n_steps = time.perf_counter(), 0  # tokens/s leaves eval time out
        if not saved and (stop_now or (tc.checkpoint_every and done % tc.checkpoint_every == 0)):
            checkpoint(done)
        if stop_now and not last:
            stopped = (stop.received if stop is not None else None) or "a signal on another rank"
            break
    bar.close()
    if dd.lead:
        if stopped is None:
            writer.add_scalar("test/bpc", metrics["test_bpc"], tc.steps)
            hparams = {f"{group}.{k}": ("None" if v is None else v)
                       for group, cfg in config.items() for k, v in cfg.items()}
            writer.add_hparams({"run": name, **hparams}, {"hparam/val_bpc": metrics["val_bpc"],
                                                          "hparam/test_bpc": metrics["test_bpc"]},
                               run_name=".")
        writer.close()
    return {"step": done if tc.steps > start else start, **metrics, "stopped": stopped}


def write_layout(out: Path) -> None:
    """Custom-scalars charts at the experiment root: each chart overlays every run's curve."""
    layout = {"ablation": {"val/bpc (all runs)": ["Multiline", [r"^val/bpc$"]],
                           "train/bpc (all runs)": ["Multiline", [r"^train/bpc$"]]}}
    out.mkdir(parents=True, exist_ok=True)
    with SummaryWriter(out) as w:
        w.add_custom_scalars(layout)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    prog = prog or "python -m linear_rope.train"
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    lead = os.environ.get("RANK", "0") == "0"

    def fail(msg: str, code: int = 2):  # under torchrun every rank exits, rank 0 alone says why
        parser.exit(code, f"{parser.prog}: error: {msg}\n" if lead else "")

    try:
        runs = configs_from_args(args)
        clear = check_out_dir(runs, args.resume, args.overwrite)
    except ValueError as e:
        fail(_one_line(e))
    tc0 = runs[0][2]
    out = Path(tc0.out)
    if tc0.threads:
        torch.set_num_threads(tc0.threads)
    if tc0.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dd = init_distributed(tc0.device)
    results = []
    try:
        with StopSignals(quiet=not dd.lead) as stop:
            if dd.lead:  # rank 0 downloads / splits first; the others then find the cache
                paths = _prepare(tc0)
            if dd.world > 1:
                dist.barrier()
                paths = paths if dd.lead else _prepare(tc0)
            splits = {k: data.load_split(p) for k, p in paths.items()}
            for name, mc, _ in runs:
                if len(splits["train"]) < mc.seq_len + 1:
                    raise data.DataError(
                        f"corpus too short: the train split has {len(splits['train'])} bytes, "
                        f"less than one training window of seq_len + 1 = {mc.seq_len + 1}")
            if dd.lead:
                for run_dir in clear:
                    shutil.rmtree(run_dir)
                if not any(out.glob("events.out.tfevents.*")):
                    write_layout(out)
            if dd.world > 1:
                dist.barrier()
            for name, mc, tc in runs:
                r = train_run(name, mc, tc, splits, dd, args.resume, stop)
                results.append((name, r))
                if r["stopped"]:
                    break
    except (data.DataError, ConfigError) as e:
        fail(_one_line(e))
    except NonFiniteError as e:
        fail(_one_line(e), EXIT_NONFINITE)
    finally:
        if dd.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if dd.lead:
        print(f"{'run':<20} {'step':>7} {'val bpc':>8} {'test bpc':>8}")
        for name, r in results:
            val, test = (f"{v:8.4f}" if v is not None else f"{'-':>8}"
                         for v in (r["val_bpc"], r["test_bpc"]))
            print(f"{name:<20} {r['step']:>7} {val} {test}")
        print(f"tensorboard --logdir {out}")
        if results and results[-1][1]["stopped"]:
            name, r = results[-1]
            print(f"{name}: stopped by {r['stopped']} at step {r['step']}, checkpoint saved; "
                  f"resume with:\n  {resume_command(argv, prog, dd.world)}", file=sys.stderr)
    return 0


def _prepare(tc: TrainConfig) -> dict[str, Path]:
    return data.prepare_corpus(tc.data, tc.data_dir) if tc.data else data.prepare_enwik8(tc.data_dir)


if __name__ == "__main__":
    sys.exit(main())
