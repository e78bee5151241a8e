"""Train the Enwik8 ablation: PerformerLM variants x seeds, with TensorBoard, checkpoints and DDP.

Commands, from the repository root::

    # a first run: enwik8 is downloaded once (checked by md5) into ~/.cache/linear_rope
    # ($LINEAR_ROPE_CACHE or --data-dir elsewhere), then the two tiny models train on it
    python train_enwik8.py --preset tiny --steps 200 --out runs/first
    # offline: any byte corpus you have (enwik8.zip, a Wikipedia dump excerpt, ...)
    python train_enwik8.py --preset tiny --steps 200 --data enwiki-sample.xml.bz2 --out runs/first
    # the CPU-scale ablation, RoPE against no position, two seeds
    python -m linear_rope.train --preset cpu --variants rope,none --seeds 0,1 --out runs/cpu
    # the paper's setting (RoFormer section 4.4) on enwik8 on one GPU:
    # global batch 128 = --batch-size 32 x --grad-accum 4, bf16 autocast (the CUDA default)
    python -m linear_rope.train --preset paper --batch-size 32 --grad-accum 4 --compile --out runs/paper
    # ... on 8 GPUs: global batch 128 = --batch-size 16 per rank x 8 ranks
    torchrun --standalone --nproc_per_node=8 -m linear_rope.train --preset paper --batch-size 16 \\
        --compile --out runs/paper
    # DDP on CPU (gloo): global batch = batch_size * grad_accum * ranks
    torchrun --standalone --nproc_per_node=2 train_enwik8.py --preset tiny --steps 30 --out runs/ddp
    # continue a finished or interrupted run to more steps, in the same log dirs
    python -m linear_rope.train --preset cpu --out runs/cpu --resume --steps 4000
    tensorboard --logdir runs/cpu
    python -m linear_rope.sample runs/cpu/rope-seed0 --prompt "The "

Every variant x seed is one run in ``<out>/<variant>-seed<k>/`` (TensorBoard events, config.json,
``ckpt-<step>.pt``, the newest ``--keep-checkpoints`` kept), trained by ``trainer.Trainer``.
Resume is exact: ``--resume`` reproduces every ``train/loss`` of an uninterrupted run bit for bit
on CPU. SIGTERM / SIGINT checkpoint at the end of the current step and exit 0 with the resume
command. A non-finite loss or gradient norm is not applied, and stops the run at the next
logging interval (exit 3), naming that step and the last good checkpoint. Every flag is checked before any data is read
(``cli.py``): a bad one is one line on stderr and exit 2.

``--compile`` compiles each block in place (``step.compile_blocks``: ``fullgraph=True``, one
compile serves every layer); ``--compile-mode reduce-overhead`` adds CUDA graphs, with
``--grad-accum 1`` only (a replay overwrites the last one's outputs). It is on by default on
CUDA and off on the CPU: there a ``cpu20m`` step compiled whole measured 0.96x eager at 1 thread (0.731 against 0.700 s; the op, the dense layers and their
GEMMs are most of the step, and Inductor fuses only what is around them), and the first steps
wait 49 s for compilation. On the CPU it needs a C++ compiler; without one the run trains eagerly
and says so in one line. A step reads nothing back from the device: the loss and the non-finite
flag are read once per ``--log-every`` interval, and a non-finite update is never applied (it is
gated on the device; ``--on-nonfinite stop`` ends the run at that interval). AdamW runs its fused kernel (one pass per tensor) where the device has one.
On CUDA the forward runs under bf16 autocast (``--precision``). On CPU the thread count is the
number of cores idle at start unless ``--threads`` or ``OMP_NUM_THREADS`` says otherwise (``runtime.py``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..ops.backend import check_backend
from . import data
from .checkpoint import check_out_dir, latest_checkpoint
from .cli import build_parser, parse_runs
from .config import ConfigError, TrainConfig
from .rundir import RunLocks, clear_run_dir, os_error_line
from .runtime import Dist, StopSignals, choose_threads, init_distributed, resume_command
from .trainer import EXIT_NONFINITE, NonFiniteError, Trainer

__all__ = ["main"]


def _one_line(e: BaseException | str) -> str:
    if isinstance(e, OSError):
        return os_error_line(e)
    return " ".join(str(e).split()) or type(e).__name__


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    prog = prog or "python -m linear_rope.train"
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog)
    lead = os.environ.get("RANK", "0") == "0"

    def fail(e, code: int = 2):  # under torchrun every rank exits, rank 0 alone says why
        parser.exit(code, f"{parser.prog}: error: {_one_line(e)}\n" if lead else "")

    try:  # every check that needs no data, before anything is read or written
        args, runs = parse_runs(parser, argv)
        check_backend(None if runs[0][2].device == "auto" else runs[0][2].device)  # LINEAR_ROPE_BACKEND
    except (ValueError, TypeError) as e:
        fail(e)
    # One writer per run folder (rank 0 holds the lock for the whole launch), held from before the
    # run-folder checks to the end; see rundir.py.
    locks = RunLocks(runs[0][2].out, [name for name, _, _ in runs]) if lead else None
    threads = torch.get_num_threads()  # restored: main may run in-process (tests, notebooks)
    try:
        try:
            for note in (locks.acquire() if locks else []):
                print(f"{parser.prog}: note: {note}", file=sys.stderr)
            clear = check_out_dir(runs, args.resume, args.overwrite)
            fresh = nothing_to_resume(runs) if args.resume and lead else None
        except (ValueError, OSError) as e:
            fail(e)
        if fresh:  # a typo in --out resumes nothing: say so before training starts
            print(f"{parser.prog}: note: {fresh}", file=sys.stderr)
        results, dd = _run(runs, clear, args.resume, fail)
        if dd.lead:
            _report(results, Path(runs[0][2].out), argv, prog, dd.world)
    except OSError as e:  # a folder under a file, in /proc, a full disk: atomic writes lost nothing
        fail(e)
    finally:
        torch.set_num_threads(threads)
        if locks:
            locks.release()
    return 0


def nothing_to_resume(runs) -> str | None:
    """For ``--resume``: one line naming what it looked for and did not find (the runs without a
    checkpoint, which start from step 0), or None when every run has a checkpoint."""
    out = Path(runs[0][2].out)
    fresh = [name for name, _, _ in runs if latest_checkpoint(out / name) is None]
    if not fresh:
        return None
    which = "every run" if len(fresh) == len(runs) else ", ".join(fresh)
    return (f"--resume: no checkpoint (ckpt-<step>.pt) in {', '.join(str(out / n) for n in fresh)}; "
            f"starting {which} from step 0")


def _run(runs, clear: list[Path], resume: bool, fail) -> tuple[list, Dist]:
    tc0 = runs[0][2]
    if tc0.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dd = init_distributed(tc0.device)
    threads, why = choose_threads(tc0.threads, dd.device)
    results = []
    try:
        with StopSignals(quiet=not dd.lead) as stop:
            splits = _load_data(runs, dd)
            if dd.lead:
                for run_dir in clear:  # --overwrite: only the files a run writes
                    kept = clear_run_dir(run_dir)
                    if kept:
                        print(f"{run_dir.name}: --overwrite kept what a run does not write: "
                              f"{', '.join(kept)}", file=sys.stderr)
            if dd.world > 1:
                dist.barrier()
            for name, mc, tc in runs:
                trainer = Trainer(name, mc, tc, splits, dd, stop, threads=f"{threads} ({why})")
                if resume:
                    trainer.resume()
                results.append((name, trainer.fit()))
                del trainer  # its model and optimizer go before the next run's are built
                if results[-1][1]["stopped"]:
                    break
    except (data.DataError, ConfigError) as e:
        fail(e)
    except NonFiniteError as e:
        fail(e, EXIT_NONFINITE)
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        fail(f"out of memory ({' '.join(str(e).split())[:120]}); lower --batch-size or --eval-batch-size "
             f"(--grad-accum keeps the global batch); the checkpoints already written are intact")
    finally:
        if dd.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return results, dd


def _load_data(runs, dd: Dist) -> dict:
    """The splits (rank 0 downloads / splits first; the other ranks then find the cache)."""
    tc = runs[0][2]
    if dd.lead:
        paths = _prepare(tc)
    if dd.world > 1:
        dist.barrier()
        paths = paths if dd.lead else _prepare(tc)
    splits = {k: data.load_split(p) for k, p in paths.items()}
    for _, mc, _ in runs:
        if len(splits["train"]) < mc.seq_len + 1:
            raise data.DataError(
                f"corpus too short: the train split has {len(splits['train'])} bytes, "
                f"less than one training window of seq_len + 1 = {mc.seq_len + 1}")
    return splits


def _prepare(tc: TrainConfig) -> dict[str, Path]:
    return data.prepare_corpus(tc.data, tc.data_dir) if tc.data else data.prepare_enwik8(tc.data_dir)


def _report(results, out: Path, argv: list[str], prog: str, world: int) -> None:
    """The final table on stdout; on a signal, the command that resumes."""
    print(f"{'run':<20} {'step':>7} {'val bpc':>8} {'test bpc':>8}")
    for name, r in results:
        val, test = (f"{v:8.4f}" if v is not None else f"{'-':>8}"
                     for v in (r["val_bpc"], r["test_bpc"]))
        at = r.get("val_step")
        mark = ""
        if r["val_bpc"] is not None and at is not None and at != r["step"]:
            mark = f"  (val bpc of step {at})"  # stopped between evaluations
        print(f"{name:<20} {r['step']:>7} {val} {test}{mark}")
    print(f"tensorboard --logdir {out}")
    if results and results[-1][1]["stopped"]:
        name, r = results[-1]
        print(f"{name}: stopped by {r['stopped']} at step {r['step']}, checkpoint saved; "
              f"resume with:\n  {resume_command(argv, prog, world)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
