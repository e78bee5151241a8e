"""No host sync in a training step: the model's forward, loss, backward and clip read nothing
back from the device, and ``Trainer.train_step`` reads nothing between logging intervals, yet a
non-finite step is never applied (gated on the device) and is reported at the next interval.
The model compiles whole (``fullgraph=True``) with no graph break.

Syncs are counted with ``benchmarks.counting`` and attributed to the innermost package frame, every one
of them, on the chunk-parallel path (``LINEAR_ROPE_BACKEND=parallel``, what ``auto`` takes on
CUDA). ``LINEAR_ROPE_SYNCS_OUTSIDE=linear_rope/ops/`` leaves out those inside the op (the CPU's
torch path still checks its projection's values on every call).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import poison_training_forward
from linear_rope.enwik8.config import TrainConfig
from linear_rope.enwik8.trainer import NonFiniteError, Trainer
from linear_rope.model import MODEL_PRESETS, ModelConfig, PerformerLM
from benchmarks.counting import counted as count

pytestmark = pytest.mark.usefixtures("one_thread", "parallel_path")

OUTSIDE = os.environ.get("LINEAR_ROPE_SYNCS_OUTSIDE", "") or None


@pytest.fixture
def parallel_path(monkeypatch):
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "parallel")

# the paper preset's shape of model (every option as in paper), 2 layers at a small width
SMALL_PAPER = {**MODEL_PRESETS["paper"], "dim": 64, "depth": 2, "heads": 2, "dim_head": 32, "nb_features": 32,
               "seq_len": 64}


def syncs(c) -> int:
    return c.total(outside=OUTSIDE)


@pytest.fixture(scope="module")
def splits():
    raw = np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint8)
    return {"train": raw[:30_000], "valid": raw[30_000:35_000], "test": raw[35_000:]}


def make_trainer(splits, tmp_path, **train) -> Trainer:
    mc = ModelConfig(**{**SMALL_PAPER, "feature_redraw_interval": 0})
    tc = TrainConfig(**{"batch_size": 2, "warmup_steps": 1, "steps": 8, "log_every": 4, "precision": "bf16",
                        "out": str(tmp_path), **train})
    return Trainer("rope-seed0", mc, tc, splits)


@pytest.mark.parametrize("position", ["rope", "rope_pre", "rope_norm", "absolute", "none", "softmax"])
def test_a_model_step_reads_nothing_back(position):
    """forward (bf16 autocast), loss, backward and clip: no sync, no torch.tensor of Python data."""
    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(**{**SMALL_PAPER, "position": position}))
    x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    step()  # the first call makes what is kept (the RoPE limb tables)
    with count() as c:
        step()
    assert c.launches > 100  # the counter sees the step
    assert syncs(c) == 0, c.report()


def test_the_counter_sees_each_kind_of_sync():
    x = torch.ones(3)
    with count() as c:
        x.sum().item(), x.tolist(), bool(x.any()), torch.tensor([1.0]), x[x > 0]
    kinds = {what for (_, what) in c.sync_at}
    assert kinds >= {"item", "tolist", "bool", "torch.tensor of Python data", "index by a bool mask"}, c.report()


def test_train_step_reads_nothing_back_between_logging_intervals(splits, tmp_path):
    t = make_trainer(splits, tmp_path)
    t.train_step(0)
    with count() as c:
        for step in (1, 2):  # steps 2 and 3 of an interval of 4
            t.train_step(step)
    assert syncs(c) == 0, c.report()
    with count() as c:
        t._flush()  # the interval's one read
    assert c.total() >= 1


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_a_non_finite_step_is_not_applied_and_is_reported_at_the_next_interval(
        splits, tmp_path, monkeypatch, where):
    """NaN at step 2 (1-based) of an interval of 4, --on-nonfinite stop: steps 2, 3 and 4 leave
    every weight and AdamW moment as it was after step 1, with no read in between; the flush
    after step 4 raises, naming step 2."""
    poison_training_forward(monkeypatch, {2}, where=where)
    t = make_trainer(splits, tmp_path)
    t.train_step(0)
    before, moments = params(t.model), [s["exp_avg"].clone() for s in t.state.optimizer.state.values()]
    with count() as c:
        for step in (1, 2, 3):
            t.train_step(step)
    assert syncs(c) == 0, c.report()
    for a, b in zip(before, params(t.model)):
        assert torch.equal(a, b)
    for a, s in zip(moments, t.state.optimizer.state.values()):
        assert torch.equal(a, s["exp_avg"]) and s["step"].item() == 1
    what = "loss" if where == "loss" else "gradient norm"
    with pytest.raises(NonFiniteError, match=f"non-finite {what} at step 2; the update was not applied, nor any "
                                             f"after it up to step 4 and the run stopped"):
        t._flush()


def test_fit_stops_at_the_interval_after_a_non_finite_step(splits, tmp_path, monkeypatch):
    """NaN loss at step 6, intervals of 4: the run stops at step 8, before its checkpoint, and
    names step 6 and the checkpoint of step 4."""
    import json

    from linear_rope.enwik8.checkpoint import list_checkpoints
    from linear_rope.enwik8.trainer import NONFINITE_FILE

    poison_training_forward(monkeypatch, {6}, where="loss")
    t = make_trainer(splits, tmp_path, checkpoint_every=4, eval_every=0)
    with pytest.raises(NonFiniteError, match="non-finite loss at step 6; the update was not applied, nor any after "
                                             "it up to step 8 and the run stopped; last good checkpoint: .*ckpt-00000004"):
        t.fit()
    assert [s for s, _ in list_checkpoints(t.run_dir)] == [4]
    assert json.loads((t.run_dir / NONFINITE_FILE).read_text())["step"] == 6


def test_skip_skips_on_the_device_and_logs_at_the_interval(splits, tmp_path, monkeypatch, capsys):
    """--on-nonfinite skip: steps 2 and 3 are not applied, step 4 is; the interval's flush logs
    both skips and counts them."""
    poison_training_forward(monkeypatch, {2, 3})
    t = make_trainer(splits, tmp_path, on_nonfinite="skip")
    snaps = []
    for step in range(4):
        t.train_step(step)
        snaps.append(params(t.model))
    same = [all(torch.equal(a, b) for a, b in zip(snaps[i], snaps[i + 1])) for i in range(3)]
    assert same == [True, True, False]
    assert "skipped_steps" not in t.state.metrics  # nothing read yet
    t._flush()
    assert t.state.metrics["skipped_steps"] == 2 and t.ledger.skip_run == 0


def test_skip_still_stops_after_max_skips_in_a_row(splits, tmp_path, monkeypatch):
    from linear_rope.enwik8 import ledger

    monkeypatch.setattr(ledger, "MAX_SKIPS_IN_A_ROW", 2)
    poison_training_forward(monkeypatch, set(range(2, 20)))
    t = make_trainer(splits, tmp_path, on_nonfinite="skip")
    for step in range(4):
        t.train_step(step)
    with pytest.raises(NonFiniteError, match=r"at step 4 \(2 skipped in a row before it\)"):
        t._flush()


def test_out_of_range_ids_give_nan_logits_or_with_checks_a_value_error(monkeypatch):
    model = PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "vocab_size": 10})).eval()
    ids = torch.tensor([[1, 12, 3]])
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    model(ids[:, :1])  # makes what is kept (the RoPE limb tables)
    with count() as c:
        logits = model(ids)
    assert syncs(c) == 0, c.report()
    assert torch.isnan(logits[0, 1]).all()  # (a chunk's matmuls may carry the NaN to its neighbours)
    monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
    with pytest.raises(ValueError, match=r"ids: 1 id\(s\) outside \[0, vocab_size=10\): 12$"):
        model(ids)


def test_the_model_compiles_whole_forward_and_backward():
    """A 2-layer copy of the paper preset: one graph (fullgraph=True), no graph break, forward
    and backward (AOT autograd traces the joint graph), and no opaque ``linear_rope`` custom op
    in either graph: the compiler sees the attention's own ops."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(**SMALL_PAPER))
    x = torch.randint(0, 256, (2, 64))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(x).float().logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert any("bmm" in s for s in seen) and not [s for s in seen if "linear_rope" in s], seen
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiles_the_model_forward_and_backward():
    """Inductor on the CPU compiles a 2-layer copy of the paper preset whole (fullgraph=True),
    forward and backward, and the loss and gradients are eager's."""
    import torch._dynamo

    torch.manual_seed(0)
    model = PerformerLM(ModelConfig(**{**SMALL_PAPER, "feature_redraw_interval": 0}))
    x = torch.randint(0, 256, (2, 64))

    def loss_and_grads(m):
        model.zero_grad()
        loss = m(x).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_g = loss_and_grads(model)
    torch._dynamo.reset()
    got, got_g = loss_and_grads(torch.compile(model, fullgraph=True))
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_steps_after_a_stop_stay_unapplied_if_the_caller_goes_on(splits, tmp_path, monkeypatch):
    poison_training_forward(monkeypatch, {2}, where="loss")
    t = make_trainer(splits, tmp_path)
    t.train_step(0)
    t.train_step(1)
    with pytest.raises(NonFiniteError, match="at step 2"):
        t._flush()
    before = params(t.model)
    t.train_step(2)  # a finite step, after the run stopped: still not applied, and said so
    assert all(torch.equal(a, b) for a, b in zip(before, params(t.model)))
    with pytest.raises(NonFiniteError, match="step 3 was not applied: the run stopped at an earlier non-finite step"):
        t._flush()
