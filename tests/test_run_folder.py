"""Nothing lost or mixed in a run folder: one writer (the lock), checkpoints verified on load, a
resume only on the corpus the run started on, no non-finite checkpoint kept or named as the last
good one, ``--overwrite`` deleting only what a run wrote, seeds deduplicated as numbers.

Training runs use the ``tiny`` preset on the 64 KB corpus (conftest.py), in-process, one thread;
the lock test runs its holder as a process.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from helpers import ENV, ROOT, latest_step, run_main, wait_for
from linear_rope.enwik8 import checkpoint, sample
from linear_rope.enwik8.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from linear_rope.enwik8.cli import build_parser, parse_runs

pytestmark = pytest.mark.usefixtures("one_thread")


def argv(corpus, tmp, out, steps: int, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--variants", "rope", "--steps", str(steps), "--eval-every", "0",
            "--eval-batch-size", "512", "--threads", "1", "--data", str(corpus),
            "--data-dir", str(tmp / "data"), "--out", str(out), *extra]


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


def flip_a_byte_of(path, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of ``tensor``'s bytes where the checkpoint file stores them."""
    raw = path.read_bytes()
    want = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = raw.find(want)
    assert at >= 0 and raw.find(want, at + 1) < 0
    i = at + len(want) // 2
    path.write_bytes(raw[:i] + bytes([raw[i] ^ 1]) + raw[i + 1:])


# ------------------------------------------------------------------ one writer per run folder


