"""Trainer: one run (one variant x seed) of the Enwik8 ablation.

``Trainer.fit`` is the loop; ``Trainer.train_step`` is one optimizer step. What a checkpoint holds
is a :class:`~linear_rope.enwik8.state.TrainState` (its ``state_dict()`` is the checkpoint); the
pieces of a step (the run's model and generators, autocast, the optimizer, the one BPC evaluation
:func:`evaluate`) are in :mod:`linear_rope.enwik8.step`; what a run reports (TensorBoard, the
progress line) is in :mod:`linear_rope.enwik8.metrics`.

Runs with the same seed share the initial weights (``torch.manual_seed(seed)`` before the model
is built), the FAVOR+ projections and every redraw (a generator seeded ``seed + 1_000_003``) and
the data order (a generator seeded ``seed * 1000``), so variants differ only in where position
enters the model. Each step draws one global batch of crop starts; rank ``r`` takes micro-batch
``j``'s slice ``(j * world + r) * batch_size``, so ranks see distinct crops and 2 ranks x batch b
train on the same global batches as 1 rank x batch 2b.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model import ModelConfig
from . import data
from .checkpoint import nonfinite, save_checkpoint
from .config import ConfigError, TrainConfig, lr_at
from .ledger import MAX_SKIPS_IN_A_ROW, NONFINITE_FILE, NonFiniteError, StepLedger
from .metrics import RunLog
from .resume import checked_checkpoint, load_initial_weights
from .runtime import Dist, StopSignals
from .state import TrainState
from .step import (FEATURE_SEED_OFFSET, attention_path, autocast, build_run, compile_blocks, compile_unavailable, evaluate,
                   make_optimizer, on_device, uses_bf16)

__all__ = ["Trainer", "TrainState", "build_run", "evaluate", "autocast", "make_optimizer", "compile_unavailable",
           "NonFiniteError", "EXIT_NONFINITE", "FEATURE_SEED_OFFSET", "NONFINITE_FILE", "MAX_SKIPS_IN_A_ROW"]

EXIT_NONFINITE = 3


class Trainer:
    """One run: ``Trainer(...).resume()`` (optional), then ``.fit()`` -> its result dict."""

    def __init__(self, name: str, mc: ModelConfig, tc: TrainConfig, splits: dict,
                 dd: Dist = Dist(), stop: StopSignals | None = None, threads: str = ""):
        self.name, self.mc, self.tc, self.splits, self.dd, self.stop = name, mc, tc, splits, dd, stop
        self.threads = threads  # how many CPU threads, and why: for the header line
        self.run_dir = Path(tc.out) / name
        try:
            model, data_gen, feature_gen = build_run(mc, tc.seed)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from e
        if tc.init_from:  # the checkpoint's weights (and projections), then a fresh run from step 0
            load_initial_weights(tc.init_from, model)
        if dd.rank:  # rank 0 keeps the seed's stream; the others draw their own dropout masks
            torch.manual_seed(tc.seed * 1000 + FEATURE_SEED_OFFSET * dd.rank)
        self.model = self.net = model.to(dd.device)
        self.corpus = data.corpus_digest(splits)  # stored at the first start; a resume must match it
        config = {"model": asdict(mc), "train": asdict(tc), "corpus": self.corpus}
        self.state = TrainState(model, make_optimizer(model, tc), data_gen, feature_gen, config, dd)
        self.per_step = tc.batch_size * tc.grad_accum * dd.world  # the global batch
        self.log = RunLog(name, self.run_dir, tc, self.per_step * mc.seq_len)
        self.compiled = False  # tc.compile, where a compiler was found (``_open``)
        # --compile / --no-compile, else on CUDA (one graph per step) and off on the CPU, where a
        # compiled step measured no faster than eager (linear_rope/enwik8/train.py)
        self.wants_compile = tc.compile if tc.compile is not None else dd.device.type == "cuda"
        # what a step leaves on the device until the next _flush reads it
        self.ledger = StepLedger(name, self.run_dir, tc.log_every, tc.on_nonfinite, dd.device, dd.lead, self.log)

    def resume(self) -> bool:
        """Load the run dir's newest checkpoint, if any, after the resume checks (``resume.py``)."""
        ckpt = checked_checkpoint(self.run_dir, self.name, self.mc, self.tc, self.model, self.corpus,
                                  self.dd.world, self.dd.lead)
        if ckpt is None:
            return False
        self.state.load_state_dict(ckpt)
        return True

    def fit(self) -> dict:
        """Train up to ``tc.steps``; ``{"step", "val_bpc", "val_step", "test_bpc", "stopped"}``
        (``val_step``: the step ``val_bpc`` is of), where
        ``stopped`` names the signal that ended the run early (it was checkpointed).

        A step reads nothing back from the device: its statistics are read once per logging
        interval (``_flush``), and before every evaluation and checkpoint."""
        st, tc = self.state, self.tc
        if st.step >= tc.steps:
            if self.dd.lead:
                print(f"{self.name}: already done (step {st.step} >= --steps {tc.steps}); "
                      f"skipping", file=sys.stderr)
            return {"step": st.step, **st.metrics, "stopped": None}
        st.metrics["test_bpc"] = None  # of the shorter run; measured again at the new end
        if self.dd.lead:
            (self.run_dir / NONFINITE_FILE).unlink(missing_ok=True)  # it goes on from here
        self._open()
        stopped = None
        try:
            for step in range(st.step, tc.steps):
                stop_now = self.train_step(step)[2]
                st.step = done = step + 1
                last = done == tc.steps
                evaluated = bool(tc.eval_every and done % tc.eval_every == 0) or last
                saving = evaluated or stop_now or bool(tc.checkpoint_every and done % tc.checkpoint_every == 0)
                if saving or done % tc.log_every == 0 or self.ledger.full:
                    stop_now = self._flush() or stop_now
                    saving = saving or stop_now
                else:
                    self.log.update(done)
                if evaluated:
                    self._log_eval(last)
                if saving:
                    self.save()
                if stop_now and not last:
                    stopped = (self.stop and self.stop.received) or "a signal on another rank"
                    break
            if stopped is None:
                self.log.final(st.config, st.metrics, self.attention)
        finally:
            self._close()
        return {"step": st.step, **st.metrics, "stopped": stopped}

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The update at 0-based ``step``: redraw, lr, one global batch in ``grad_accum`` micro-
        batches, clip, one small collective (mean loss, non-finite flag, stop request), AdamW.

        Returns ``(loss, grad norm, stop requested)``: the first two are 0-dim tensors on the
        device, read by nobody here (``float(loss)`` waits for the step). Nothing is read back
        from the device: a non-finite loss or gradient norm keeps the update from being applied
        on the device (fused AdamW's ``found_inf``), and so does every step after one that
        stops the run (``--on-nonfinite stop``, or more than ``MAX_SKIPS_IN_A_ROW`` skips); the
        next ``_flush`` (``ledger.py``) reports it and raises :class:`NonFiniteError`. Under DDP the stop request
        of another rank is seen at the next ``_flush`` too."""
        st, tc, mc, dd = self.state, self.tc, self.mc, self.dd
        if self.ledger.full:  # a caller other than fit, past an interval
            self._flush()
        if mc.feature_redraw_interval and step > 0 and step % mc.feature_redraw_interval == 0:
            self.model.redraw_features(st.feature_gen)
        for group in st.optimizer.param_groups:
            group["lr"] = lr_at(step, tc)
        train = self.splits["train"]
        starts = data.draw_starts(train, self.per_step, mc.seq_len, st.data_gen)
        st.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=dd.device)
        for j in range(tc.grad_accum):
            lo = (j * dd.world + dd.rank) * tc.batch_size
            x, y = (on_device(t, dd.device) for t in data.crops(train, starts[lo:lo + tc.batch_size], mc.seq_len))
            sync = self.net is self.model or j == tc.grad_accum - 1  # DDP reduces on the last
            with contextlib.nullcontext() if sync else self.net.no_sync():
                with autocast(dd.device, tc.precision):
                    logits = self.net(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                (loss / tc.grad_accum).backward()
            loss_sum = loss_sum + loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip or math.inf)
        stop = self.stop is not None and self.stop.received is not None
        loss_v = loss_sum.float() / tc.grad_accum
        bad = (~torch.isfinite(loss_v)) | (~torch.isfinite(grad_norm))
        if dd.world > 1:  # the mean loss, a non-finite step on any rank, a stop request on any rank
            stats = torch.stack([loss_v, bad.float(), torch.full((), float(stop), device=dd.device)])
            dist.all_reduce(stats)
            loss_v, bad = stats[0] / dd.world, stats[1] > 0
            self.ledger.stop_seen = self.ledger.stop_seen + stats[2]
        code = self.ledger.gate(bad)
        if all(g.get("fused") for g in st.optimizer.param_groups):
            st.optimizer.found_inf = code.ne(0).float()  # the fused kernel leaves every tensor as it was
            st.optimizer.step()
        else:  # the for-each AdamW has no found_inf: read the flag (a sync)
            st.optimizer.__dict__.pop("found_inf", None)
            if not bool(code.ne(0)):
                st.optimizer.step()
        self.ledger.push(step + 1, loss_v, grad_norm, code)
        return loss_v, grad_norm, stop and dd.world == 1

    def _flush(self) -> bool:
        """The ledger's flush: the steps since the last one read (one sync) and logged."""
        return self.ledger.flush(self.state.metrics, self.dd.world)

    def evaluate(self, split: str) -> float:
        return evaluate(self.model, self.splits[split], self.mc.seq_len, self.tc.eval_batch_size,
                        self.dd, self.tc.precision)

    def save(self) -> None:
        """Checkpoint ``TrainState.state_dict()`` (every rank takes part; rank 0 writes).

        The event file is flushed first: once a checkpoint of step s is on disk, so is every
        event up to step s (what a reader, or a test waiting on the run, can rely on)."""
        sd = self.state.state_dict()
        bad = nonfinite(sd)  # the same on every rank: weights are checked equal, val BPC is reduced
        if bad:  # never written, so never kept or named as the last good one
            self.ledger.stop_nonfinite(self.state.step, bad, f"{bad} at step {self.state.step}, not "
                                       f"checkpointed; the run stopped")
        if self.dd.lead:
            self.log.flush()
            save_checkpoint(self.run_dir, self.state.step, sd, keep=self.tc.keep_checkpoints)

    # ------------------------------------------------------------------ a run's start and end

    def _open(self) -> None:
        """compile, DDP, and the run's logs (on rank 0 config.json, TensorBoard, the header lines)."""
        st, tc, dd = self.state, self.tc, self.dd
        compiles = self.wants_compile and compile_unavailable(dd.device) is None
        self.attention = attention_path(self.model, dd.device, tc.precision, tc.compile_mode if compiles else None)
        if self.wants_compile and not self.compiled:
            why = compile_unavailable(dd.device)
            if why is None:  # in place: state_dict keys stay clean; one compile serves every block, or an error
                compile_blocks(self.model, mode=None if tc.compile_mode == "default" else tc.compile_mode)
                self.compiled = True
            elif dd.lead:
                print(f"{self.name}: info: {why}; training eagerly (--no-compile says so up front)",
                      file=sys.stderr)
        if dd.world > 1:
            ids = [dd.device.index] if dd.device.type == "cuda" else None
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        precision = "bf16 autocast" if uses_bf16(dd.device, tc.precision) else "fp32"
        header = (f"{self.model.num_params():,} params, steps {st.step} -> {tc.steps}, "
                  f"device {dd.device}, {precision}{', compiled' if self.compiled else ''}, "
                  f"{f'threads {self.threads}, ' if self.threads else ''}ranks {dd.world}, "
                  f"global batch {self.per_step}")
        self.log.open(st.step, dd.lead, st.config, self.corpus, self.attention, header)

    def _log_eval(self, last: bool) -> None:
        """The val BPC, reported; at the last step also the test BPC."""
        st, t = self.state, time.perf_counter()
        st.metrics["val_bpc"], st.metrics["val_step"] = self.evaluate("valid"), st.step
        self.log.val(st.step, st.metrics["val_bpc"], t)
        if last:
            st.metrics["test_bpc"] = self.evaluate("test")
        self.log.restart_clock()  # tokens/s leaves eval time out

    def _close(self) -> None:
        # drop DDP's reducer now: freed after destroy_process_group, gloo's destructor can hang
        self.net = self.model
        self.log.close()
