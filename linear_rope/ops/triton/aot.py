"""Ahead-of-time sm_90 compile of every kernel in every config the dispatch can pick, on any machine.

    TRITON_INTERPRET=0 python -m linear_rope.ops.triton.aot [--json out.json]

Builds each kernel with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``
(the ptxas in the Triton wheel; no GPU or driver needed) and reports its shared memory (from
the compiled kernel's metadata), registers and spills (ptxas's log). The launch signature is
the one the wrapper gives at run time: q, k, v in the input dtype, every other tensor float32,
every pointer 16-byte aligned (torch's allocations are), the integer arguments unspecialised
(``do_not_specialize`` in ``kernels.py``), so these are the binaries a launch would build.
Exit 1 if a kernel fails to build or needs more shared memory than an H100 block has.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time

H100_SMEM_PER_BLOCK = 232_448  # bytes: the opt-in maximum per block on sm_90
_TL = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _builds():
    """(name, JITFunction, input dtype name, FAVOR) for every kernel the dispatch can launch."""
    from . import kernels as K
    from .dispatch import dispatch_configs

    for dtype, cfg in dispatch_configs():
        dt = str(dtype).removeprefix("torch.")
        yield "_qmax_kernel", K._qmax_kernel, dt, True, cfg["qmax"]
        for favor in (True, False):
            yield "_fwd_kernel", K._fwd_kernel, dt, favor, cfg["kernel"]
            yield "_bwd_kernel", K._bwd_kernel, dt, favor, cfg["kernel"]


def compile_one(fn, dtype: str, favor: bool, cfg: dict):
    """Compile ``fn`` for sm_90; returns the compiled kernel and ptxas's log."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {k: v for k, v in cfg.items() if k in fn.arg_names}
    consts.update(ACC=tl.float32)
    if "FAVOR" in fn.arg_names:
        consts["FAVOR"] = favor
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = f"*{_TL[dtype]}" if name in ("q_ptr", "k_ptr", "v_ptr") else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "FLOOR" else "i32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    triton.knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return kernel, log.getvalue()


def run(only: str | None = None, shard: tuple[int, int] = (0, 1)) -> list[dict]:
    """Compile every build (``only``: a dtype name, to compile one dtype's; ``shard`` (i, n): every
    n-th build from the i-th, for n processes side by side); one row each."""
    rows = []
    for j, (name, fn, dtype, favor, cfg) in enumerate(_builds()):
        if (only and dtype != only) or j % shard[1] != shard[0]:
            continue
        row = dict(kernel=name, dtype=dtype, favor=favor,
                   config={k: v for k, v in cfg.items() if k != "num_warps"} | {"num_warps": cfg["num_warps"]})
        t = time.perf_counter()
        try:
            kernel, log = compile_one(fn, dtype, favor, cfg)
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        else:
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            smem = int(kernel.metadata.shared)
            row.update(ok=smem <= H100_SMEM_PER_BLOCK, shared_bytes=smem, registers=regs and int(regs.group(1)),
                       spill_store_bytes=spill and int(spill.group(1)), spill_load_bytes=spill and int(spill.group(2)))
            if smem > H100_SMEM_PER_BLOCK:
                row["error"] = f"shared memory {smem} B > the H100's {H100_SMEM_PER_BLOCK} B per block"
        row["seconds"] = round(time.perf_counter() - t, 2)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--dtype", choices=sorted(_TL), help="compile one input dtype's kernels only")
    ap.add_argument("--shard", default="0/1", help="i/n: compile every n-th build from the i-th (parallel runs)")
    args = ap.parse_args(argv)
    try:
        shard = tuple(int(x) for x in args.shard.split("/"))
        assert len(shard) == 2 and 0 <= shard[0] < shard[1]
    except (ValueError, AssertionError):
        print(f"aot: --shard must be i/n with 0 <= i < n, got {args.shard!r}", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot: unset TRITON_INTERPRET (the compile needs the real JIT)", file=sys.stderr)
        return 2
    rows = run(args.dtype, shard)
    for r in rows:
        what = (f"{r['shared_bytes']:>7} B smem, {r['registers']} regs, spills {r['spill_store_bytes']}/"
                f"{r['spill_load_bytes']} B" if "shared_bytes" in r else r["error"])
        print(f"{r['kernel']:<13} {r['dtype']:<9} favor={r['favor']!s:<5} {what}  ({r['seconds']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