def test_a_second_run_exits_2_naming_the_holder_and_a_stale_lock_is_taken_over(tmp_path, corpus):
    out = tmp_path / "runs"
    run_dir, lock = out / "rope-seed0", out / ".rope-seed0.lock"
    holder = subprocess.Popen([sys.executable, "-m", "linear_rope.train",
                               *argv(corpus, tmp_path, out, 1000, "--checkpoint-every", "1")], cwd=ROOT,
                              env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        wait_for(lambda: latest_step(run_dir) >= 1, holder)
        # --resume passes every other check: only the lock stands between the two runs
        code, out_, err = run_main(argv(corpus, tmp_path, out, 3, "--resume"))
        assert code == 2 and out_ == ""
        line = one_error_line(err)
        assert f"{run_dir} is in use by another run (pid {holder.pid} on {socket.gethostname()}, started " in line
        assert holder.poll() is None  # the holder trains on
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # dies holding the lock: its file stays behind
        holder.communicate()
    assert json.loads(lock.read_text())["pid"] == holder.pid
    step = latest_step(run_dir)
    code, _, err = run_main(argv(corpus, tmp_path, out, step + 1, "--resume"))
    assert code == 0, err
    assert f"took over the stale lock of {run_dir}: its holder (pid {holder.pid} on " in err
    assert latest_step(run_dir) == step + 1
    assert not lock.exists()  # released at the end


def test_runs_of_other_names_may_share_the_folder(tmp_path, corpus):
    """Two variants side by side in one --out (each its own process) is how long ablations run."""
    from linear_rope.enwik8.rundir import RunLocks

    with RunLocks(tmp_path / "runs", ["none-seed0"]) as held:
        held.acquire()
        code, _, err = run_main(argv(corpus, tmp_path, tmp_path / "runs", 1))
        assert code == 0, err
        code, _, err = run_main(argv(corpus, tmp_path, tmp_path / "runs", 1, "--variants", "rope,none",
                                     "--overwrite"))
        assert code == 2 and "none-seed0 is in use by another run (pid " in one_error_line(err)
    assert not (tmp_path / "runs" / ".none-seed0.lock").exists()


# ------------------------------------------------------------------ checkpoints verified on load


@pytest.fixture
def two_checkpoints(tmp_path, corpus):
    out = tmp_path / "runs"
    code, _, err = run_main(argv(corpus, tmp_path, out, 2, "--checkpoint-every", "1"))
    assert code == 0, err
    return out / "rope-seed0"


def _refused_on_resume_and_sample(tmp_path, corpus, run_dir, capsys, why: str) -> None:
    newest = latest_checkpoint(run_dir)
    before = newest.read_bytes()
    code, _, err = run_main(argv(corpus, tmp_path, run_dir.parent, 4, "--resume"))
    assert code == 2
    line = one_error_line(err)
    assert f"{newest} is corrupt: {why}" in line and "move it away to resume from ckpt-00000001.pt" in line
    with pytest.raises(SystemExit) as exc:
        sample.main([str(run_dir), "--prompt", "ab", "--max-new-tokens", "2"])
    assert exc.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{newest} is corrupt" in line and f"the previous checkpoint is {run_dir / 'ckpt-00000001.pt'}" in line
    assert newest.read_bytes() == before and latest_step(run_dir) == 2  # left as it was, nothing written
    newest.rename(run_dir / "corrupt.pt.bak")  # the way out the message offers
    code, _, err = run_main(argv(corpus, tmp_path, run_dir.parent, 2, "--resume"))
    assert code == 0, err


def test_a_flipped_byte_in_the_weights_is_refused(tmp_path, corpus, two_checkpoints, capsys):
    run_dir = two_checkpoints
    ckpt = load_checkpoint(latest_checkpoint(run_dir))
    flip_a_byte_of(latest_checkpoint(run_dir), ckpt["model"]["tok_emb.weight"])
    _refused_on_resume_and_sample(tmp_path, corpus, run_dir, capsys, "its content does not match")


def test_a_flipped_byte_in_the_optimizer_state_is_refused(tmp_path, corpus, two_checkpoints, capsys):
    """The weights' digest (param_sha256) does not cover the Adam moments; content_sha256 does."""
    run_dir = two_checkpoints
    ckpt = load_checkpoint(latest_checkpoint(run_dir))
    flip_a_byte_of(latest_checkpoint(run_dir), ckpt["optimizer"]["state"][0]["exp_avg"])
    _refused_on_resume_and_sample(tmp_path, corpus, run_dir, capsys, "its content does not match")


def test_changed_weights_in_a_checkpoint_without_content_digest_fail_param_sha256(
        tmp_path, corpus, two_checkpoints, capsys):
    """A checkpoint written before content_sha256 existed still has param_sha256 to check."""
    run_dir = two_checkpoints
    path = latest_checkpoint(run_dir)
    ckpt = load_checkpoint(path)
    ckpt.pop("content_sha256", None)  # as written before content digests
    ckpt["model"]["head.weight"][3, 5] += 1e-3
    torch.save(ckpt, path)
    _refused_on_resume_and_sample(tmp_path, corpus, run_dir, capsys,
                                  "its weights do not match the param_sha256 stored in it")


# ------------------------------------------------------------------ the corpus of a resume


def test_resume_on_another_corpus_is_refused_and_the_history_is_kept(tmp_path, corpus):
    out = tmp_path / "runs"
    run_dir = out / "rope-seed0"
    assert run_main(argv(corpus, tmp_path, out, 2))[0] == 0
    other = tmp_path / "other.txt"
    other.write_bytes(corpus.read_bytes()[::-1])
    code, _, err = run_main(argv(other, tmp_path, out, 4, "--resume"))
    assert code == 2
    line = one_error_line(err)
    assert "--data is another corpus" in line and f"from --data {corpus}" in line
    assert latest_step(run_dir) == 2
    # the same bytes under another name are the same corpus
    copy = tmp_path / "moved" / "corpus.txt"
    copy.parent.mkdir()
    copy.write_bytes(corpus.read_bytes())
    code, _, err = run_main(argv(copy, tmp_path, out, 4, "--resume"))
    assert code == 0, err
    saved = json.loads((run_dir / "config.json").read_text())
    assert [(h["from_step"], h["train"]["data"], h["train"]["steps"]) for h in saved["history"]] == \
        [(0, str(corpus), 2), (2, str(copy), 4)]
    assert saved["train"]["data"] == str(copy) and saved["corpus"] == saved["history"][0]["corpus"]
    assert load_checkpoint(latest_checkpoint(run_dir))["config"]["corpus"] == saved["corpus"]


# ------------------------------------------------------------------ non-finite: never the last good


def nan_update_at(monkeypatch, steps: set[int]) -> None:
    """What ``--grad-clip nan`` did: the gradient norm is finite, the clipped gradients are NaN,
    so the update makes the weights NaN and no loss or norm check sees it."""
    clip, calls = torch.nn.utils.clip_grad_norm_, {"n": 0}

    def poisoned(params, max_norm, *a, **kw):
        params = list(params)
        norm = clip(params, max_norm, *a, **kw)
        calls["n"] += 1
        if calls["n"] in steps:
            for p in params:
                p.grad.fill_(float("nan"))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)


