"""Long-run reliability: exact resume, signals, kill -9, non-finite steps, checkpoint safety.

Training runs here use the ``tiny`` preset on a 64 KB cut of the shared sample, one thread, and
``--deterministic``. Runs that must be killed run as subprocesses; the rest run in-process.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (ENV, ROOT, SHIM, latest_step, losses, past_the_event_files_second, poison_training_forward,
                     raw_losses, run_main, wait_for)
from linear_rope.enwik8 import checkpoint, trainer
from linear_rope.enwik8.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def common(corpus: Path, tmp: Path, steps: int, *extra: str) -> list[str]:
    """Dropout and redraws on, so resume must restore the torch RNG and the feature generator."""
    return ["--preset", "tiny", "--variants", "rope", "--steps", str(steps), "--decay-steps", "40",
            "--dropout", "0.1", "--feature-redraw-interval", "5", "--log-every", "1",
            "--eval-every", "0", "--eval-batch-size", "512", "--deterministic", "--threads", "1",
            "--data", str(corpus), "--data-dir", str(tmp / "data"), *extra]


def final_state(run_dir: Path) -> dict:
    return load_checkpoint(latest_checkpoint(run_dir))


def assert_same_run(a: Path, b: Path, steps: int) -> None:
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == list(range(1, steps + 1))
    assert lb == la  # every logged value equal, not close
    ca, cb = final_state(a), final_state(b)
    assert ca["step"] == cb["step"] == steps
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    for k in ("torch", "data", "features"):
        assert torch.equal(ca["rng"][k], cb["rng"][k]), k


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus) -> Path:
    """The uninterrupted 16-step run every interrupted run is compared with."""
    tmp = tmp_path_factory.mktemp("straight")
    code, _, err = run_main(common(corpus, tmp, 16, "--out", str(tmp / "runs")))
    assert code == 0, err
    return tmp / "runs" / "rope-seed0"


def test_resume_is_exact(tmp_path, corpus, straight):
    """Stop at 7 (another --steps), resume to 16: the same losses, weights and RNG states."""
    out = ["--out", str(tmp_path / "runs")]
    assert run_main(common(corpus, tmp_path, 7, *out))[0] == 0
    past_the_event_files_second(tmp_path / "runs" / "rope-seed0")
    assert run_main(common(corpus, tmp_path, 16, *out, "--resume"))[0] == 0
    run_dir = tmp_path / "runs" / "rope-seed0"
    assert_same_run(straight, run_dir, 16)
    # no step is written twice or skipped, even in the raw event files
    assert [s for s, _ in raw_losses(run_dir)] == list(range(1, 17))


def test_checkpoint_retention_and_no_temp_files(tmp_path, corpus):
    code, _, err = run_main(common(corpus, tmp_path, 6, "--out", str(tmp_path / "runs"),
                                   "--checkpoint-every", "1", "--keep-checkpoints", "2"))
    assert code == 0, err
    run_dir = tmp_path / "runs" / "rope-seed0"
    assert [s for s, _ in list_checkpoints(run_dir)] == [5, 6]
    assert not list(run_dir.glob(".*tmp"))


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(SHIM + argv, cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_checkpoints_the_current_step_and_exits_0(tmp_path, corpus, straight, sig):
    """The signal arrives mid-run; the checkpoint is at the step it ended; resume is exact.

    No race: the signal goes once step 2's checkpoint (and, flushed before it, its events) is on
    disk, and the run has 1000 steps, so it is always mid-run; it is resumed to step 16."""
    run_dir = tmp_path / "runs" / "rope-seed0"
    proc = _spawn(common(corpus, tmp_path, 1000, "--out", str(tmp_path / "runs"), "--checkpoint-every", "1"))
    wait_for(lambda: latest_step(run_dir) >= 2, proc)
    assert max(s for s, _ in raw_losses(run_dir)) >= 2  # flushed with the checkpoint
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"received {sig.name}" in err and "resume with:" in err
    step = load_checkpoint(latest_checkpoint(run_dir))["step"]
    assert 2 <= step < 16 and f"at step {step}" in err
    assert max(s for s, _ in raw_losses(run_dir)) == step  # stopped right after the checkpoint
    # the printed command resumes it (to the reference run's 16 steps)
    command = shlex.split(err.split("resume with:")[1].strip().splitlines()[0])
    assert command[:2] == ["python", "train_enwik8.py"] and command[-1] == "--resume"
    past_the_event_files_second(run_dir)
    code, _, err = run_main(command[2:] + ["--steps", "16"])
    assert code == 0, err
    assert_same_run(straight, run_dir, 16)


def _stopped_inside_a_write(proc: subprocess.Popen, run_dir: Path) -> bool:
    """SIGSTOP the run when a temporary checkpoint file exists; True if one still exists once it
    is stopped (the kill then lands inside the write), else SIGCONT and False."""
    if not any(run_dir.glob(".ckpt-*.tmp")):
        return False
    os.killpg(proc.pid, signal.SIGSTOP)
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] not in "TtZ":  # until it has stopped
        time.sleep(0.001)
    if any(run_dir.glob(".ckpt-*.tmp")):
        return True
    os.killpg(proc.pid, signal.SIGCONT)
    return False


def test_kill_9_at_random_moments_always_leaves_a_loadable_checkpoint(tmp_path, corpus):
    """SIGKILL six times (four just after a checkpoint landed, two inside a checkpoint write),
    then finish.

    A checkpoint is written after every step, and the model is widened (12 MB checkpoints). The
    moments are observed, not slept for: a new checkpoint on disk, or a temporary checkpoint
    file seen while the run is stopped (SIGSTOP), so every kill lands where it should on a busy
    machine too. After each kill the newest checkpoint must load, and the run, resumed each
    time, must end with exactly the losses and weights of an uninterrupted run.
    """
    steps, wide = 150, ["--dim", "256"]
    code, _, err = run_main(common(corpus, tmp_path, steps, *wide, "--out", str(tmp_path / "ref")))
    assert code == 0, err
    run_dir = tmp_path / "runs" / "rope-seed0"
    argv = common(corpus, tmp_path, steps, *wide, "--out", str(tmp_path / "runs"),
                  "--checkpoint-every", "1")
    in_write, kills = 0, []
    for trial in range(6):
        proc = _spawn(argv + (["--resume"] if trial else []))
        before = latest_step(run_dir)
        if trial < 4:  # 1 to 4 checkpoints after the resume: the kill falls in the step after it
            wait_for(lambda: latest_step(run_dir) >= before + 1 + trial, proc)
        else:  # while a temporary checkpoint file is being written
            wait_for(lambda: latest_step(run_dir) > before, proc)
            wait_for(lambda: _stopped_inside_a_write(proc, run_dir), proc, poll=0.0002)
        os.killpg(proc.pid, signal.SIGKILL)
        in_write += trial >= 4 and any(run_dir.glob(".ckpt-*.tmp"))
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL, "the run ended before the kill; make it longer"
        latest = latest_checkpoint(run_dir)
        ckpt = load_checkpoint(latest)  # must load
        assert ckpt["step"] == int(latest.stem.split("-")[1])
        kills.append(ckpt["step"])
    assert kills == sorted(kills) and kills[-1] < steps, kills
    assert in_write == 2, "a kill meant for a checkpoint write missed it"
    past_the_event_files_second(run_dir)
    code, _, err = run_main(argv + ["--resume"])
    assert code == 0, err
    assert not list(run_dir.glob(".*tmp"))
    assert_same_run(tmp_path / "ref" / "rope-seed0", run_dir, steps)
    print(f"killed at steps {kills}; {in_write} of the last two kills inside a write")


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_non_finite_stops_at_that_step_and_names_the_last_good_checkpoint(
        tmp_path, corpus, monkeypatch, where):
    """NaN logits (so a NaN loss) or a NaN gradient only, injected at step 5."""
    poison_training_forward(monkeypatch, {5}, where=where)
    run_dir = tmp_path / "runs" / "rope-seed0"
    code, _, err = run_main(common(corpus, tmp_path, 10, "--out", str(tmp_path / "runs"),
                                   "--checkpoint-every", "2"))
    assert code == trainer.EXIT_NONFINITE
    lines = err.strip().splitlines()
    assert "Traceback" not in err and "error:" in lines[-1]
    assert f"non-finite {'loss' if where == 'loss' else 'gradient norm'} at step 5" in lines[-1]
    assert "ckpt-00000004.pt" in lines[-1]
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 4]  # nothing saved after the NaN
    ended = json.loads((run_dir / trainer.NONFINITE_FILE).read_text())
    assert ended["step"] == 5 and ended["last_checkpoint"] == "ckpt-00000004.pt"
    assert max(s for s, _ in raw_losses(run_dir)) == 4
    ckpt = load_checkpoint(latest_checkpoint(run_dir))
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_on_nonfinite_skip_skips_those_updates_and_logs_them(tmp_path, corpus, monkeypatch):
    """NaN gradients at steps 5 and 6: with --on-nonfinite skip the weights do not move at those
    steps, the run goes on to the end, and the count is in the metrics and TensorBoard; 20 in a
    row still stop it."""
    poison = poison_training_forward(monkeypatch, {5, 6})
    out = tmp_path / "runs"
    code, _, err = run_main(common(corpus, tmp_path, 10, "--out", str(out), "--checkpoint-every", "1",
                                   "--keep-checkpoints", "20", "--on-nonfinite", "skip"))
    assert code == 0, err
    assert "step 5: non-finite gradient norm (nan), update skipped (1 so far)" in err
    weights = {s: load_checkpoint(p)["model"] for s, p in list_checkpoints(out / "rope-seed0")}
    for a, b, same in ((4, 5, True), (5, 6, True), (6, 7, False), (3, 4, False)):
        params = [k for k in weights[a] if "projection" not in k]  # FAVOR+ redraws move the buffers
        assert all(torch.equal(weights[a][k], weights[b][k]) for k in params) == same, (a, b)
    ckpt = load_checkpoint(latest_checkpoint(out / "rope-seed0"))
    assert ckpt["step"] == 10 and ckpt["metrics"]["skipped_steps"] == 2
    assert 5 not in {s for s, _ in raw_losses(out / "rope-seed0")}  # no NaN in the curves

    poison.update(n=0, calls=set(range(3, 40)))
    code, _, err = run_main(common(corpus, tmp_path, 30, "--out", str(tmp_path / "r2"), "--on-nonfinite", "skip"))
    assert code == trainer.EXIT_NONFINITE and "at step 23 (20 skipped in a row before it)" in err


class Exploit:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for any code execution."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_that_runs_code_is_refused(tmp_path, corpus):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "runs" / "rope-seed0"
    run_dir.mkdir(parents=True)
    evil = checkpoint.checkpoint_path(run_dir, 3)
    torch.save({"model": {"w": torch.zeros(1)}, "step": 3, "config": Exploit(marker)}, evil)

    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(evil)
    # resuming a run whose newest checkpoint is the exploit
    code, _, err = run_main(common(corpus, tmp_path, 6, "--out", str(tmp_path / "runs"), "--resume"))
    assert code == 2 and "refusing to load" in err and len(err.strip().splitlines()) == 1
    # sampling from it, as a process
    proc = subprocess.run([sys.executable, "-m", "linear_rope.sample", str(run_dir)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "refusing to load" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists()  # the code never ran
    assert evil.exists()  # and the file is left for inspection


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt-00000001.pt"
    torch.save({"model": {"w": torch.zeros(1000)}, "step": 1, "config": {}}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="corrupt, truncated"):
        load_checkpoint(path)


def test_resume_from_a_version_0_1_checkpoint(tmp_path, corpus):
    """linear_rope 0.1 wrote one checkpoint.pt, a per-rank list of data states, fewer fields."""
    argv = common(corpus, tmp_path, 4, "--out", str(tmp_path / "runs"))
    assert run_main(argv)[0] == 0
    run_dir = tmp_path / "runs" / "rope-seed0"
    path = latest_checkpoint(run_dir)
    ckpt = load_checkpoint(path)
    ckpt["rng"]["data"] = [ckpt["rng"]["data"]]
    for k in ("grad_accum", "checkpoint_every", "keep_checkpoints", "deterministic"):
        del ckpt["config"]["train"][k]
    del ckpt["world"], ckpt["param_sha256"], ckpt["content_sha256"], ckpt["config"]["corpus"]
    torch.save(ckpt, run_dir / "checkpoint.pt")
    path.unlink()
    code, _, err = run_main(common(corpus, tmp_path, 6, "--out", str(tmp_path / "runs"), "--resume"))
    assert code == 0, err
    assert load_checkpoint(latest_checkpoint(run_dir))["step"] == 6
