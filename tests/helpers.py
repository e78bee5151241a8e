"""Shared test helpers: in-process CLI runs, event-file readers (the training corpus: conftest.py)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from linear_rope.enwik8 import train

ROOT = Path(__file__).resolve().parents[1]
SHIM = [sys.executable, str(ROOT / "train_enwik8.py")]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = train.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def raw_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every train/loss event in every event file, in file order, without TensorBoard's purge."""
    found = []
    for f in sorted(run_dir.glob("events.out.tfevents.*")):
        for ev in EventFileLoader(str(f)).Load():
            for v in ev.summary.value:
                if v.tag == "train/loss":
                    found.append((ev.step, v.simple_value))
    return found


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """train/loss as TensorBoard shows it (events after a restart's purge step are dropped)."""
    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars("train/loss")]


def wait_for(pred, proc: subprocess.Popen, timeout: float = 120.0, poll: float = 0.01) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} early: {proc.communicate()[1][-2000:]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(poll)




def past_the_event_files_second(run_dir: Path) -> None:
    """Wait until the clock has passed the whole second in the newest event file's name.

    TensorBoard orders a run's event files by that second: a resumed run's file must not share
    it. This waits on the file's own timestamp, not for a fixed time."""
    stamps = [int(p.name.split(".")[3]) for p in run_dir.glob("events.out.tfevents.*")]
    while stamps and time.time() < max(stamps) + 1:
        time.sleep(0.01)


def latest_step(run_dir: Path) -> int:
    """The step of the newest checkpoint on disk (0 when there is none)."""
    from linear_rope.enwik8.checkpoint import list_checkpoints

    return max((s for s, _ in list_checkpoints(run_dir)), default=0)


def poison_training_forward(monkeypatch, calls, where: str = "grad") -> dict:
    """Make the training forwards of PerformerLM numbered in ``calls`` (1-based) non-finite.

    ``where="loss"`` returns NaN logits (so a NaN loss); ``where="grad"`` keeps the
    loss finite and makes only the gradient w.r.t. the logits NaN. Returns the state
    ``{"n": forwards so far, "calls": set}``, which a test may reset between runs.
    """
    import torch
    from linear_rope.model import PerformerLM

    forward, state = PerformerLM.forward, {"n": 0, "calls": set(calls)}

    def poisoned(self, x, *a, **kw):
        logits = forward(self, x, *a, **kw)
        if self.training:
            state["n"] += 1
            if state["n"] in state["calls"]:
                if where == "loss":
                    return logits * float("nan")
                logits.register_hook(lambda g: torch.full_like(g, float("nan")))
        return logits

    monkeypatch.setattr(PerformerLM, "forward", poisoned)
    return state


def bf16_bound(out, ref):
    """bf16 keeps 8 significant bits: rounding the output costs at most 2^-9 of it. Running sums
    and tables are float32 inside, so every position, the last of a long sequence as well as the
    first, stays within 2^-8 relative (plus float32 round-off) of the float64 reference of the
    same bf16 inputs; a negated, zero or float32-accumulated-in-bf16 output does not."""
    import torch

    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()
    worst = (err / bound).amax(dim=(0, 1, 3))  # per position
    assert (worst <= 1).all(), (worst.argmax().item(), worst.max().item())
