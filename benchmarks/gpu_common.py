"""What the parts of ``benchmarks.gpu`` share: the device, timers, budgets, peaks, the corpus.

Every part function takes a ``Ctx`` and returns a dict for the JSON. A part records what it
could not run as a string starting ``skipped:`` (``NEEDS_CUDA`` where the CPU cannot run it) and
each failed measurement as ``error: <one line>``; nothing is dropped silently.
"""
from __future__ import annotations

import bz2
import contextlib
import dataclasses
import gzip
import lzma
import math
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
NEEDS_CUDA = "skipped: needs CUDA"
SAMPLE_NAME = "enwiki-sample.xml.bz2"
# Where the shared Wikipedia sample may be: beside the checkout (developers' machines), inside
# it (a checkout with shared/), or carried into data/ (the device machine: see the module doc
# of benchmarks.gpu).
SAMPLE_PATHS = (REPO_ROOT.parent / "shared/data" / SAMPLE_NAME, REPO_ROOT / "shared/data" / SAMPLE_NAME,
                REPO_ROOT / "data" / SAMPLE_NAME)

# Dense bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets (no sparsity). The first
# entry whose every word is in the device name wins, so the PCIe and NVL parts come before
# the plain "H100" (the SXM part, "NVIDIA H100 80GB HBM3").
BF16_PEAK_TFLOPS = (
    (("H100", "PCIe"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.0),
    (("H200",), 989.0),
    (("A100",), 312.0),
)


def bf16_peak_tflops(device_name: str) -> float | None:
    """The card's dense bf16 peak (TFLOP/s) by device name, or None when unknown."""
    name = device_name.lower()
    for words, peak in BF16_PEAK_TFLOPS:
        if all(w.lower() in name for w in words):
            return peak
    return None


def one_line(e: BaseException) -> str:
    """An exception as one line: type and the first line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}".rstrip(": ")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


class PartTimeout(BaseException):
    """Raised inside a part when its wall-time budget is spent (see ``deadline``). A
    BaseException, like KeyboardInterrupt: code that handles errors (``except Exception``: the
    kernels' fallback, Triton's interpreter) must not take a spent budget for a failure."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise ``PartTimeout`` in this thread after ``seconds`` (SIGALRM; a no-op where signals
    are not available, e.g. off the main thread). A backstop: parts also check ``Ctx.left``
    between measurements, and a CUDA kernel already queued still runs to its end."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def fire(signum, frame):
        raise PartTimeout(f"part budget of {seconds:.0f} s spent")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclasses.dataclass
class Ctx:
    """One run: the device, the mode, and the wall-time budget of the part now running."""

    device: torch.device
    quick: bool
    data: str | None = None
    compile: bool = False
    train_batch: int | None = None
    gen_batch: int | None = None
    part_start: float = 0.0
    part_budget: float = math.inf
    save: Callable[[], None] = lambda: None  # writes the JSON and Markdown so far (a killed run keeps them)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def start_part(self, budget_s: float) -> None:
        self.part_start, self.part_budget = time.perf_counter(), budget_s

    def left(self) -> float:
        """Seconds left in the current part's budget."""
        return self.part_budget - (time.perf_counter() - self.part_start)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def peak_tflops(self) -> float | None:
        return bf16_peak_tflops(torch.cuda.get_device_name(self.device)) if self.cuda else None


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        info.update(name=name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), bf16_peak_tflops=bf16_peak_tflops(name),
                    allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    else:
        info.update(name="cpu", threads=torch.get_num_threads(), bf16_peak_tflops=None)
    return info


def time_call(ctx: Ctx, fn: Callable[[], object], *, reps: int, max_s: float, warmup: int = 1) -> dict:
    """Median milliseconds of ``fn`` over up to ``reps`` calls after ``warmup`` calls, stopping
    once the timed calls add up to ``max_s``. CUDA: one pair of CUDA events per call; CPU:
    perf_counter. With CUDA also the peak memory above what was allocated before, MiB."""
    mem0 = 0
    if ctx.cuda:
        ctx.sync()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        mem0 = torch.cuda.memory_allocated(ctx.device)
    for _ in range(warmup):
        fn()
    ctx.sync()
    peak = (torch.cuda.max_memory_allocated(ctx.device) - mem0) / 2**20 if ctx.cuda else None
    times: list[float] = []
    spent = 0.0
    while len(times) < reps and (not times or spent < max_s):
        if ctx.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            fn()
            ms = 1e3 * (time.perf_counter() - t0)
        times.append(ms)
        spent += ms / 1e3
    return {"ms": statistics.median(times), "ms_min": min(times), "reps": len(times),
            "peak_mib": peak if ctx.cuda else NEEDS_CUDA}


def load_corpus(path: str | None, max_bytes: int) -> tuple[torch.Tensor, str]:
    """Up to ``max_bytes`` bytes of a corpus as a uint8 tensor, and where they came from.

    ``path`` (any of .bz2 / .gz / .xz / raw) or the shared sample (``SAMPLE_PATHS``); without
    either, random bytes, and the note says so."""
    candidates = [Path(path)] if path else [p for p in SAMPLE_PATHS if p.is_file()]
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"--data: no such file: {path}")
    if not candidates:
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, generator=g),
                f"random bytes (no corpus: pass --data, or put {SAMPLE_NAME} in data/); the loss cannot fall below 8 bits")
    p = candidates[0]
    opener = {".bz2": bz2.open, ".gz": gzip.open, ".xz": lzma.open}.get(p.suffix, open)
    with opener(p, "rb") as f:
        raw = f.read(max_bytes)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8), f"{p} (first {len(raw)} bytes)"


def batch_of(corpus: torch.Tensor, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random crops of ``seq + 1`` bytes: inputs and next-byte targets `[batch, seq]`."""
    starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=g)
    crops = torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()]).long()
    return crops[:, :-1], crops[:, 1:]
