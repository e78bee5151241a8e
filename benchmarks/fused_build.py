"""Triton kernels built ahead of time for sm_90 on a machine without a GPU: registers, spills,
shared memory, tensor-core instructions and programs per SM, kernel by kernel.

    python -m benchmarks.fused_build                       # the fused kernels (benchmarks/fused_kernels.py)
    python -m benchmarks.fused_build --all                 # ... every launchable specialization
    python -m benchmarks.fused_build --toy                 # the toy tl.dot kernel (a self-check)
    python -m benchmarks.fused_build --builds module:BUILDS [--json out.json]

Each build is ``(name, jit function, signature, constexprs, options)``: the signature maps every
non-constexpr argument to its Triton type ("*bf16", "*fp32", "i32", ...), pointers taken as
16-byte aligned (torch's allocations are), "i32:16" an integer divisible by 16 (as Triton
specializes one at a launch); ``options`` e.g. num_warps, num_stages. It is built
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` (the ptxas of the
Triton wheel: no GPU or driver needed), in a fresh cache (a cache hit gives no ptxas log).
Per build: registers and spill bytes (ptxas's log), shared memory (the kernel's metadata), the
``mma`` / ``wgmma`` instructions of its PTX by operand type, and programs resident per SM from
those and the SM's limits. The fused kernels' pricing (linear_rope/ops/fused/pricing.py)
assumes one program a SM; a build with more would run its grid in fewer waves.

A smaller form of the removed kernels' ``aot.py`` (commit d4a32e6's parent,
linear_rope/ops/triton/aot.py). Exit 1 when a build fails or needs more shared memory than an
H100 block has.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import sys
import tempfile

# sm_90 per SM: registers, shared memory (bytes; 1 KB a block reserved), the opt-in maximum a
# block, threads, resident blocks (CUDA programming guide, compute capabilities)
_UNSHOWN = ("FLOOR", "C", "BM")  # constexprs the same in every fused build: left out of the table
SM90 = dict(regs=65536, smem=233_472, smem_block=232_448, threads=2048, blocks=32)


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int, lim=SM90) -> int:
    """Resident programs per SM: registers allocated per warp in units of 256, shared memory per
    program plus the 1 KB reserved, threads, the block limit."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = lim["regs"] // (per_warp * num_warps) if registers else lim["blocks"]
    by_smem = lim["smem"] // (shared_bytes + 1024)
    return int(min(by_regs, by_smem, lim["threads"] // (32 * num_warps), lim["blocks"]))


def matrix_instructions(ptx: str) -> dict:
    """{"mma.bf16": n, "wgmma.bf16": n, ...}: the tensor-core instructions of a PTX by operand type."""
    counts: dict[str, int] = {}
    pat = r"\b(wgmma\.mma_async\.sync|mma\.sync)\.aligned\.[\w.]*?\.(f32|f16|s32)\.(tf32|bf16|f16|e4m3|e5m2|s8)\b"
    for m in re.finditer(pat, ptx):
        key = f"{'wgmma' if m.group(1).startswith('wgmma') else 'mma'}.{m.group(3)}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def compile_one(fn, signature: dict, constexprs: dict, options: dict, arch: int = 90):
    """``fn`` built for sm_<arch>: (the compiled kernel, ptxas's log)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: ("constexpr" if n in constexprs else signature[n].split(":")[0]) for n in names}
    div = {n for n in names if sig[n].startswith("*") or signature.get(n, "").endswith(":16")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in div}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    triton.knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))
    return kernel, log.getvalue()


def build(builds, arch: int = 90) -> list[dict]:
    """One row a build: name, config, registers, spill bytes, shared memory, tensor-core
    instructions, programs per SM; ``ok`` False with ``error`` where it did not build."""
    rows = []
    for name, fn, signature, constexprs, options, *label in builds:
        shown = {k: v for k, v in constexprs.items() if k not in _UNSHOWN}
        row = {"kernel": name, "arch": f"sm_{arch}", "config": {**(label[0] if label else {}), **shown, **options}}
        try:
            kernel, log = compile_one(fn, signature, constexprs, options, arch)
        except Exception as e:  # noqa: BLE001 - reported per build
            row.update(ok=False, error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
            rows.append(row)
            continue
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        smem = int(kernel.metadata.shared)
        regs = int(regs.group(1)) if regs else None
        warps = int(options.get("num_warps", kernel.metadata.num_warps))
        ins = matrix_instructions(kernel.asm.get("ptx", ""))
        row.update(ok=smem <= SM90["smem_block"], registers=regs, spill_store_bytes=spill and int(spill.group(1)),
                   spill_load_bytes=spill and int(spill.group(2)), shared_bytes=smem, instructions=ins,
                   mma=any(k.startswith("mma") for k in ins), wgmma=any(k.startswith("wgmma") for k in ins),
                   programs_per_sm=programs_per_sm(regs or 0, warps, smem))
        if not row["ok"]:
            row["error"] = f"shared memory {smem} B > sm_90's {SM90['smem_block']} B a block"
        rows.append(row)
    return rows


# -- the toy kernel: one tl.dot, the self-check (and the tests') -----------------------------

def _toy():
    import triton
    import triton.language as tl

    @triton.jit
    def toy_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        i, j, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + i[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + j[None, :])
        tl.store(c_ptr + i[:, None] * N + j[None, :], tl.dot(a, b))
    return toy_dot


def toy_builds():
    fn = _toy()
    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32"}
    return [("toy_dot", fn, sig, {"M": 64, "N": 64, "K": 64}, {"num_warps": 4}),
            ("toy_dot", fn, sig, {"M": 128, "N": 128, "K": 64}, {"num_warps": 8, "num_stages": 2})]


def table(rows) -> str:
    lines = [f"{'kernel':<20} {'config':<72} {'regs':>5} {'spill st/ld B':>14} {'smem B':>8} {'mma':>4} "
             f"{'wgmma':>5} {'progs/SM':>8}"]
    for r in rows:
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())
        if not r.get("shared_bytes") and not r.get("ok"):
            lines.append(f"{r['kernel']:<20} {cfg:<72} {r['error']}")
            continue
        lines.append(f"{r['kernel']:<20} {cfg:<72} {r['registers']!s:>5} "
                     f"{r['spill_store_bytes']!s:>6}/{r['spill_load_bytes']!s:<7} {r['shared_bytes']:>8} "
                     f"{'yes' if r['mma'] else 'no':>4} {'yes' if r['wgmma'] else 'no':>5} {r['programs_per_sm']:>8}")
    return "\n".join(lines)


def markdown(rows) -> str:
    """The rows as a markdown table (docs/gpu.md): config, registers, spill stores, shared memory,
    tensor-core instructions, programs per SM."""
    out = ["| kernel | config | regs | spill B | smem B | tensor cores | progs/SM |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
        if "registers" not in r:
            out.append(f"| {r['kernel']} | {cfg} | {r.get('error', '')} | | | | |")
            continue
        tc = ", ".join(f"{k} {v}" for k, v in sorted(r["instructions"].items())) or "none"
        out.append(f"| {r['kernel']} | {cfg} | {r['registers']} | {r['spill_store_bytes']} | {r['shared_bytes']} "
                   f"| {tc} | {r['programs_per_sm']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fused_build", allow_abbrev=False,
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default=None,
                    help="module:NAME, a list of (name, jit fn, signature, constexprs, options) "
                         "(default: the fused kernels, a representative subset)")
    ap.add_argument("--all", action="store_true", help="the fused kernels: every launchable specialization")
    ap.add_argument("--dims", default=None, help="the fused kernels: d and e, comma-separated (default 16,32,64,128)")
    ap.add_argument("--pairs", default=None, help="the fused kernels: (d, e) pairs d:e, comma-separated (instead of --dims)")
    ap.add_argument("--kernels", default=None, help="the fused kernels: comma-separated names (default all)")
    ap.add_argument("--toy", action="store_true", help="the toy tl.dot kernel")
    ap.add_argument("--dtypes", default=None, help="the fused kernels: comma-separated, of "
                    "bf16, fp16, fp16-fp32, fp32 (default all)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.exit(2, "fused_build: error: unset TRITON_INTERPRET (the build needs Triton's compiler)\n")
    try:
        import triton  # noqa: F401
    except ImportError:
        ap.exit(2, "fused_build: error: needs triton (pip install \"linear_rope[predict]\")\n")
    if a.builds:
        mod, _, attr = a.builds.partition(":")
        try:
            builds = getattr(importlib.import_module(mod), attr or "BUILDS")
        except (ImportError, AttributeError) as e:
            ap.exit(2, f"fused_build: error: {a.builds}: {e}\n")
    elif a.toy:
        builds = toy_builds()
    else:
        from benchmarks import fused_kernels
        builds = fused_kernels.builds(full=a.all, dtypes=a.dtypes.split(",") if a.dtypes else None,
                                      dims=tuple(int(x) for x in a.dims.split(",")) if a.dims else fused_kernels.DIMS,
                                      pairs=[tuple(map(int, p.split(":"))) for p in a.pairs.split(",")] if a.pairs else None)
        if a.kernels:
            builds = [b for b in builds if b[0] in a.kernels.split(",")]
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="linear_rope-fused-build-"))
    rows = build(builds)
    print(markdown(rows) if a.markdown else table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
