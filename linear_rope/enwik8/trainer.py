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
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model import ModelConfig
from ..ops.backend import record_paths
from . import data
from .checkpoint import (CheckpointError, last_good_checkpoint, latest_checkpoint, load_checkpoint, nonfinite,
                         previous_checkpoint, save_checkpoint, verify_params)
from .config import ConfigError, TrainConfig, lr_at, resume_diffs
from .files import atomic_write
from .metrics import RunLog
from .runtime import Dist, StopSignals
from .state import TrainState
from .step import (FEATURE_SEED_OFFSET, autocast, build_run, compile_blocks, compile_unavailable, evaluate,
                   make_optimizer, on_device, uses_bf16)

__all__ = ["Trainer", "TrainState", "build_run", "evaluate", "autocast", "make_optimizer", "compile_unavailable",
           "NonFiniteError", "EXIT_NONFINITE", "FEATURE_SEED_OFFSET", "NONFINITE_FILE"]

EXIT_NONFINITE = 3
NONFINITE_FILE = "nonfinite.json"  # written into a run dir that a non-finite step stopped
MAX_SKIPS_IN_A_ROW = 20  # --on-nonfinite skip: this many non-finite steps in a row still stop the run


class NonFiniteError(Exception):
    """The loss or the gradient norm is NaN / inf (the run stops, exit 3)."""


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
        # What a step leaves on the device for the next _flush: a row [loss, grad norm, code]
        # per step (see _gate), the skips in a row, whether the run has stopped, stop requests.
        self._window = torch.zeros(max(tc.log_every, 1), 3, device=dd.device)
        self._pending: list[int] = []  # the 1-based steps whose rows wait in _window
        self._run = torch.zeros((), dtype=torch.long, device=dd.device)
        self._halted = torch.zeros((), dtype=torch.bool, device=dd.device)
        self._stop_seen = torch.zeros((), device=dd.device)
        self._skip_run = 0  # the host's count of skips in a row, as of the last _flush

    def resume(self) -> bool:
        """Load the run dir's newest checkpoint, if any, after the resume checks: the config
        (``resume_diffs``), the corpus (its digest), and the checkpoint's own digests."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return False

        def refuse(why: str):
            older = previous_checkpoint(path)
            hint = f"; move it away to resume from {older.name}" if older else ""
            raise ConfigError(f"cannot resume: {why}{hint}") from None

        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            refuse(str(e))
        diffs = resume_diffs(ckpt["config"], self.mc, self.tc)
        if ckpt.get("world", 1) != self.dd.world:
            diffs.append(f"ranks: checkpoint {ckpt.get('world', 1)}, now {self.dd.world} (the "
                         f"global batch and data slices depend on it)")
        if diffs:
            raise ConfigError(f"cannot resume from {path}: config differs ({'; '.join(diffs)})")
        self._check_corpus(ckpt["config"], path)
        try:
            verify_params(ckpt, self.model, path)
        except CheckpointError as e:
            refuse(str(e))
        old = ckpt["config"]["train"]
        if (self.tc.decay_steps is None and old.get("decay_steps") is None
                and old["steps"] != self.tc.steps and self.dd.lead):
            print(f"{self.name}: note: the cosine now ends at step {self.tc.steps}, not "
                  f"{old['steps']} (fix --decay-steps to avoid this)", file=sys.stderr)
        self.state.load_state_dict(ckpt)
        return True

    def _check_corpus(self, old: dict, path) -> None:
        """A resume trains on the corpus the run started on: the same bytes, wherever --data now
        points. A checkpoint from before corpus digests can only be checked by its --data path."""
        was, now = old.get("corpus"), self.corpus
        if isinstance(was, dict) and "sha256" in was:
            if was["sha256"] != now["sha256"]:
                raise ConfigError(
                    f"cannot resume from {path}: --data is another corpus (sha256 {now['sha256'][:12]}, "
                    f"{now['bytes']:,} bytes) than the run started on (sha256 {was['sha256'][:12]}, "
                    f"{was.get('bytes', 0):,} bytes, from --data {old['train'].get('data')}); pass the same corpus")
            return
        if old["train"].get("data") != self.tc.data:
            raise ConfigError(f"cannot resume from {path}: it was trained on --data {old['train'].get('data')}, "
                              f"now --data {self.tc.data}, and it predates corpus digests, so only the path "
                              f"can be compared; pass the same --data")
        if self.dd.lead:
            print(f"{self.name}: note: {path.name} predates corpus digests; the corpus was checked by its "
                  f"path, and its sha256 is recorded from now on", file=sys.stderr)

    def fit(self) -> dict:
        """Train up to ``tc.steps``; ``{"step", "val_bpc", "test_bpc", "stopped"}``, where
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
                if saving or done % tc.log_every == 0 or len(self._pending) == self._window.shape[0]:
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
        next ``_flush`` reports it and raises :class:`NonFiniteError`. Under DDP the stop request
        of another rank is seen at the next ``_flush`` too."""
        st, tc, mc, dd = self.state, self.tc, self.mc, self.dd
        if len(self._pending) == self._window.shape[0]:  # a caller other than fit, past an interval
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
            loss_v, bad, self._stop_seen = stats[0] / dd.world, stats[1] > 0, self._stop_seen + stats[2]
        code = self._gate(bad)
        if all(g.get("fused") for g in st.optimizer.param_groups):
            st.optimizer.found_inf = code.ne(0).float()  # the fused kernel leaves every tensor as it was
            st.optimizer.step()
        else:  # the for-each AdamW has no found_inf: read the flag (a sync)
            st.optimizer.__dict__.pop("found_inf", None)
            if not bool(code.ne(0)):
                st.optimizer.step()
        self._pending.append(step + 1)
        self._window[len(self._pending) - 1] = torch.stack([loss_v, grad_norm.float(), code.float()])
        return loss_v, grad_norm, stop and dd.world == 1

    def _gate(self, bad: torch.Tensor) -> torch.Tensor:
        """On the device, what happens to this step's update: 0 applied, 1 skipped (``skip``), 2
        the run stops here (not applied), 3 not applied (the run stopped at an earlier step).
        ``self._run`` counts the skips in a row, ``self._halted`` says the run has stopped."""
        limit = MAX_SKIPS_IN_A_ROW if self.tc.on_nonfinite == "skip" else 0
        halt = bad & (self._run >= limit)
        skip = bad & ~halt & ~self._halted
        code = torch.where(self._halted, 3, torch.where(halt, 2, skip.long()))
        self._run = torch.where(skip, self._run + 1, torch.where(bad | self._halted, self._run, 0))
        self._halted = self._halted | halt
        return code

    def _flush(self) -> bool:
        """Read the steps since the last flush (one sync), log them, and raise
        :class:`NonFiniteError` where one stopped the run. Returns whether another rank asked
        to stop (DDP)."""
        if not self._pending:
            return False
        st = self.state
        rows = self._window[:len(self._pending)].tolist()
        stop_seen = bool(self._stop_seen) if self.dd.world > 1 else False
        steps, self._pending = self._pending, []
        last = None
        for done, (loss, grad_norm, code) in zip(steps, rows):
            if code == 1:
                self._skip_run += 1
                st.metrics["skipped_steps"] = st.metrics.get("skipped_steps", 0) + 1
                self.log.skipped(done, st.metrics["skipped_steps"], loss, grad_norm)
            elif code == 2:
                what = "loss" if not math.isfinite(loss) else "gradient norm"
                again = f" ({MAX_SKIPS_IN_A_ROW} skipped in a row before it)" if self._skip_run else ""
                after = f", nor any after it up to step {steps[-1]}" if steps[-1] > done else ""
                self._stop_nonfinite(done, what, f"non-finite {what} at step {done}{again}; the update "
                                     f"was not applied{after} and the run stopped")
            elif code == 3:  # only after a caller went on past the NonFiniteError of that step
                self._stop_nonfinite(done, "an earlier step", f"step {done} was not applied: the run stopped "
                                     f"at an earlier non-finite step")
            else:
                self._skip_run = 0
                last = (loss, grad_norm)
                self.log.train(done, loss, grad_norm)
        self.log.update(steps[-1], **({} if last is None else
                                      {"loss": f"{last[0]:.4f}", "bpc": f"{last[0] / math.log(2):.3f}"}))
        return stop_seen

    def _stop_nonfinite(self, step: int, what: str, why: str):
        """Raise :class:`NonFiniteError` naming the last good checkpoint (finite weights and val
        BPC), and say so in the run dir's nonfinite.json (a resume removes it)."""
        good = last_good_checkpoint(self.run_dir) if self.dd.lead else None
        where = (f"last good checkpoint: {good} (resume from it with --resume, e.g. with a "
                 f"lower --lr)" if good else "no good checkpoint was written")
        if self.dd.lead:
            atomic_write(self.run_dir / NONFINITE_FILE, json.dumps(
                {"step": step, "what": what, "skipped_in_a_row": self._skip_run,
                 "last_checkpoint": good and good.name}) + "\n")
        raise NonFiniteError(f"{self.name}: {why}; {where}")

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
            self._stop_nonfinite(self.state.step, bad, f"{bad} at step {self.state.step}, not checkpointed; "
                                 f"the run stopped")
        if self.dd.lead:
            self.log.flush()
            save_checkpoint(self.run_dir, self.state.step, sd, keep=self.tc.keep_checkpoints)

    # ------------------------------------------------------------------ a run's start and end

    def attention_path(self) -> str:
        """The path the model's attention takes in training, from a two-token probe forward in
        the training precision: "parallel path (<why>)", "torch path (<why>)", or softmax
        attention. Compiled, the graph holds the path the probe took."""
        if self.mc.position == "softmax":
            return "softmax attention (torch scaled_dot_product_attention)"
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.dd.device)
        was = self.model.training
        with record_paths() as paths, torch.no_grad(), autocast(self.dd.device, self.tc.precision):
            self.model.eval()(ids)
        self.model.train(was)
        path = "; ".join(dict.fromkeys(paths)) or "no linear attention call"
        if self.wants_compile and compile_unavailable(self.dd.device) is None:
            path += f", compiled ({self.tc.compile_mode})"
        return path

    def _open(self) -> None:
        """compile, DDP, and the run's logs (on rank 0 config.json, TensorBoard, the header lines)."""
        st, tc, dd = self.state, self.tc, self.dd
        self.attention = self.attention_path()
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
        st.metrics["val_bpc"] = self.evaluate("valid")
        self.log.val(st.step, st.metrics["val_bpc"], t)
        if last:
            st.metrics["test_bpc"] = self.evaluate("test")
        self.log.restart_clock()  # tokens/s leaves eval time out

    def _close(self) -> None:
        # drop DDP's reducer now: freed after destroy_process_group, gloo's destructor can hang
        self.net = self.model
        self.log.close()
