"""Kernel-by-kernel triage of the Triton path on a GPU: which launch faults, under which config.

    python -m benchmarks.gpu_triage --out $OUT/triage.json      # on the device, about 3 minutes

Each case runs in its own process (a CUDA fault poisons the process that meets it) with
``CUDA_LAUNCH_BLOCKING=1``; every ``_launch`` of ``linear_rope.ops.triton.chunk`` prints its kernel's
name before and its build (registers, spills, shared memory) and a synchronize after, so the
last name printed is the launch that faulted. Cases vary one knob of ``pick_config`` at a time
(stages, warps, GEMM precision, m, N) so the fault's cause shows in which cases pass.
The first GPU run (docs/gpu.md, "The first window") is what this was written for.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = {  # name -> (dtype, m, N, config overrides for every kernel group)
    "fp32": ("float32", 266, 200, {}),
    "bf16": ("bfloat16", 266, 200, {}),  # the default config (dispatch.BF16_TENSOR_CORES)
    "fp16": ("float16", 266, 200, {}),
    "bf16_tc": ("bfloat16", 266, 200, {"tc": True}),  # bf16 tensor cores: bf16x3 / bf16w3
    "bf16_tc_stages1": ("bfloat16", 266, 200, {"tc": True, "num_stages": 1}),
    "bf16_tc_warps8": ("bfloat16", 266, 200, {"tc": True, "num_warps": 8}),
    "bf16_tc_m32_n64": ("bfloat16", 32, 64, {"tc": True}), "fp32_stages1": ("float32", 266, 200, {"num_stages": 1}),
    "fp32_warps8": ("float32", 266, 200, {"num_warps": 8}),
    "fp32_ieee": ("float32", 266, 200, {"PREC": "ieee", "SPREC": "ieee", "XPREC": "ieee"}),
    "fp32_tf32": ("float32", 266, 200, {"PREC": "tf32", "SPREC": "tf32", "XPREC": "tf32"}),
    "fp32_m32_n64": ("float32", 32, 64, {}),
    "bf16_tc_plain": ("bfloat16", 266, 200, {"tc": True, "PREC": "bf16", "SPREC": "bf16", "XPREC": "tf32x3"}),
}


def child(name: str) -> None:
    import torch

    from linear_rope import FavorFeatures
    from linear_rope.ops.triton import chunk as CH
    from linear_rope.ops.triton import dispatch

    dt, m, N, over = CASES[name]
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run under TRITON_INTERPRET=1

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()
    dtype = getattr(torch, dt)
    base = dispatch.pick_config

    def pick(d):
        cfg = base(d, bf16_tensor_cores=over.get("tc"))
        for grp in cfg.values():
            for key, val in over.items():
                if key == "tc":
                    continue
                if key in grp or key in ("num_stages", "num_warps"):
                    grp[key] = val
        return cfg
    CH.pick_config = pick

    def launch(kname, kernel, grid, *args, **kw):
        print(f"launch {kname} grid={grid}", flush=True)
        k = kernel[grid](*args, **kw)
        sync()
        info = {a: getattr(k, a, None) for a in ("n_regs", "n_spills")}
        info["shared"] = getattr(getattr(k, "metadata", None), "shared", None)
        print(f"ok {kname} {json.dumps(info)}", flush=True)
    CH._launch = launch
    torch.manual_seed(0)
    W = FavorFeatures(64, m).projection.to(dev)
    q, k, v = (torch.randn(1, 2, N, 64, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    out = CH.rotary_linear_attention(q, k, v, projection=W)
    out.float().sum().backward()
    sync()
    from linear_rope.ops.api import rotary_linear_attention as torch_op
    from linear_rope.ops.triton import use_backend
    with use_backend("torch"):
        r = torch_op(q.detach().double(), k.detach().double(), v.detach().double(), projection=W.double())
    err = ((out.double() - r).abs().max() / r.abs().max()).item()
    print(f"PASS max_rel_to_max={err:.3g}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--case", help="run this one case here (what each child process does)")
    p.add_argument("--out", default="triage.json")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    p.add_argument("--timeout-s", type=float, default=170)
    a = p.parse_args()
    bad = [c for c in ([a.case] if a.case else a.cases.split(",")) if c not in CASES]
    if bad:
        p.error(f"unknown case(s) {bad}; choose from {', '.join(CASES)}")
    if a.case:
        child(a.case)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    t0 = time.time()
    procs = {n: subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_triage", "--case", n], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in a.cases.split(",")}
    res = {}
    for n, pr in procs.items():
        try:
            outp, _ = pr.communicate(timeout=max(1.0, a.timeout_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            pr.kill()
            outp, _ = pr.communicate()
        lines = outp.strip().splitlines()
        launches = [ln for ln in lines if ln.startswith(("launch ", "ok "))]
        res[n] = {"case": CASES[n], "rc": pr.returncode, "passed": any(ln.startswith("PASS") for ln in lines),
                  "launches": launches, "tail": lines[-6:]}
        print(n, "rc", pr.returncode, "|", " / ".join(launches[-2:])[:300], "|", (lines[-1] if lines else "")[:200],
              flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
