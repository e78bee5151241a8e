"""What training steps leave on the device until the host reads them: the step ledger.

A step reads nothing back: its loss, gradient norm and fate (applied, skipped, stopped) go into a
device-side window of one logging interval, read in one sync by ``flush`` (the trainer calls it
once per interval, and before every evaluation and checkpoint), which logs them and raises
:class:`NonFiniteError` where a non-finite step stopped the run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .checkpoint import last_good_checkpoint
from .files import atomic_write

__all__ = ["StepLedger", "NonFiniteError", "MAX_SKIPS_IN_A_ROW", "NONFINITE_FILE"]

NONFINITE_FILE = "nonfinite.json"  # written into a run dir that a non-finite step stopped
MAX_SKIPS_IN_A_ROW = 20  # --on-nonfinite skip: this many non-finite steps in a row still stop the run


class NonFiniteError(Exception):
    """The loss or the gradient norm is NaN / inf (the run stops, exit 3)."""


class StepLedger:
    """The device-side record of the steps since the last ``flush``: a row [loss, grad norm,
    code] per step (``gate``'s code), the skips in a row, whether the run has stopped, and (DDP)
    the stop requests of other ranks."""

    def __init__(self, name: str, run_dir: Path, interval: int, on_nonfinite: str, device: torch.device,
                 lead: bool, log):
        self.name, self.run_dir, self.on_nonfinite, self.lead, self.log = name, run_dir, on_nonfinite, lead, log
        self.window = torch.zeros(max(interval, 1), 3, device=device)
        self.pending: list[int] = []  # the 1-based steps whose rows wait in the window
        self._run = torch.zeros((), dtype=torch.long, device=device)
        self._halted = torch.zeros((), dtype=torch.bool, device=device)
        self.stop_seen = torch.zeros((), device=device)
        self.skip_run = 0  # the host's count of skips in a row, as of the last flush

    @property
    def full(self) -> bool:
        return len(self.pending) == self.window.shape[0]

    def gate(self, bad: torch.Tensor) -> torch.Tensor:
        """On the device, what happens to this step's update: 0 applied, 1 skipped (``skip``), 2
        the run stops here (not applied), 3 not applied (the run stopped at an earlier step)."""
        limit = MAX_SKIPS_IN_A_ROW if self.on_nonfinite == "skip" else 0
        halt = bad & (self._run >= limit)
        skip = bad & ~halt & ~self._halted
        code = torch.where(self._halted, 3, torch.where(halt, 2, skip.long()))
        self._run = torch.where(skip, self._run + 1, torch.where(bad | self._halted, self._run, 0))
        self._halted = self._halted | halt
        return code

    def push(self, done: int, loss: torch.Tensor, grad_norm: torch.Tensor, code: torch.Tensor) -> None:
        """The row of step ``done`` (1-based), written on the device."""
        self.pending.append(done)
        self.window[len(self.pending) - 1] = torch.stack([loss, grad_norm.float(), code.float()])

    def flush(self, metrics: dict, world: int) -> bool:
        """Read the steps since the last flush (one sync), log them, and raise
        :class:`NonFiniteError` where one stopped the run. Returns whether another rank asked
        to stop (DDP)."""
        if not self.pending:
            return False
        rows = self.window[:len(self.pending)].tolist()
        stop_seen = bool(self.stop_seen) if world > 1 else False
        steps, self.pending = self.pending, []
        last = None
        for done, (loss, grad_norm, code) in zip(steps, rows):
            if code == 1:
                self.skip_run += 1
                metrics["skipped_steps"] = metrics.get("skipped_steps", 0) + 1
                self.log.skipped(done, metrics["skipped_steps"], loss, grad_norm)
            elif code == 2:
                what = "loss" if not math.isfinite(loss) else "gradient norm"
                again = f" ({MAX_SKIPS_IN_A_ROW} skipped in a row before it)" if self.skip_run else ""
                after = f", nor any after it up to step {steps[-1]}" if steps[-1] > done else ""
                self.stop_nonfinite(done, what, f"non-finite {what} at step {done}{again}; the update "
                                    f"was not applied{after} and the run stopped")
            elif code == 3:  # only after a caller went on past the NonFiniteError of that step
                self.stop_nonfinite(done, "an earlier step", f"step {done} was not applied: the run stopped "
                                    f"at an earlier non-finite step")
            else:
                self.skip_run = 0
                last = (loss, grad_norm)
                self.log.train(done, loss, grad_norm)
        self.log.update(steps[-1], **({} if last is None else
                                      {"loss": f"{last[0]:.4f}", "bpc": f"{last[0] / math.log(2):.3f}"}))
        return stop_seen

    def stop_nonfinite(self, step: int, what: str, why: str):
        """Raise :class:`NonFiniteError` naming the last good checkpoint (finite weights and val
        BPC), and say so in the run dir's nonfinite.json (a resume removes it)."""
        good = last_good_checkpoint(self.run_dir) if self.lead else None
        where = (f"last good checkpoint: {good} (resume from it with --resume, e.g. with a "
                 f"lower --lr)" if good else "no good checkpoint was written")
        if self.lead:
            atomic_write(self.run_dir / NONFINITE_FILE, json.dumps(
                {"step": step, "what": what, "skipped_in_a_row": self.skip_run,
                 "last_checkpoint": good and good.name}) + "\n")
        raise NonFiniteError(f"{self.name}: {why}; {where}")
