"""Ahead-of-time sm_80 and sm_90 builds of every kernel in every config the dispatch can pick, on any machine.

    TRITON_INTERPRET=0 python -m linear_rope.ops.triton.aot [--arch 90] [--json out.json]

Builds each kernel with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``
(the ptxas in the Triton wheel; no GPU or driver needed) and reports, per build: shared memory
(the compiled kernel's metadata), registers and spills (ptxas's log), blocks per SM (from
those and the SM's limits, ``SM_LIMITS``), and the matrix instructions of its PTX: how many
``mma`` / ``wgmma`` of which operand types, and how many ``cvt.rna.tf32`` (a TF32 ``mma``
without them truncates its fp32 operands). The launch signature is
the one the wrapper gives at run time: q, k, v in the input dtype, the projection's bf16 pieces
and (bf16 tensor cores) the gradient kernels' dnum pieces in bf16, every other tensor float32,
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
ARCHS = (80, 90)  # the capabilities the dispatch takes the kernels on (dispatch.CAPABILITIES)
# Per SM (CUDA programming guide, compute capabilities table): registers, shared memory (bytes),
# the opt-in maximum per block, threads, resident blocks; 1 KB of shared memory per block is
# reserved by the system.
SM_LIMITS = {80: dict(regs=65536, smem=167_936, smem_block=166_912, threads=2048, blocks=32),
             90: dict(regs=65536, smem=233_472, smem_block=H100_SMEM_PER_BLOCK, threads=2048, blocks=32)}
_TL = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def blocks_per_sm(arch: int, registers: int, num_warps: int, shared_bytes: int) -> int:
    """Resident blocks per SM: registers are allocated per warp in units of 256 (per-thread
    counts rounded up to 8), shared memory per block plus the 1 KB the system reserves."""
    lim = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = lim["regs"] // (per_warp * num_warps) if registers else lim["blocks"]
    by_smem = lim["smem"] // (shared_bytes + 1024)
    return int(min(by_regs, by_smem, lim["threads"] // (32 * num_warps), lim["blocks"]))


def matrix_instructions(ptx: str) -> dict:
    """{"mma.<a-type>": n, "wgmma.<a-type>": n, "cvt.rna.tf32": n} from a kernel's PTX: the
    tensor-core instructions and their operand types (tf32, bf16, f16, ...); "fma" counts the
    scalar fp32 FMAs (a dot that did not reach the tensor cores)."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"\b(wgmma\.mma_async\.sync|mma\.sync)\.aligned\.[\w.]*?\.(f32|f16|s32)\.(tf32|bf16|f16|e4m3|e5m2|s8)\b", ptx):
        key = f"{'wgmma' if m.group(1).startswith('wgmma') else 'mma'}.{m.group(3)}"
        counts[key] = counts.get(key, 0) + 1
    counts["cvt.rna.tf32"] = len(re.findall(r"cvt\.rna\.tf32\.f32", ptx))
    counts["fma"] = len(re.findall(r"\bfma\.rn\.f32\b", ptx))
    return counts


KERNELS = (("_qmax_kernel", "qmax", (True,)), ("_state_kernel", "state", (True, False)),
           ("_state_grad_kernel", "state", (True, False)), ("_out_kernel", "chunk", (True, False)),
           ("_dq_kernel", "chunk", (True, False)), ("_dk_kernel", "chunk", (True, False)),
           ("_dv_kernel", "chunk", (True, False)))