def finite(path) -> bool:
    ckpt = load_checkpoint(path)
    val = ckpt["metrics"]["val_bpc"]
    return all(bool(torch.isfinite(t).all()) for t in ckpt["model"].values()) and (val is None or val == val)


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_non_finite_weights_are_never_checkpointed_or_named_last_good(tmp_path, corpus, monkeypatch, mode):
    nan_update_at(monkeypatch, {3})
    out = tmp_path / "runs"
    code, _, err = run_main(argv(corpus, tmp_path, out, 8, "--eval-every", "1", "--keep-checkpoints", "3",
                                 "--on-nonfinite", mode))
    assert code == 3
    line = err.strip().splitlines()[-1]
    assert "non-finite weights" in line and "at step 3, not checkpointed" in line
    assert f"last good checkpoint: {out / 'rope-seed0' / 'ckpt-00000002.pt'}" in line
    found = list_checkpoints(out / "rope-seed0")
    assert [s for s, _ in found] == [1, 2] and all(finite(p) for _, p in found)
    ended = json.loads((out / "rope-seed0" / "nonfinite.json").read_text())
    assert ended["step"] == 3 and ended["last_checkpoint"] == "ckpt-00000002.pt"


def test_last_good_checkpoint_passes_over_non_finite_ones(tmp_path):
    """Checkpoints written before this check existed may hold NaN: they are never named."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step, w, val in ((1, 1.0, 3.0), (2, float("nan"), float("nan")), (3, 1.0, float("nan"))):
        checkpoint.save_checkpoint(run_dir, step, {"model": {"w": torch.full((2,), w)}, "step": step, "config": {},
                                                   "metrics": {"val_bpc": val}}, keep=5)
    assert checkpoint.last_good_checkpoint(run_dir) == checkpoint.checkpoint_path(run_dir, 1)


# ------------------------------------------------------------------ --overwrite


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path, corpus):
    out = tmp_path / "runs"
    run_dir = out / "rope-seed0"
    assert run_main(argv(corpus, tmp_path, out, 2, "--checkpoint-every", "1"))[0] == 0
    (run_dir / "notes.txt").write_text("lr 1e-3 looked unstable")
    (run_dir / "plots").mkdir()
    (run_dir / "plots" / "loss.png").write_bytes(b"png")
    code, _, err = run_main(argv(corpus, tmp_path, out, 1, "--overwrite"))
    assert code == 0, err
    assert "rope-seed0: --overwrite kept what a run does not write: notes.txt, plots" in err
    assert (run_dir / "notes.txt").read_text() == "lr 1e-3 looked unstable"
    assert (run_dir / "plots" / "loss.png").read_bytes() == b"png"
    assert [s for s, _ in list_checkpoints(run_dir)] == [1]  # the old ckpt-2 is gone
    assert len(json.loads((run_dir / "config.json").read_text())["history"]) == 1


def test_overwrite_refuses_a_symlinked_run_folder(tmp_path, corpus):
    out = tmp_path / "runs"
    assert run_main(argv(corpus, tmp_path, tmp_path / "elsewhere", 1))[0] == 0
    out.mkdir()
    (out / "rope-seed0").symlink_to(tmp_path / "elsewhere" / "rope-seed0", target_is_directory=True)
    before = sorted(p.name for p in (tmp_path / "elsewhere" / "rope-seed0").iterdir())
    code, _, err = run_main(argv(corpus, tmp_path, out, 1, "--overwrite"))
    assert code == 2 and "is a symbolic link" in one_error_line(err)
    assert sorted(p.name for p in (tmp_path / "elsewhere" / "rope-seed0").iterdir()) == before


# ------------------------------------------------------------------ seeds, a full disk


def test_seeds_are_deduplicated_as_numbers():
    _, runs = parse_runs(build_parser(), ["--preset", "tiny", "--variants", "rope", "--seeds", "1,01, 1,2"])
    assert [name for name, _, _ in runs] == ["rope-seed1", "rope-seed2"]


def test_a_full_disk_is_one_line_and_loses_no_checkpoint(tmp_path, corpus, monkeypatch):
    real = checkpoint.atomic_write

    def full_disk(path, content):
        if path.name == "ckpt-00000003.pt":  # the write starts, then the disk is full
            def partial(f):
                f.write(b"\0" * 1000)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(path, partial)
        return real(path, content)

    monkeypatch.setattr(checkpoint, "atomic_write", full_disk)
    out = tmp_path / "runs"
    code, _, err = run_main(argv(corpus, tmp_path, out, 5, "--checkpoint-every", "1"))
    assert code == 2
    line = one_error_line(err.strip().splitlines()[-1])
    assert "No space left on device" in line and "ckpt-00000003.pt" in line and "--resume" in line
    run_dir = out / "rope-seed0"
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 2] and not list(run_dir.glob(".*tmp"))
    assert load_checkpoint(latest_checkpoint(run_dir))["step"] == 2
    assert not (out / ".rope-seed0.lock").exists()


def test_out_of_memory_is_one_line_and_loses_no_checkpoint(tmp_path, corpus, monkeypatch):
    """What --batch-size 1000000000 did below the cap: numpy's MemoryError as a traceback."""
    from linear_rope.enwik8 import data

    crops, calls = data.crops, {"n": 0}

    def crops_then_no_memory(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("Unable to allocate 246. GiB for an array with shape (1000000000, 33)")
        return crops(*args, **kwargs)

    monkeypatch.setattr(data, "crops", crops_then_no_memory)
    out = tmp_path / "runs"
    code, _, err = run_main(argv(corpus, tmp_path, out, 5, "--checkpoint-every", "1"))
    assert code == 2
    line = one_error_line(err.strip().splitlines()[-1])
    assert "out of memory (Unable to allocate 246. GiB" in line and "lower --batch-size" in line
    assert [s for s, _ in list_checkpoints(out / "rope-seed0")] == [1, 2]


# ------------------------------------------------------------------ --resume with nothing to resume

def test_resume_with_nothing_to_resume_says_so_and_trains(tmp_path, corpus):
    """--resume where --out holds no checkpoint (a typo in --out, or "resume or start" in a
    script) says so in one line, naming what it looked for, then trains from step 0 (exit 0);
    where some runs have a checkpoint, the line names only the others."""
    out = tmp_path / "typo"
    code, stdout, err = run_main(argv(corpus, tmp_path, out, 1, "--resume"))
    assert code == 0 and "rope-seed0" in stdout
    notes = [line for line in err.splitlines() if "--resume" in line]
    assert notes == [f"python -m linear_rope.train: note: --resume: no checkpoint (ckpt-<step>.pt) in "
                     f"{out / 'rope-seed0'}; starting every run from step 0"], err
    assert latest_step(out / "rope-seed0") == 1
    code, _, err = run_main(argv(corpus, tmp_path, out, 2, "--resume", "--variants", "rope,none"))
    assert code == 0 and latest_step(out / "rope-seed0") == 2 and latest_step(out / "none-seed0") == 2
    notes = [line for line in err.splitlines() if "--resume" in line]
    assert notes == [f"python -m linear_rope.train: note: --resume: no checkpoint (ckpt-<step>.pt) in "
                     f"{out / 'none-seed0'}; starting none-seed0 from step 0"], err
    code, _, err = run_main(argv(corpus, tmp_path, out, 3, "--resume", "--variants", "rope,none"))
    assert code == 0 and "--resume" not in err  # everything resumed: nothing to say
