"""The fused kernels built for sm_90 without a GPU: shared memory, registers and spills of each,
as the launches configure them (``python -m linear_rope.ops.fused.sm90 [bf16|fp32] [d] [e]``).
``triton.compile`` of each kernel for ``GPUTarget("cuda", 90, 32)``, then the wheel's ``ptxas -v``
on its PTX (Triton 3.6; newer Triton's PTX may need ``ptxas-blackwell``). Whether ``tl.dot``
became ``wgmma`` is read from the PTX.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import launch
from .backward import _dden, _dqkv, _dstates
from .forward import _output, _states

_F32 = {"c", "cos", "sin", "S0", "z0", "zb", "Sn", "zn", "den", "rmax", "dden", "dSn", "dzn", "dza", "dS0", "dz0"}


def _signature(fn, consts, dt, lowp):
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ("q", "k", "v", "do", "out", "dq", "dk", "dv"):
            sig[n] = "*" + dt
        elif n in ("wa", "wb", "Sb", "dSa"):
            sig[n] = "*bf16" if lowp else "*fp32"
        elif n == "mask":
            sig[n] = "*i8"
        elif n in _F32:
            sig[n] = "*fp32"
        else:
            sig[n] = "fp32" if n == "ksc" else "i32"
    return sig


def build(fn, consts: dict, dt: str, lowp: bool, num_warps: int, num_stages: int) -> dict:
    k = triton.compile(ASTSource(fn=fn, signature=_signature(fn, consts, dt, lowp), constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    return dict(shared=k.metadata.shared, registers=int(regs[0]) if regs else None,
                spill_bytes=int(spill[0]) if spill else None, wgmma="wgmma" in k.asm["ptx"])


def report(dt: str = "bf16", d: int = 64, e: int = 64) -> dict:
    lowp = dt == "bf16"
    stages = 3 if lowp else 1
    base = dict(FLOOR=launch.FLOOR, C=launch.C, BM=launch.BM, BD=launch._p2(d), BE=launch._be(e), ROTARY=True,
                LOWP=lowp, MASK=False)
    nofloor = {k: v for k, v in base.items() if k != "FLOOR"}
    return {
        "_states": build(_states, dict(base, INIT=True), dt, lowp, 8, stages),
        "_output": build(_output, base, dt, lowp, 8, 2 if lowp else 1),
        "_dden": build(_dden, dict(C=launch.C, BE=launch._be(e), MASK=False), dt, lowp, 8, stages),
        "_dstates": build(_dstates, dict(nofloor, FINAL_S=True, FINAL_Z=True), dt, lowp, 8, stages),
        "_dqkv (dq)": build(_dqkv, dict(base, BE=launch._p2(e), DQ=True), dt, lowp, 8, stages),
        "_dqkv (dk, dv)": build(_dqkv, dict(base, BE=launch._p2(e), DQ=False), dt, lowp, 8, stages),
    }


if __name__ == "__main__":
    a = sys.argv[1:]
    for name, r in report(a[0] if a else "bf16", int(a[1]) if len(a) > 1 else 64, int(a[2]) if len(a) > 2 else 64).items():
        print(name, r)