# The targets of the chunk-parallel kernels' bf16 builds (every kernel but ``_qmax_kernel``): at
# least 2 resident blocks per SM, bf16 tensor-core instructions (wgmma on sm_90, mma on sm_80)
# and no TF32 ones, and no spills. Every sm_90 build meets them (Triton 3.6.0; docs/gpu.md); on
# sm_80 four builds still spill a little: ``BF16_SPILLS`` holds their spill stores, and
# ``bf16_misses`` fails a build that spills more than it records (0 for every other build), or
# misses another target.
BF16_TARGETS = dict(blocks_per_sm=2, spill_store_bytes=0)
CHUNK_KERNELS = ("_out_kernel", "_dq_kernel", "_dk_kernel", "_dv_kernel")  # 64-row tiles: wgmma on sm_90 (the state
# passes' 16-pair tiles are narrower than wgmma's 64 rows: mma.sync)
# Registers, hence spills, are ptxas's choice, and each Triton release carries its own ptxas and
# passes: the spill allowances are recorded per release, (arch, kernel, FAVOR+ inside) -> spill
# stores (B). 3.6.0 is the release the GPUs run (the ``.[triton]`` pin) and the ratchet; 3.9.0's
# builds meet every other target but spill more, on sm_90 too (``aot --builds ci`` under 3.9.0,
# recorded as measured); a release with no record here is only built and reported
# (``bf16_misses`` judges no target for it).
BF16_SPILLS_BY_TRITON: dict[str, dict[tuple[str, str, bool], int]] = {
    "3.6.0": {("sm_80", "_state_kernel", True): 4, ("sm_80", "_state_grad_kernel", True): 40,
              ("sm_80", "_dk_kernel", True): 32, ("sm_80", "_dv_kernel", False): 32},
    "3.9.0": {("sm_80", "_state_kernel", True): 88, ("sm_80", "_state_grad_kernel", True): 72,
              ("sm_80", "_out_kernel", True): 16, ("sm_80", "_dv_kernel", True): 16,
              ("sm_90", "_out_kernel", True): 284, ("sm_90", "_out_kernel", False): 8,
              ("sm_90", "_dq_kernel", True): 400, ("sm_90", "_dk_kernel", True): 412,
              ("sm_90", "_dv_kernel", True): 164},
}
PINNED_TRITON = "3.6.0"
BF16_SPILLS = BF16_SPILLS_BY_TRITON[PINNED_TRITON]


TC = "bf16_tensor_cores"  # the variant of the builds the targets judge (``dispatch.BF16_TENSOR_CORES``)


def bf16_misses(row: dict) -> list[str]:
    """The targets a bf16 tensor-core build of the chunk-parallel kernels misses ([] for other
    builds: the default configs, which take TF32x3 products for every dtype, are not judged; nor
    are the targets under a Triton release ``BF16_SPILLS_BY_TRITON`` has no record for: only
    whether it built). ``row["triton"]`` is the release that built it (default: the pin)."""
    if row.get("dtype") != "bfloat16" or row.get("variant") != TC or row.get("kernel") == "_qmax_kernel":
        return []
    if not row.get("ok") or "shared_bytes" not in row:
        return [row.get("error", "did not build")]
    spills = BF16_SPILLS_BY_TRITON.get(row.get("triton", PINNED_TRITON))
    if spills is None:
        return []
    miss, ins = [], row["instructions"]
    if row["blocks_per_sm"] < BF16_TARGETS["blocks_per_sm"]:
        miss.append(f"{row['blocks_per_sm']} blocks per SM < {BF16_TARGETS['blocks_per_sm']}")
    if not (ins.get("wgmma.bf16") or ins.get("mma.bf16")):
        miss.append("no bf16 tensor-core instructions")
    if row["arch"] == "sm_90" and row["kernel"] in CHUNK_KERNELS and not ins.get("wgmma.bf16"):
        miss.append("no wgmma.bf16 instructions (64-row tiles on sm_90)")
    if ins.get("mma.tf32") or ins.get("wgmma.tf32"):
        miss.append("TF32 tensor-core instructions in a bf16 build")
    allowed = spills.get((row["arch"], row["kernel"], row["favor"]), BF16_TARGETS["spill_store_bytes"])
    if row["spill_store_bytes"] is None or row["spill_store_bytes"] > allowed:
        miss.append(f"spills {row['spill_store_bytes']} B > {allowed} B")
    return miss


def variants():
    """(variant, input dtype, config): every config the dispatch can pick on CUDA ("default"), and
    the bf16 tensor-core config that ``dispatch.BF16_TENSOR_CORES`` switches on (``TC``)."""
    import torch

    from .dispatch import dispatch_configs, pick_config

    return [("default", dt, cfg) for dt, cfg in dispatch_configs()] + \
        [(TC, torch.bfloat16, pick_config(torch.bfloat16, bf16_tensor_cores=True))]


def _builds():
    """(variant, name, JITFunction, input dtype name, FAVOR, config) for every kernel of ``variants``."""
    from . import chunk_kernels as CK
    from . import kernels as K

    for variant, dtype, cfg in variants():
        dt = str(dtype).removeprefix("torch.")
        for name, part, favors in KERNELS:
            for favor in favors:
                yield variant, name, getattr(K, name, None) or getattr(CK, name), dt, favor, cfg[part]


