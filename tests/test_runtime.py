"""linear_rope.enwik8.runtime: the CPU thread choice and the progress output."""
from __future__ import annotations

import io
import re

import pytest
import torch

from helpers import run_main
from linear_rope.enwik8 import runtime
from linear_rope.enwik8.runtime import Progress, choose_threads

CPU = torch.device("cpu")


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("idle, want, why", [
    (2.0, 2, "one per idle core: 2.0 of 2 cores idle at start"),
    (1.4, 1, "one per idle core: 1.4 of 2 cores idle at start"),
    (1.6, 2, "one per idle core: 1.6 of 2 cores idle at start"),
    (0.2, 1, "the minimum: only 0.2 of 2 cores idle at start"),
    (3.0, 2, "capped at torch's default 2: 3.0 of 2 cores idle at start"),
    (None, 2, "torch's default: idle cores unknown, /proc/stat unreadable")])
def test_threads_follow_the_idle_cores(monkeypatch, restore_threads, idle, want, why):
    """The choice, and the reason the start line gives for it (``threads 1 (<why>)``)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "idle_cores", lambda seconds=0.3: idle)
    monkeypatch.setattr(runtime, "_cores", lambda: 2)
    torch.set_num_threads(2)  # torch's default on a 2-core machine
    assert choose_threads(None, CPU) == (want, why)
    assert torch.get_num_threads() == want


def test_explicit_threads_and_omp_num_threads_win(monkeypatch, restore_threads):
    monkeypatch.setattr(runtime, "idle_cores", lambda seconds=0.3: pytest.fail("probed"))
    assert choose_threads(1, CPU) == (1, "set by --threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert choose_threads(None, CPU)[1] == "set by OMP_NUM_THREADS"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert choose_threads(None, torch.device("cuda"))[1] == "torch's default; the model runs on cuda"


def test_idle_cores_reads_proc_stat():
    idle = runtime.idle_cores(0.05)
    assert idle is None or 0.0 <= idle <= len(runtime.os.sched_getaffinity(0)) + 1e-9


def test_progress_without_a_terminal_writes_plain_lines():
    buf = io.StringIO()  # not a TTY
    p = Progress("rope-seed0", total=5, initial=0, every_s=0.0, stream=buf)
    for step in range(1, 6):
        p.update(step, loss="2.0000")
        if step == 3:
            p.write("rope-seed0 step 3: val bpc 2.8854 (eval 0.1 s)")
    p.close()
    text = buf.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 6 and lines[3] == "rope-seed0 step 3: val bpc 2.8854 (eval 0.1 s)"
    assert re.fullmatch(r"rope-seed0 step 5/5 loss 2\.0000 \| [\d.]+ steps/s, eta 0\.0 min", lines[-1])


def test_progress_lines_are_rate_limited():
    buf = io.StringIO()
    p = Progress("r", total=1000, initial=0, every_s=3600.0, stream=buf)
    for step in range(1, 1001):
        p.update(step)
    assert len(buf.getvalue().splitlines()) == 1  # only the last step's line


def test_a_run_logged_to_a_file_has_no_carriage_returns(tmp_path, corpus, one_thread):
    code, out, err = run_main(["--preset", "tiny", "--variants", "rope,none", "--steps", "6",
                               "--eval-every", "3", "--data", str(corpus),
                               "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "runs")])
    assert code == 0, err
    assert "\r" not in err
    val = [ln for ln in err.splitlines() if "val bpc" in ln]
    assert len(val) == 4 and all(re.fullmatch(r"(rope|none)-seed0 step [36]: val bpc [\d.]+ "
                                              r"\(eval [\d.]+ s\)", ln) for ln in val), val
    assert sum(bool(re.match(r"(rope|none)-seed0 step 6/6 ", ln)) for ln in err.splitlines()) == 2
    starts = [ln for ln in err.splitlines() if " params, steps 0 -> 6, " in ln]
    assert len(starts) == 2 and all(", threads 1 (set by OMP_NUM_THREADS), " in ln for ln in starts), starts
