"""Shared test helpers: the 64 KB training corpus, in-process CLI runs, event-file readers."""
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
SAMPLE = ROOT.parent / "shared/data/enwiki-sample.xml.bz2"


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
