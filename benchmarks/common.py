"""The benchmarks' one core: the "ours" callable, one timer for CPU and GPU (``time_call``, under
``interleaved`` rounds and the GPU window's ``measure``), GEMM peak, tables, JSON, the CLI.

Every CPU benchmark module has ``main(quick=False, out_dir=None) -> dict``: it prints its table,
writes ``<out_dir>/<name>.json`` (default ``benchmarks/results``) and returns a dict with
``name, quick, config, table {headers, rows}, targets [{name, value, op, threshold, pass}], notes``
and its raw numbers, which ``benchmarks.run`` renders into BENCHMARKS.md. Timings are medians of
interleaved rounds in one process: on a shared machine only ratios timed side by side mean much.
"""
from __future__ import annotations

import bz2
import contextlib
import functools
import gzip
import json
import lzma
import math
import os
import platform
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from linear_rope import FavorFeatures
from linear_rope import rotary_linear_attention
from linear_rope.ops.chunk import BLOCK, CHUNK

THREADS_ENV = "LINEAR_ROPE_BENCH_THREADS"  # set by ``benchmarks.run --threads``; children inherit it


def threads() -> int:
    """Threads of a full (not quick) run: the machine's 2 cores, or ``--threads`` of ``benchmarks.run``
    (1 where other jobs keep the cores busy: 2 OpenMP threads then spin at every barrier)."""
    return int(os.environ.get(THREADS_ENV, "2"))
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


def setup(quick: bool = False, seed: int = 0) -> None:
    """Threads and seed; quick mode (smoke tests) runs on 1 thread (on a busy machine, OpenMP
    threads spin at every barrier). The allocator is glibc's default, as users get it."""
    torch.set_num_threads(1 if quick else threads())
    torch.manual_seed(seed)


# --- ours ------------------------------------------------------------------------------------

def ours_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: FavorFeatures, rotary: bool) -> torch.Tensor:
    """The single definition of "ours": causal Eq. 19 (``rotary``) or Eq. 18, `[B, H, N, d]` in and out,
    through ``rotary_linear_attention`` with FAVOR+ inside, as ``RotaryLinearAttention`` runs it."""
    return rotary_linear_attention(q, k, v, projection=features.projection, rotary=rotary)


def ours_features_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: FavorFeatures, rotary: bool) -> torch.Tensor:
    """The same attention with the features made on the caller's side: ``features(q)``,
    ``features(k)`` (FAVOR+, any user's own feature map goes here), then the op on them. The
    features' time counts: it is what such a user pays."""
    return rotary_linear_attention(features(q, is_query=True), features(k, is_query=False), v, rotary=rotary)


def ours_path() -> str:
    """Which code path ``ours_attention`` takes, for the record."""
    return ("linear_rope.rotary_linear_attention(projection=...) (public op, FAVOR+ inside; chunk form, "
            f"chunk {CHUNK}, block {BLOCK})")


# --- timing ----------------------------------------------------------------------------------

