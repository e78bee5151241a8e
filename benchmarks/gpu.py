"""The GPU check and benchmark: is every path right on the device, and how fast is it?

    python -m benchmarks.gpu                            # CUDA: about 8.5 minutes on an H100
    python -m benchmarks.gpu --device cpu --quick       # every part at toy sizes, under a minute
    python -m benchmarks.gpu --check                    # part 1 only; exit 1 if a check fails

One process on one device, parts in this order, each with a wall-time budget (a share of
``--budget-s``; a part that spends it stops, records what it skipped, and the next begins):

0. **compare** (``gpu_train.run_compare``, only when named in ``--parts``): the ``paper``
   preset's training tokens/s and MFU for softmax (flash SDPA), ``rope`` and ``none`` at N =
   1024, then ``rope_pre`` and N = 4096 as the budget allows, on the default attention path,
   each model compiled as the trainer compiles it; every row names its path and compile time;
1. **correctness** (``gpu_checks``): fast paths against the float64 naive reference in float64,
   float32, bf16 and fp16 for every keyword, strict causality, step = forward, finite bf16 /
   fp16 training steps;
2. **op_speed** (``gpu_speed``): ours vs flash SDPA vs fla vs performer-pytorch, fwd and
   fwd+bwd, B*H = 12 and B=8 x H=12, N = 1k..32k: times, ratios, the crossover N against
   flash, TFLOP/s against the card's bf16 peak, peak memory, and a profile of ours;
4. **generation** (``gpu_train.run_generation``): batched decoding at 1k and 16k positions;
3. **training** (``gpu_train.run_training``): the ``paper`` preset under bf16 autocast, eager,
   then ``torch.compile``: tokens/s, MFU, peak memory, a loss curve (run last: compiling may
   take the rest of the budget).

Writes ``benchmarks/results/gpu.json`` (``--out``) after every part, so a run cut short keeps
what it measured, and the Markdown section ``gpu.md`` beside it. Exit code: 1 if a correctness
check failed (or part 1 did not finish), 2 if another part raised, else 0. Parts the CPU cannot
run say "skipped: needs CUDA".

It needs performer-pytorch (FAVOR+ projections, the performer baseline) and, for the fla rows,
fla-core beside the GPU's torch. On a device machine without network, ``bash
benchmarks/gpu_wheels.sh`` here fetches their wheels into ``.whl/`` and copies the shared sample
to ``data/``; the device call carries both (``carry: [".whl", "data/enwiki-sample.xml.bz2"]``)::

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
    PYTHONUNBUFFERED=1 timeout 570 python3 -m benchmarks.gpu --out $OUT/gpu.json 2>&1 | tee $OUT/gpu.log
"""
from __future__ import annotations

import os
import sys

if "cpu" in sys.argv[sys.argv.index("--device") + 1:][:1] if "--device" in sys.argv else False:
    # CPU mode: the Triton kernels' rows run in Triton's interpreter, which must be chosen before
    # triton.language is first imported (torch may import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

try:  # performer-pytorch (which draws the FAVOR+ projections) imports distutils, which Python 3.12
    import distutils  # noqa: F401  has only through setuptools' shim; importing setuptools installs it
except ImportError:
    import setuptools  # noqa: F401

from . import gpu_checks, gpu_speed, gpu_train  # noqa: E402
from .gpu_common import BENCH_DIR, NEEDS_CUDA, Ctx, PartTimeout, deadline, device_info, one_line  # noqa: E402
from .gpu_report import render  # noqa: E402

# Part name -> (title, runner, share of the budget). Run in this order; the JSON and the
# Markdown list them by number.
PARTS = {
    "compare": ("0. Training: softmax against linear attention", gpu_train.run_compare, 0.3),
    "correctness": ("1. Correctness on the device", lambda ctx, res: res.update(gpu_checks.run(ctx)), 0.15),
    "op_speed": ("2. Op speed", gpu_speed.run, 0.35),
    "generation": ("4. Generation", gpu_train.run_generation, 0.06),
    "training": ("3. Training", gpu_train.run_training, 0.44),
}
ORDER = ("compare", "correctness", "op_speed", "training", "generation")
GRACE_S = 20.0  # past a part's budget before its deadline fires (a call in flight may finish)


def parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes: every part in under a minute on a CPU")
    p.add_argument("--out", default=str(BENCH_DIR / "results" / "gpu.json"),
                   help="the JSON file; the Markdown section goes beside it with the suffix .md")
    p.add_argument("--data", default=None, help="byte corpus for the training part (.bz2/.gz/.xz/raw); "
                   "default: the shared enwiki sample if found, else random bytes (noted)")
    p.add_argument("--parts", default=",".join(ORDER[1:]), help=f"comma-separated subset of {','.join(ORDER)} (default: all but compare)")
    p.add_argument("--check", action="store_true", help="part 1 (correctness) only")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget of all parts, seconds (default 480; 50 with --quick)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="time torch.compile in the training part (auto: on CUDA only)")
    p.add_argument("--train-batch", type=int, default=None, help="training batch (default 16; 4 with --quick); "
                   "halved on out-of-memory")
    p.add_argument("--gen-batch", type=int, default=None, help="decoding batch (default 8; 2 with --quick)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for float32 matmuls (the op computes in "
                   "float32); off by default, recorded in the JSON")
    a = p.parse_args(argv)
    parts = ["correctness"] if a.check else [s.strip() for s in a.parts.split(",") if s.strip()]
    bad = sorted(set(parts) - set(ORDER))
    if bad:
        p.error(f"--parts: unknown {bad}; choose from {list(ORDER)}")
    a.parts = parts
    return a


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out)
    out.with_suffix(".md").write_text(render(result))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; use --device cpu", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1 if a.quick else torch.get_num_threads())  # 1: no OpenMP spinning on shared cores
    budget = a.budget_s or (50.0 if a.quick else 480.0)
    ctx = Ctx(device=device, quick=a.quick, data=a.data, train_batch=a.train_batch, gen_batch=a.gen_batch,
              compile=a.compile == "on" or (a.compile == "auto" and device.type == "cuda"))
    out = Path(a.out)
    ctx.save = lambda: _write(result, out)
    t_start = time.perf_counter()
    result: dict = {
        "name": out.stem, "command": " ".join(["python -m benchmarks.gpu", *argv]), "quick": a.quick,
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "budget_s": budget,
        "device": device_info(device), "tf32": a.tf32, "finished": False,
        "cpu_mode_note": None if device.type == "cuda" else
        f"CPU mode: toy sizes, figures mean nothing; flash, fla and CUDA memory: {NEEDS_CUDA}",
        "parts": {name: {"title": PARTS[name][0], "status": "not reached (the run stopped before it)" if name in a.parts
                         else "not run (--parts)"} for name in ORDER},
    }
    shares = sum(PARTS[n][2] for n in a.parts)
    for name in (n for n in PARTS if n in a.parts):
        title, runner, share = PARTS[name]
        left = budget - (time.perf_counter() - t_start)
        rec = result["parts"][name] = {"title": title, "status": "running", "budget_s": max(0.0, budget * share / shares)}
        if name == "training" or a.quick:  # training runs last and may use what the others left; toy sizes
            rec["budget_s"] = max(rec["budget_s"], left)  # need no shares, only the cap on the whole run
        print(f"== {title} (budget {rec['budget_s']:.0f} s)", flush=True)
        # TF32 (--tf32) only where speed is measured: the checks' float32 tolerances assume float32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = a.tf32 and name != "correctness"
        ctx.start_part(rec["budget_s"])
        ctx.save()  # "running" in the file until it ends: a run killed from outside shows where
        t0 = time.perf_counter()
        try:
            with deadline(rec["budget_s"] + GRACE_S):
                runner(ctx, rec)
            rec["status"] = "ok"
        except PartTimeout as e:
            rec["status"], rec["error"] = "timed out", f"{e}; what it measured before is kept"
        except Exception as e:  # recorded with its one-line message, never dropped
            rec["status"], rec["error"] = "error", one_line(e)
            traceback.print_exc()
        rec["wall_s"] = time.perf_counter() - t0
        print(f"   {name}: {rec['status']}{' (' + rec['error'] + ')' if 'error' in rec else ''}, "
              f"{rec['wall_s']:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _write(result, out)
    corr = result["parts"]["correctness"]
    code = 0
    if "correctness" in a.parts and (corr["status"] != "ok" or corr.get("failed")):
        code = 1
    elif any(p["status"] == "error" for p in result["parts"].values()):
        code = 2
    result.update(finished=True, wall_s=time.perf_counter() - t_start, exit_code=code)
    _write(result, out)
    if corr.get("failed"):
        print("FAILED checks:\n  " + "\n  ".join(corr["failed"]))
    print(f"correctness: {corr.get('passed', '-')} passed, {len(corr.get('failed', []))} failed; "
          f"wall {result['wall_s']:.0f} s; exit {code}")
    print(f"wrote {out.with_suffix('.md')}")
    print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
