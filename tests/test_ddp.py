"""DDP through torchrun on CPU (gloo, 2 processes): identical ranks, batch equivalence, resume.

Launched as ``python -m torch.distributed.run`` (what the ``torchrun`` script runs), so the test
does not depend on the venv's bin directory being on PATH.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linear_rope.enwik8 import data, trainer
from linear_rope.enwik8.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from linear_rope.enwik8.sample import load_model
from helpers import ENV, ROOT, losses, past_the_event_files_second, run_main, wait_for

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
STEPS = 120

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not torch.distributed.is_available() or not Path("/proc").is_dir(),
                                 reason="needs torch.distributed and /proc")]


def argv(corpus: Path, tmp: Path, out: str, batch: int, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--variants", "rope", "--steps", str(STEPS), "--batch-size",
            str(batch), "--feature-redraw-interval", "50", "--log-every", "1",
            "--eval-every", "60", "--eval-batch-size", "64", "--deterministic", "--threads", "1",
            "--data", str(corpus), "--data-dir", str(tmp / "data"), "--out", str(tmp / out), *extra]


# The trainer as train_enwik8.py runs it, except that at every checkpoint each rank also saves
# the model it holds (parameters and buffers) to $RANK_DUMP: the ranks are then compared from
# files, not from the digests the trainer itself computes and checks.
DUMPING = """
import os, sys, torch
from linear_rope.enwik8 import train, trainer
save = trainer.Trainer.save
def save_and_dump(self):
    save(self)
    name = f"rank{self.dd.rank}-step{self.state.step}.pt"
    torch.save(self.model.state_dict(), os.path.join(os.environ["RANK_DUMP"], name))
trainer.Trainer.save = save_and_dump
sys.exit(train.main(prog="train_enwik8.py"))
"""


def torchrun(args: list[str], dump: Path | None = None, **kw) -> subprocess.Popen:
    script = [str(ROOT / "train_enwik8.py")]
    env = ENV
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "dumping.py").write_text(DUMPING)
        script, env = [str(dump / "dumping.py")], {**ENV, "RANK_DUMP": str(dump)}
    return subprocess.Popen(TORCHRUN + [*script, *args], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **kw)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def launch(tmp: Path, args: list[str]):
    proc = torchrun(args, dump=tmp / "ranks")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return tmp, tmp / "ddp" / "rope-seed0", out, err


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, corpus):
    """The reference 2-rank run: per-rank batch 2, checkpoints at 60 and 120, no dropout
    (each rank draws its own dropout masks, so only a dropout-free run can match 1 rank)."""
    tmp = tmp_path_factory.mktemp("ddp")
    return launch(tmp, argv(corpus, tmp, "ddp", 2))


@pytest.fixture(scope="module")
def two_ranks_dropout(tmp_path_factory, corpus):
    """As two_ranks with dropout 0.1: resume must restore every rank's dropout stream."""
    tmp = tmp_path_factory.mktemp("ddp_dropout")
    return launch(tmp, argv(corpus, tmp, "ddp", 2, "--dropout", "0.1"))


def test_ranks_hold_bitwise_identical_parameters_and_buffers(two_ranks):
    """Each rank's own model file at every checkpoint: every parameter and buffer (the FAVOR+
    projections, redrawn at step 50) equal bit for bit across ranks and to the checkpoint."""
    tmp, run_dir, out, err = two_ranks
    ckpts = list_checkpoints(run_dir)
    assert [s for s, _ in ckpts] == [60, 120]
    for step, path in ckpts:
        ckpt = load_checkpoint(path)
        assert ckpt["world"] == 2
        ranks = [torch.load(tmp / "ranks" / f"rank{r}-step{step}.pt", weights_only=True) for r in (0, 1)]
        assert set(ranks[0]) == set(ranks[1]) == set(ckpt["model"])
        assert any("projection" in k for k in ranks[0])  # the buffers are in it
        for k, t in ckpt["model"].items():
            assert torch.equal(ranks[0][k], ranks[1][k]) and torch.equal(ranks[0][k], t), (step, k)
    assert "ranks 2, global batch 4" in err
    # only rank 0 writes: every event file is one process's (the name holds its pid)
    assert len({p.name.split(".")[4] for p in run_dir.glob("events.out.tfevents.*")}) == 1
    assert out.count("rope-seed0") == 1


