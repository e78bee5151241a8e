"""Train the Enwik8 ablation: PerformerLM variants x seeds, with TensorBoard, checkpoints and DDP.

Commands, from the repository root::

    # smoke test on the shared Wikipedia sample (seconds)
    python train_enwik8.py --preset tiny --data ../shared/data/enwiki-sample.xml.bz2 --out runs/tiny
    # the CPU-scale ablation, RoPE against no position, two seeds
    python -m linear_rope.train --preset cpu --variants rope,none --seeds 0,1 \\
        --data ../shared/data/enwiki-sample.xml.bz2 --out runs/cpu
    # the paper's setting (RoFormer section 4.4) on enwik8 (downloaded into --data-dir)
    torchrun --standalone --nproc_per_node=8 -m linear_rope.train --preset paper --compile --out runs/paper
    # DDP on CPU (gloo), e.g. to check a launch
    torchrun --standalone --nproc_per_node=2 -m linear_rope.train --preset tiny --steps 3 \
        --data ../shared/data/enwiki-sample.xml.bz2 --out runs/ddp
    # continue a finished or interrupted run to more steps, in the same log dirs
    python -m linear_rope.train --preset cpu --out runs/cpu --resume --steps 4000
    tensorboard --logdir runs/cpu
    python -m linear_rope.sample runs/cpu/rope-seed0/checkpoint.pt --prompt "The "

Every variant x seed is one run in ``<out>/<variant>-seed<k>/`` (TensorBoard events, config.json,
checkpoint.pt). Runs with the same seed share the initial weights (``torch.manual_seed(seed)``
before the model is built), the initial FAVOR+ projections and every redraw (a generator seeded
``seed + 1_000_003``) and the data order (a generator seeded ``seed * 1000 + rank``), so variants
differ only in where position enters the model.

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

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from . import data
from .config import RESUMABLE, TRAIN_PRESETS, ConfigError, TrainConfig, build_parser, configs_from_args, lr_at
from .model import ModelConfig, PerformerLM

__all__ = ["TrainConfig", "TRAIN_PRESETS", "lr_at", "build_run", "evaluate", "main"]

FEATURE_SEED_OFFSET = 1_000_003  # feature generator seed = run seed + this
CHECKPOINT = "checkpoint.pt"


# --------------------------------------------------------------------------- runtime


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")


def init_distributed(device: str) -> Dist:
    """One process, or one rank of a torchrun launch (``WORLD_SIZE > 1``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=torch.device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def build_run(mc: ModelConfig, seed: int, rank: int = 0):
    """Model, data generator and feature generator of one run at step 0 (on CPU).

    The same ``seed`` gives every variant the same shared initial weights, FAVOR+ projections
    and data stream; ``rank`` only offsets the data stream.
    """
    torch.manual_seed(seed)
    model = PerformerLM(mc)
    feature_gen = torch.Generator().manual_seed(seed + FEATURE_SEED_OFFSET)
    model.redraw_features(feature_gen)
    data_gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return model, data_gen, feature_gen


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model, split, seq_len: int, batch_size: int, dd: Dist = Dist()) -> float:
    """BPC over the whole split: summed nats / count_eval_bytes / ln 2 (batches shared by ranks)."""
    was_training = model.training
    model.eval()
    nats = torch.zeros((), dtype=torch.float64, device=dd.device)
    for i, (x, y) in enumerate(data.eval_batches(split, seq_len, batch_size)):
        if i % dd.world != dd.rank:
            continue
        with _autocast(dd.device):
            logits = model(x.to(dd.device))
        nats += F.cross_entropy(logits.float().flatten(0, 1), y.to(dd.device).flatten(),
                                reduction="sum").double()
    if dd.world > 1:
        dist.all_reduce(nats)
    model.train(was_training)
    return nats.item() / data.count_eval_bytes(split) / math.log(2)


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr)


def _data_states(data_gen: torch.Generator, dd: Dist) -> list[torch.Tensor]:
    """Every rank's data generator state (a collective under DDP)."""
    if dd.world == 1:
        return [data_gen.get_state()]
    states = [None] * dd.world
    dist.all_gather_object(states, data_gen.get_state())
    return states