def time_call(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds of one call of ``fn``: the timing core of every benchmark, CPU and GPU. On a CUDA
    ``device`` the queue is drained before and after (the call's kernels are in the time)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def interleaved(fns: dict[str, Callable[[], object]], *, warmup: int = 1, rounds: int = 5,
                budget_s: float | None = None) -> dict[str, list[float]]:
    """Seconds per call of each fn (``time_call``), run round-robin: every round calls each fn
    once, starting one place later each round, so slow drifts of the shared machine hit all of
    them alike. At most ``rounds``; after the first, no new round starts when it would likely
    end past ``budget_s``."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(rounds):
        t_round = time.perf_counter()
        for n in names[r % len(names):] + names[: r % len(names)]:
            times[n].append(time_call(fns[n]))
        now = time.perf_counter()
        if budget_s is not None and (now - start) + (now - t_round) > budget_s:
            break
    return times


def load_average() -> str:
    """The 1/5/15-minute load averages: on a shared machine, how busy it was around a run."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def commit(where: Path = REPO_ROOT) -> str:
    """The short commit of the checkout that holds ``where`` ("" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def gemm_probe(n: int = 2048, reps: int = 3) -> Callable[[], None]:
    """A call for ``interleaved`` rounds: each call appends to ``call.rates`` the best GFLOP/s
    of ``reps`` fp32 [n, n] @ [n, n] products. Timed in the same rounds as a workload, it gives
    the GEMM rate the machine offered *then*, the fair denominator of a fraction-of-peak on a
    shared machine (a peak taken once, at another moment, can be off by 2x either way)."""
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    torch.mm(a, b, out=c)
    rates: list[float] = []

    def call():
        best = min(time_call(lambda: torch.mm(a, b, out=c)) for _ in range(reps))
        rates.append(2 * n**3 / best / 1e9)
    call.rates = rates
    return call


def gemm_n(quick: bool = False) -> int:
    """The GEMM size of every peak measurement: 2048 (512 in quick mode)."""
    return 512 if quick else 2048


@functools.lru_cache(maxsize=None)
def machine_peak(quick: bool = False) -> float:
    """Measured fp32 GEMM rate, GFLOP/s: best of 7 products at ``gemm_n`` on the current thread
    count (call ``setup`` first), measured once per process (for the record)."""
    probe = gemm_probe(gemm_n(quick), 7)
    probe()
    return probe.rates[0]


# --- reporting -------------------------------------------------------------------------------

def fmt(x, digits: int = 3) -> str:
    """A number to `digits` significant figures (no exponent for ordinary sizes)."""
    if x is None:
        return "-"
    if isinstance(x, (str, int)) or x == 0 or not math.isfinite(x):
        return str(x)
    mag = math.floor(math.log10(abs(x)))
    return f"{x:.{max(0, digits - 1 - mag)}f}"


def format_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown pipe table, columns padded so it also reads as plain text."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]])


def target(name: str, value: float | None, op: str, threshold: float) -> dict:
    """A target line: ``value <op> threshold`` with op "<=" or ">="; pass is None if unmeasured."""
    ok = None
    if value is not None and math.isfinite(value):
        ok = value <= threshold if op == "<=" else value >= threshold
    return {"name": name, "value": value, "op": op, "threshold": threshold, "pass": ok}


def target_line(t: dict) -> str:
    verdict = {True: "PASS", False: "MISS", None: "n/a"}[t["pass"]]
    return f"{t['name']}: {fmt(t['value'])} (target {t['op']} {fmt(t['threshold'])}) {verdict}"


def write_json(result: dict, out: str | Path | None) -> Path:
    """Write ``<out>/<name>.json`` (``out`` a folder; default ``benchmarks/results``) or ``out``
    itself (a ``.json`` path) via a .tmp file, so a crash never leaves half a file."""
    out = Path(out) if out is not None else RESULTS_DIR
    path = out if out.suffix == ".json" else out / f"{result['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def report(result: dict, out_dir: str | Path | None) -> dict:
    """Print the table, targets and notes, write the JSON; return the result."""
    print(f"\n== {result['name']}{' (quick)' if result['quick'] else ''} ==")
    print(format_table(result["table"]["headers"], result["table"]["rows"]))
    for t in result["targets"]:
        print(target_line(t))
    for n in result.get("notes", []):
        print(f"note: {n}")
    print(f"wrote {write_json(result, out_dir)}")
    return result


def machine_info() -> dict:
    cpu, mem_gib = "unknown", None
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
            mem_gib = round(kib / 2**20, 1)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(), "platform": platform.platform()}


def cli(main: Callable[..., dict], doc: str, **options: dict) -> None:
    """The command line of a benchmark module: ``python -m benchmarks.<name> [--quick] [--out-dir D]``,
    and ``options`` (a keyword of ``main`` -> its ``add_argument`` keywords, the flag spelt with -)."""
    import argparse

    p = argparse.ArgumentParser(allow_abbrev=False, description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    p.add_argument("--out-dir", default=None, help="where <name>.json goes (default benchmarks/results)")
    for name, kw in options.items():
        p.add_argument("--" + name.replace("_", "-"), **kw)
    a = vars(p.parse_args())
    main(a.pop("quick"), a.pop("out_dir"), **a)


# --- the GPU window (benchmarks.gpu): device, budgets, corpus ---------------------------------

NEEDS_CUDA = "skipped: needs CUDA"
SAMPLE_NAME = "enwiki-sample.xml.bz2"
# The shared Wikipedia sample: beside the checkout, inside it (shared/), or carried into data/.
SAMPLE_PATHS = (REPO_ROOT.parent / "shared/data" / SAMPLE_NAME, REPO_ROOT / "shared/data" / SAMPLE_NAME,
                REPO_ROOT / "data" / SAMPLE_NAME)

# Dense bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets (no sparsity). The first
# entry whose every word is in the device name wins, so the PCIe and NVL parts come before
# the plain "H100" (the SXM part, "NVIDIA H100 80GB HBM3").
BF16_PEAK_TFLOPS = (
    (("H100", "PCIe"), 756.0), (("H100", "NVL"), 835.0), (("H100",), 989.0), (("H200",), 989.0), (("A100",), 312.0),
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
    are not available, e.g. off the main thread). A backstop: rows also check ``Window.left``
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


def measure(fn: Callable[[], object], *, device: torch.device | None = None, reps: int, max_s: float,
            warmup: int = 1) -> dict:
    """Median milliseconds of ``fn`` (``time_call``) over up to ``reps`` calls after ``warmup``,
    stopping once the timed calls add up to ``max_s``; on CUDA also the peak memory allocated
    above what was allocated before, MiB."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        mem0 = torch.cuda.memory_allocated(device)
    for _ in range(warmup):
        fn()
    peak = (torch.cuda.max_memory_allocated(device) - mem0) / 2**20 if cuda else NEEDS_CUDA
    times: list[float] = []
    while len(times) < reps and sum(times) < max_s * 1e3 or not times:
        times.append(1e3 * time_call(fn, device))
    return {"ms": statistics.median(times), "ms_min": min(times), "reps": len(times), "peak_mib": peak}


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