def test_two_ranks_of_b_match_one_rank_of_2b(two_ranks, corpus, tmp_path):
    """Same global batches (one global draw, sliced per rank): same run to fp32 tolerance."""
    _, run_dir, _, _ = two_ranks
    ref = losses(run_dir)
    for name, batch, extra in (("single", 4, ()), ("accum", 2, ("--grad-accum", "2"))):
        code, _, err = run_main(argv(corpus, tmp_path, name, batch, *extra))
        assert code == 0, err
        got = losses(tmp_path / name / "rope-seed0")
        assert [s for s, _ in got] == [s for s, _ in ref]
        torch.testing.assert_close(torch.tensor([v for _, v in got]),
                                   torch.tensor([v for _, v in ref]), rtol=2e-5, atol=0, msg=name)
        a = load_checkpoint(latest_checkpoint(run_dir))
        b = load_checkpoint(latest_checkpoint(tmp_path / name / "rope-seed0"))
        for k in a["model"]:
            torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-4, atol=1e-5, msg=k)
        assert b["metrics"]["val_bpc"] == pytest.approx(a["metrics"]["val_bpc"], rel=1e-5)


def test_distributed_bpc_sums_over_ranks(two_ranks):
    """The 2-rank val BPC (nats and bytes all-reduced) equals a 1-process eval of its weights."""
    tmp, run_dir, _, _ = two_ranks
    ckpt = load_checkpoint(latest_checkpoint(run_dir))
    model = load_model(run_dir)
    paths = data.prepare_corpus(ckpt["config"]["train"]["data"], tmp / "data")
    bpc = trainer.evaluate(model, data.load_split(paths["valid"]), model.cfg.seq_len, 64)
    assert bpc == pytest.approx(ckpt["metrics"]["val_bpc"], rel=1e-6)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_run_stopped_midway_resumes_under_torchrun(two_ranks_dropout, corpus, tmp_path, how):
    """kill -9 of the whole launch (pre-emption), or SIGTERM to torchrun (which forwards it to
    the workers: they checkpoint at the same step and exit 0); then resume with torchrun and
    end with exactly the uninterrupted run's losses."""
    _, ref_dir, _, _ = two_ranks_dropout
    run_dir = tmp_path / "ddp" / "rope-seed0"
    args = argv(corpus, tmp_path, "ddp", 2, "--dropout", "0.1", "--checkpoint-every", "1")
    proc = torchrun(args)
    wait_for(lambda: (list_checkpoints(run_dir) or [(0, None)])[-1][0] >= 20, proc, timeout=240)
    if how == "SIGKILL":  # the machine is pre-empted: every process dies at once
        for pid in [proc.pid, *descendants(proc.pid)]:
            os.kill(pid, signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    step = load_checkpoint(latest_checkpoint(run_dir))["step"]
    assert 20 <= step < STEPS, "the run ended before it was stopped"
    if how == "SIGTERM":
        assert "received SIGTERM" in err and f"stopped by SIGTERM at step {step}" in err
        assert "torchrun --standalone --nproc_per_node=2" in err and "--resume" in err
    past_the_event_files_second(run_dir)
    proc = torchrun(args + ["--resume"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert losses(run_dir) == losses(ref_dir)
    a, b = load_checkpoint(latest_checkpoint(ref_dir)), load_checkpoint(latest_checkpoint(run_dir))
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_resume_with_another_world_size_is_refused(two_ranks, corpus, tmp_path):
    tmp, run_dir, _, _ = two_ranks
    code, _, err = run_main(argv(corpus, tmp, "ddp", 2, "--steps", str(STEPS + 10), "--resume"))
    assert code == 2 and "ranks: checkpoint 2, now 1" in err
