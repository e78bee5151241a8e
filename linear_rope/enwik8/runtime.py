"""Process runtime for training: torch.distributed setup, CPU threads, graceful stop on signals,
progress output, hashes.

Scale-out is PyTorch's own: ``torchrun`` sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, we join
the process group (gloo on CPU, nccl on CUDA) and wrap the model in DDP. No launcher of our own.
"""
from __future__ import annotations

import hashlib
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

__all__ = ["Dist", "init_distributed", "choose_threads", "idle_cores", "StopSignals", "Progress",
           "param_digest", "resume_command"]


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` on every rank (``[obj]`` in one process)."""
        if self.world == 1:
            return [obj]
        found = [None] * self.world
        dist.all_gather_object(found, obj)
        return found


def init_distributed(device: str) -> Dist:
    """One process, or one rank of a torchrun launch (``WORLD_SIZE > 1``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=torch.device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def idle_cores(seconds: float = 0.3) -> float | None:
    """Cores left idle by every other process over ``seconds`` (from /proc/stat; this process
    is asleep meanwhile). ``None`` where /proc/stat cannot be read."""
    def sample():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks[:8])  # idle + iowait, total (no guest time)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return _cores() * (idle1 - idle0) / max(1, total1 - total0)


def choose_threads(requested: int | None, device: torch.device) -> tuple[int, str]:
    """Set torch's CPU threads; return ``(threads, why)``, ``why`` in words for the start line
    (``threads 1 (the minimum: only 0.1 of 2 cores idle at start)``).

    ``--threads N`` and ``OMP_NUM_THREADS`` win. Otherwise, on CPU, one thread per core that is
    idle at start (at least one). torch's default is one per core, busy or not: beside one
    busy-looping process on 2 cores, 2 OpenMP threads make every parallel region wait for the
    thread that shares a core with the neighbour (and spin meanwhile), and a ``cpu``-preset
    step took 2.8-3.5x its time alone; with 1 thread it takes 1.3-1.5x (docs/performance.md,
    "A fair share of a busy machine").
    """
    if requested:
        torch.set_num_threads(requested)
        return requested, "set by --threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "set by OMP_NUM_THREADS"
    if device.type != "cpu":
        return torch.get_num_threads(), f"torch's default; the model runs on {device.type}"
    idle = idle_cores()
    if idle is None:
        return torch.get_num_threads(), "torch's default: idle cores unknown, /proc/stat unreadable"
    most, per_idle = torch.get_num_threads(), math.floor(idle + 0.5)
    n = max(1, min(most, per_idle))
    torch.set_num_threads(n)
    seen = f"{idle:.1f} of {_cores()} cores idle at start"
    if per_idle < 1:
        return n, f"the minimum: only {seen}"
    if per_idle > most:
        return n, f"capped at torch's default {most}: {seen}"
    return n, f"one per idle core: {seen}"


class StopSignals:
    """Turn the first SIGTERM / SIGINT into a request to checkpoint and stop after this step.

    A second signal of the same kind gets the default behaviour (terminate / KeyboardInterrupt),
    for when the checkpoint itself is not wanted. Use as a context manager around training.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, quiet: bool = False):
        self.received: str | None = None
        self.quiet = quiet
        self._old = {}

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        if not self.quiet:
            print(f"\nreceived {self.received}: saving a checkpoint after the current step "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __enter__(self):
        for s in self.SIGNALS:
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        return False


class Progress:
    """Training progress on stderr: a tqdm bar on a terminal; otherwise (a log file, a pipe) one
    plain line every ``every_s`` seconds and at the end, never carriage-return frames.
    :meth:`write` prints a line of its own (the "step N: val bpc" lines) in both modes."""

    def __init__(self, name: str, total: int, initial: int, enabled: bool = True,
                 every_s: float = 30.0, stream=None):
        self.name, self.total, self.enabled, self.every_s = name, total, enabled, every_s
        self.stream = stream or sys.stderr
        self.tty = enabled and self.stream.isatty()
        self.bar = (tqdm(total=total, initial=initial, desc=name, file=self.stream,
                         dynamic_ncols=True) if self.tty else None)
        self.start, self.t0, self.last_line = initial, time.monotonic(), time.monotonic()
        self.step, self.postfix = initial, {}

    def update(self, step: int, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(step - self.step)
            if postfix:
                self.bar.set_postfix(postfix)
        self.step, self.postfix = step, postfix or self.postfix
        now = time.monotonic()
        if self.enabled and not self.tty and (now - self.last_line >= self.every_s
                                              or step == self.total):
            self.last_line = now
            rate = (step - self.start) / max(now - self.t0, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else math.inf
            stats = " ".join(f"{k} {v}" for k, v in self.postfix.items())
            self.write(f"{self.name} step {step}/{self.total} {stats} | {rate:.2f} steps/s, "
                       f"eta {eta / 60:.1f} min".replace("  ", " "))

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def param_digest(model: torch.nn.Module, state: dict | None = None) -> str:
    """SHA-256 over every parameter's bytes, in order: equal digests mean bitwise-equal models.
    With ``state`` (a state dict), of the tensors it holds under the parameters' names: the
    digest ``model`` would have once it loads them (KeyError for a missing one)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p if state is None else state[name]
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def resume_command(argv: list[str], prog: str, world: int) -> str:
    """The command line that continues this run: the same arguments plus ``--resume``."""
    args = [a for a in argv if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    if prog.endswith(".py"):
        launch = (["torchrun", "--standalone", f"--nproc_per_node={world}", prog] if world > 1
                  else ["python", prog])
    else:  # "python -m linear_rope.train"
        module = prog.split()[-1]
        launch = (["torchrun", "--standalone", f"--nproc_per_node={world}", "-m", module] if world > 1
                  else ["python", "-m", module])
    return shlex.join(launch + args)
