"""What one run reports, and where. On rank 0: the run folder's config.json and start entry, the
header lines on stderr, and the TensorBoard event file (train loss and BPC, lr, tokens/s, gradient
norm, skipped steps, val and test BPC, the hparams); the progress line is rank 0's too.

The trainer calls it with numbers it has already read from the device (``Trainer._flush``, one
read per interval); nothing here reads the device.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from .config import TrainConfig, lr_at
from .rundir import start_entry, write_config
from .runtime import Progress

__all__ = ["RunLog", "LAYOUT"]

# Custom Scalars: each chart overlays every run's curve (TensorBoard merges the runs' layouts).
LAYOUT = {"ablation": {"val/bpc (all runs)": ["Multiline", [r"^val/bpc$"]],
                       "train/bpc (all runs)": ["Multiline", [r"^train/bpc$"]]}}


class RunLog:
    """One run's logs: :meth:`open` where training starts, one call per step read back or
    evaluation, :meth:`close` at the end. Before :meth:`open`, and on ranks other than 0, nothing
    is written."""

    def __init__(self, name: str, run_dir: Path, tc: TrainConfig, tokens_per_step: int):
        self.name, self.run_dir, self.tc = name, run_dir, tc
        self.tokens_per_step = tokens_per_step  # the global batch's tokens: for tokens/s
        self.writer: SummaryWriter | None = None
        self.progress: Progress | None = None
        self._t0, self._n = time.perf_counter(), 0  # tokens/s: since when, over how many steps

    def open(self, step: int, lead: bool, config: dict, corpus: dict, attention: str,
             header: str) -> None:
        """The progress line from ``step`` on; on rank 0 (``lead``) also config.json and its start
        entry, the event file, and the header lines (``header``, then the attention path)."""
        self.progress = Progress(self.name, self.tc.steps, step, enabled=lead)
        self.restart_clock()
        if not lead:
            return
        text = json.dumps(config, indent=2)
        entry = {**start_entry(step, config["train"], corpus), "attention": attention}
        write_config(self.run_dir, {**config, "attention": attention}, entry)
        # purge_step: readers drop events a killed process wrote after the checkpoint we resume
        self.writer = SummaryWriter(self.run_dir, purge_step=step + 1)
        self.writer.add_text("config", f"```\n{text}\n```", step)
        self.writer.add_custom_scalars(LAYOUT)  # in every run, so --out's top folder holds no run of its own
        print(f"{self.name}: {header}", file=sys.stderr)
        print(f"{self.name}: attention: {attention}", file=sys.stderr)

    def restart_clock(self) -> None:
        """tokens/s counts from now (an evaluation's time is left out)."""
        self._t0, self._n = time.perf_counter(), 0

    def update(self, step: int, **postfix) -> None:
        """Move the progress line to ``step`` (1-based), with ``postfix`` shown beside it."""
        if self.progress is not None:
            self.progress.update(step, **postfix)

    def train(self, done: int, loss: float, grad_norm: float) -> None:
        """An applied step (``done``, 1-based): the scalars every ``log_every`` steps and at the last."""
        tc = self.tc
        self._n += 1
        bpc = loss / math.log(2)
        if done % tc.log_every == 0 or done == tc.steps:
            if self.writer is not None:
                tok_s = self._n * self.tokens_per_step / (time.perf_counter() - self._t0)
                for tag, v in (("train/loss", loss), ("train/bpc", bpc), ("lr", lr_at(done - 1, tc)),
                               ("perf/tokens_per_sec", tok_s), ("grad/norm", grad_norm)):
                    self.writer.add_scalar(tag, v, done)
            self.restart_clock()

    def skipped(self, done: int, n: int, loss: float, grad_norm: float) -> None:
        """A skipped step (``--on-nonfinite skip``), the ``n``-th of the run."""
        if self.writer is not None:
            self.writer.add_scalar("train/skipped_steps", n, done)
        if self.progress is not None:
            self.progress.write(f"{self.name} step {done}: non-finite "
                                f"{'loss' if not math.isfinite(loss) else f'gradient norm ({grad_norm})'}, "
                                f"update skipped ({n} so far)")

    def val(self, step: int, bpc: float, started: float) -> None:
        """The val BPC at ``step``, measured since ``time.perf_counter()`` was ``started``."""
        if self.writer is not None:
            self.writer.add_scalar("val/bpc", bpc, step)
            self.writer.flush()  # every evaluation is on disk as soon as it is printed
        self.progress.write(f"{self.name} step {step}: val bpc {bpc:.4f} "
                            f"(eval {time.perf_counter() - started:.1f} s)")

    def final(self, config: dict, metrics: dict, attention: str) -> None:
        """At the end of a run that was not stopped: the test BPC and the hparams."""
        w = self.writer
        if w is None:
            return
        w.add_scalar("test/bpc", metrics["test_bpc"], self.tc.steps)
        hparams = {f"{group}.{k}": ("None" if v is None else v)
                   for group, cfg in config.items() for k, v in cfg.items()}
        w.add_hparams({"run": self.name, "attention": attention, **hparams},
                      {"hparam/val_bpc": metrics["val_bpc"], "hparam/test_bpc": metrics["test_bpc"]},
                      run_name=".")

    def flush(self) -> None:
        """Every event so far on disk (before a checkpoint of the same step is)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