def compile_one(fn, dtype: str, favor: bool, cfg: dict, arch: int = 90):
    """Compile ``fn`` for sm_<arch>; returns the compiled kernel and ptxas's log."""
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
            split_dnum = (name == "dnum_ptr" and "dS0_ptr" not in fn.arg_names  # the chunk kernels' dnum: two
                          and cfg.get("SPREC") == "bf16x3")  # bf16 pieces (not the state pass's)
            sig[name] = (f"*{_TL[dtype]}" if name in ("q_ptr", "k_ptr", "v_ptr") else
                         "*bf16" if name in ("wp_ptr", "tri_ptr") or split_dnum else "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "FLOOR" else "i32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = {k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg}
    triton.knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    return kernel, log.getvalue()


def selected(arch: int, variant: str, builds: str = "all") -> bool:
    """``builds="ci"``: every build on sm_90, on sm_80 the bf16 tensor-core ones only (the
    targets' builds, in CI's time); "all": everything."""
    return builds == "all" or arch == 90 or variant == TC


def run(only: str | None = None, shard: tuple[int, int] = (0, 1), archs=ARCHS, builds: str = "all") -> list[dict]:
    """Compile every build for every arch (``only``: a dtype name, to compile one dtype's;
    ``shard`` (i, n): every n-th build from the i-th, for n processes side by side); one row each."""
    import triton

    rows, seen = [], {}
    jobs = [(arch, *b) for arch in archs for b in _builds() if selected(arch, b[0], builds)]
    for j, (arch, variant, name, fn, dtype, favor, cfg) in enumerate(jobs):
        if (only and dtype != only) or j % shard[1] != shard[0]:
            continue
        row = dict(kernel=name, dtype=dtype, variant=variant, favor=favor, arch=f"sm_{arch}", triton=triton.__version__,
                   config={k: v for k, v in cfg.items() if k != "num_warps"} | {"num_warps": cfg["num_warps"]})
        key = (arch, name, dtype, favor, json.dumps(row["config"], sort_keys=True))
        if key in seen:  # the same binary in two variants (the stabiliser): Triton's cache would
            rows.append(dict(seen[key], variant=variant))  # give no ptxas log, so no registers
            continue
        t = time.perf_counter()
        try:
            kernel, log = compile_one(fn, dtype, favor, cfg, arch)
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        else:
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            smem = int(kernel.metadata.shared)
            limit = SM_LIMITS[arch]["smem_block"]
            regs = regs and int(regs.group(1))
            row.update(ok=smem <= limit, shared_bytes=smem, registers=regs,
                       spill_store_bytes=spill and int(spill.group(1)), spill_load_bytes=spill and int(spill.group(2)),
                       blocks_per_sm=blocks_per_sm(arch, regs or 0, cfg["num_warps"], smem),
                       instructions=matrix_instructions(kernel.asm.get("ptx", "")))
            if smem > limit:
                row["error"] = f"shared memory {smem} B > sm_{arch}'s {limit} B per block"
        row["seconds"] = round(time.perf_counter() - t, 2)
        rows.append(row)
        seen[key] = row
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--dtype", choices=sorted(_TL), help="compile one input dtype's kernels only")
    ap.add_argument("--shard", default="0/1", help="i/n: compile every n-th build from the i-th (parallel runs)")
    ap.add_argument("--arch", type=int, action="append", choices=ARCHS,
                    help="compute capability to build for (repeatable; default: all of 80, 90)")
    ap.add_argument("--builds", choices=("all", "ci"), default="all",
                    help="ci: every build on sm_90, the bf16 tensor-core ones on sm_80 (what the test suite builds)")
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
    if not os.environ.get("TRITON_CACHE_DIR"):  # a cache hit gives no ptxas log (no registers, no spills)
        import tempfile

        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="linear_rope-aot-")
    rows = run(args.dtype, shard, tuple(args.arch or ARCHS), args.builds)
    releases = {r["triton"] for r in rows} - set(BF16_SPILLS_BY_TRITON)
    if releases:
        print(f"aot: Triton {', '.join(sorted(releases))} has no recorded bf16 targets (BF16_SPILLS_BY_TRITON): "
              f"its builds are reported, not judged", file=sys.stderr)
    for r in rows:
        ins = ", ".join(f"{k} {v}" for k, v in r.get("instructions", {}).items() if v)
        what = (f"{r['shared_bytes']:>7} B smem, {r['registers']} regs, spills {r['spill_store_bytes']}/"
                f"{r['spill_load_bytes']} B, {r['blocks_per_sm']} blocks/SM; {ins}" if "shared_bytes" in r else r["error"])
        miss = bf16_misses(r)
        what += f"; bf16 targets missed: {'; '.join(miss)}" if miss else ""
        tag = r["dtype"] + ("/tc" if r["variant"] == TC else "")
        print(f"{r['arch']} {r['kernel']:<13} {tag:<12} favor={r['favor']!s:<5} {what}  ({r['seconds']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
