"""The fused path's Triton kernels (``linear_rope/ops/fused``) in Triton's interpreter, against
the float64 reference: outputs, final states S and z, and the gradients of q, k, v and of the
initial state, in float32, float16 and bfloat16 (the interpreter computing bf16 as the GPU does:
``fused_interp``).

The interpreter is switched on when a kernel is decorated, so the checks run in a process of
their own (``fused_check.py``, once for all cases); this process keeps its Triton as it is.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from linear_rope.ops.tolerances import HALF_CONTRACT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: the fused kernels need it (interpreted here)")

HERE = os.path.dirname(os.path.abspath(__file__))
FP32 = dict(out=1e-5, S=1e-5, z=1e-5, dq=1e-4, dk=1e-4, dv=1e-4, dS0=1e-4, dz0=1e-4)  # tolerances.tolerance(float32)
BF16_VS_PARALLEL = 1.25  # bf16: the error at most this times the chunk-parallel path's on the same inputs
CASES = ("fp32", "fp32_rows_mask", "fp32_n1", "fp32_norot_odd_m_e65", "fp32_m266", "fp32_strided_state_only",
         "fp32_large_qk",
         "fp16", "fp16_mask", "bf16", "bf16_rows_mask", "bf16_m266", "bf16_d128_e65")


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, os.path.join(HERE, "fused_check.py"), *CASES], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("fp32") and c != "fp32_large_qk"])
def test_float32_matches_float64(results, case):
    for name, err in results[case]["tensors"].items():
        assert err["rel"] <= FP32[name], (case, name, err)


def test_large_q_k_no_worse_than_the_parallel_path(results):
    """|q|, |k| 4x: key exponents past the floor (clamped), exponents near 80 in float32; finite,
    and no further from float64 than the chunk-parallel path in float32."""
    for name, err in results["fp32_large_qk"]["tensors"].items():
        assert err["rel"] <= 2 * err["par_rel"] + FP32[name], (name, err)


@pytest.mark.parametrize("case", ["fp16", "fp16_mask"])
def test_float16_within_the_half_contract(results, case):
    """float16 computes in float32: outputs and gradients (float16) within HALF_CONTRACT of the
    float64 result rounded to float16; the states (float32) as float32's."""
    for name, err in results[case]["tensors"].items():
        if name in ("S", "z", "dS0", "dz0"):
            assert err["rel"] <= FP32[name], (case, name, err)
        else:
            assert err["rel"] <= HALF_CONTRACT * err["rounded"] + FP32[name], (case, name, err)


@pytest.mark.parametrize("case", ["bf16", "bf16_rows_mask", "bf16_m266", "bf16_d128_e65"])
def test_bfloat16_as_the_parallel_path(results, case):
    """bf16 operands, float32 accumulation: the errors against float64 (max and Frobenius) those
    of the chunk-parallel path's bf16 arithmetic on the same inputs, within BF16_VS_PARALLEL."""
    for name, err in results[case]["tensors"].items():
        assert err["fro"] <= BF16_VS_PARALLEL * err["par_fro"] + 1e-6, (case, name, err)
        assert err["rel"] <= BF16_VS_PARALLEL * err["par_rel"] + 1e-6, (case, name, err)


def test_the_public_op_forced_to_the_fused_path(results):
    """``LINEAR_ROPE_BACKEND=fused`` through ``rotary_linear_attention`` (CPU tensors in the
    interpreter): recorded, the direct call's results and dtypes; a bf16 autocast of float32
    inputs gives the bf16 call's output unrounded; a call it does not take is refused; double
    backward is a one-line RuntimeError."""
    r = results["_dispatch"]
    assert r["paths"] == ["fused path (forced)"] and r["same"], r
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32"], r
    assert r["autocast_dtype"] == "torch.float32" and r["autocast_vs_bf16"] <= 2 ** -8, r
    assert r["refused"].startswith("backend 'fused' was forced, but features given"), r
    assert r["double_backward"].startswith("rotary_linear_attention: double backward"), r


def test_each_specialization_checks_itself_once_against_the_parallel_path(results):
    """The kernels in the interpreter pass their self-check (``fused/selfcheck.py``): the forced
    calls of ``dispatch_checks`` stored a pass for each specialization they took (bf16; float32
    under a bf16 autocast), and the float16 and float32 checks run here pass."""
    r = results["_selfcheck"]
    assert r["stored"] == {"bfloat16 d=16 m=20 e=16 rotary=True mask=False initial_state=True": None,
                           "float32 (bf16 arithmetic) d=16 m=20 e=16 rotary=True mask=False initial_state=True": None}, r
    checked = {n: x for n, x in r.items() if n != "stored"}
    assert len(checked) == 2 and all(x["why"] is None for x in checked.values()), r


def test_a_small_model_trains_as_on_the_torch_path():
    """``PerformerLM`` (the tiny preset with d = 16, seq_len 256: 4 chunks of 64), AdamW, 20 steps,
    the same seed and batches, on the torch path and with the fused kernels in the interpreter
    (``fused_train.py``: ``LINEAR_ROPE_BACKEND=fused``, float32): every loss within 0.5%."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, os.path.join(HERE, "fused_train.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["torch"]["paths"] == ["torch path (forced)"] and r["fused"]["paths"] == ["fused path (forced)"], r
    assert r["checks_stored"] == 1, r
    ref, got = r["torch"]["losses"], r["fused"]["losses"]
    assert len(ref) == len(got) == 20, r
    worst = max(abs(f - t) / t for f, t in zip(got, ref))
    assert worst <= 0.005, (worst, ref, got)


def test_torch_compile_sees_the_kernels():
    """Traced with fake tensors (``fused_trace.py``, an sm_90 target named, no GPU): the forward
    graph AOTAutograd compiles holds the two forward kernels as ``triton_kernel_wrapper_functional``
    (the triton_op's body, visible to Inductor), and the joint graph both ops (autograd
    registered)."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, os.path.join(HERE, "fused_trace.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["forward"] == ["triton_kernel_wrapper_functional"] * 2, r
    assert sorted(set(r["joint"])) == ["linear_rope.fused_backward.default", "linear_rope.fused_forward.default"], r