def save_checkpoint(path: Path, ckpt: dict) -> None:
    """torch.save to a temporary file, then os.replace: a crash never leaves a corrupt file."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(ckpt, tmp)
    os.replace(tmp, path)


def _check_resumable(ckpt: dict, mc: ModelConfig, tc: TrainConfig, dd: Dist, run_dir: Path):
    old_m, old_t = ckpt["config"]["model"], ckpt["config"]["train"]
    diffs = [f"{k}: checkpoint {old_m.get(k)!r}, now {v!r}" for k, v in asdict(mc).items()
             if old_m.get(k) != v]
    diffs += [f"{k}: checkpoint {old_t.get(k)!r}, now {v!r}" for k, v in asdict(tc).items()
              if k not in RESUMABLE and old_t.get(k) != v]
    if len(ckpt["rng"]["data"]) != dd.world:
        diffs.append(f"world size: checkpoint {len(ckpt['rng']['data'])}, now {dd.world}")
    if diffs:
        raise ConfigError(f"cannot resume {run_dir}: config differs ({'; '.join(diffs)})")


def train_run(name: str, mc: ModelConfig, tc: TrainConfig, splits: dict, dd: Dist,
              resume: bool) -> dict:
    """Train (or continue) one run; return ``{"step", "val_bpc", "test_bpc"}``."""
    run_dir = Path(tc.out) / name
    ckpt_path = run_dir / CHECKPOINT
    lead = dd.rank == 0
    try:
        model, data_gen, feature_gen = build_run(mc, tc.seed, dd.rank)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from e
    model.to(dd.device)
    opt = make_optimizer(model, tc)
    start, metrics = 0, {"val_bpc": None, "test_bpc": None}
    if resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        _check_resumable(ckpt, mc, tc, dd, run_dir)
        start, metrics = ckpt["step"], ckpt["metrics"]
        if start >= tc.steps:
            if lead:
                print(f"{name}: already done (step {start} >= --steps {tc.steps}); skipping",
                      file=sys.stderr)
            return {"step": start, **metrics}
        metrics["test_bpc"] = None  # of the shorter run; measured again at the new end
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if dd.device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        data_gen.set_state(ckpt["rng"]["data"][dd.rank])
        feature_gen.set_state(ckpt["rng"]["features"])
        if (tc.decay_steps is None and ckpt["config"]["train"]["decay_steps"] is None
                and ckpt["config"]["train"]["steps"] != tc.steps and lead):
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
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # purge_step drops events a crashed process wrote after the checkpoint we restart from
        writer = SummaryWriter(run_dir, purge_step=start + 1)
        writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```", start)
        print(f"{name}: {model.num_params():,} params, steps {start} -> {tc.steps}, "
              f"device {dd.device}, world {dd.world}", file=sys.stderr)

    def checkpoint(step: int):
        states = _data_states(data_gen, dd)  # every rank takes part
        if not lead:
            return
        rng = {"torch": torch.get_rng_state(), "data": states, "features": feature_gen.get_state()}
        if dd.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                    "step": step, "rng": rng, "config": config, "metrics": metrics})

    train, tokens_per_step = splits["train"], tc.batch_size * mc.seq_len * dd.world
    bar = tqdm(total=tc.steps, initial=start, desc=name, file=sys.stderr, disable=not lead,
               dynamic_ncols=True)
    t0, n_steps = time.perf_counter(), 0
    model.train()
    for step in range(start, tc.steps):
        if mc.feature_redraw_interval and step > 0 and step % mc.feature_redraw_interval == 0:
            model.redraw_features(feature_gen)
        lr = lr_at(step, tc)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.get_batch(train, tc.batch_size, mc.seq_len, data_gen)
        x, y = x.to(dd.device, non_blocking=True), y.to(dd.device, non_blocking=True)
        with _autocast(dd.device):
            logits = net(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or math.inf)
        opt.step()
        done, n_steps = step + 1, n_steps + 1
        bar.update(1)
        last = done == tc.steps
        if lead and (done % tc.log_every == 0 or last):
            loss_v = loss.item()
            tok_s = n_steps * tokens_per_step / (time.perf_counter() - t0)
            for tag, v in (("train/loss", loss_v), ("train/bpc", loss_v / math.log(2)), ("lr", lr),
                           ("perf/tokens_per_sec", tok_s), ("grad/norm", grad_norm.item())):
                writer.add_scalar(tag, v, done)
            bar.set_postfix(loss=f"{loss_v:.4f}", bpc=f"{loss_v / math.log(2):.3f}")
            t0, n_steps = time.perf_counter(), 0
        if (tc.eval_every and done % tc.eval_every == 0) or last:
            t_eval = time.perf_counter()
            metrics["val_bpc"] = evaluate(model, splits["valid"], mc.seq_len, tc.eval_batch_size, dd)
            if lead:
                writer.add_scalar("val/bpc", metrics["val_bpc"], done)
                bar.write(f"{name} step {done}: val bpc {metrics['val_bpc']:.4f} "
                          f"(eval {time.perf_counter() - t_eval:.1f} s)", file=sys.stderr)
            if last:
                metrics["test_bpc"] = evaluate(model, splits["test"], mc.seq_len,
                                               tc.eval_batch_size, dd)
            checkpoint(done)
            t0, n_steps = time.perf_counter(), 0  # tokens/s leaves eval time out
    bar.close()
    if lead:
        writer.add_scalar("test/bpc", metrics["test_bpc"], tc.steps)
        hparams = {f"{group}.{k}": ("None" if v is None else v)
                   for group, cfg in config.items() for k, v in cfg.items()}
        writer.add_hparams({"run": name, **hparams},
                           {"hparam/val_bpc": metrics["val_bpc"], "hparam/test_bpc": metrics["test_bpc"]},
                           run_name=".")
        writer.close()
    return {"step": tc.steps, **metrics}


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
    parser = build_parser(prog or "python -m linear_rope.train")
    args = parser.parse_args(argv)

    def fail(msg: str):  # under torchrun every rank exits 2, rank 0 alone says why
        parser.exit(2, f"{parser.prog}: error: {msg}\n" if os.environ.get("RANK", "0") == "0" else "")

    try:
        runs = configs_from_args(args)
    except ValueError as e:
        fail(_one_line(e))
    tc0 = runs[0][2]
    out = Path(tc0.out)
    for name, _, _ in runs:
        if (out / name / CHECKPOINT).exists() and not args.resume:
            fail(f"{out / name / CHECKPOINT} exists; pass --resume to continue it, "
                 f"or choose another --out")
    if tc0.threads:
        torch.set_num_threads(tc0.threads)
    dd = init_distributed(tc0.device)
    try:
        if dd.rank == 0:  # rank 0 downloads / splits first; the others then find the cache
            paths = _prepare(tc0)
        if dd.world > 1:
            dist.barrier()
            paths = paths if dd.rank == 0 else _prepare(tc0)
        splits = {k: data.load_split(p) for k, p in paths.items()}
        if dd.rank == 0 and not any(out.glob("events.out.tfevents.*")):
            write_layout(out)
        results = []
        for name, mc, tc in runs:
            try:
                results.append((name, train_run(name, mc, tc, splits, dd, args.resume)))
            except ConfigError as e:
                fail(_one_line(e))
    except data.DataError as e:
        fail(_one_line(e))
    finally:
        if dd.world > 1:
            dist.destroy_process_group()
    if dd.rank == 0:
        print(f"{'run':<20} {'step':>7} {'val bpc':>8} {'test bpc':>8}")
        for name, r in results:
            val, test = (f"{v:8.4f}" if v is not None else f"{'-':>8}"
                         for v in (r["val_bpc"], r["test_bpc"]))
            print(f"{name:<20} {r['step']:>7} {val} {test}")
        print(f"tensorboard --logdir {out}")
    return 0


def _prepare(tc: TrainConfig) -> dict[str, Path]:
    return data.prepare_corpus(tc.data, tc.data_dir) if tc.data else data.prepare_enwik8(tc.data_dir)


if __name__ == "__main__":
    sys.exit(main())
