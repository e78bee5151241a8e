"""The fused path's self-check (``linear_rope/ops/fused/selfcheck.py``) with its kernel launch
replaced: a launch that fails or gives wrong results sends the specialization to the
chunk-parallel path with one warning line; a forced ``fused`` backend raises instead; while
tracing, a stored result decides. The check with the real kernels (Triton's interpreter):
``test_fused_kernel.py``."""
from __future__ import annotations

import importlib.util
import types
import warnings

import pytest
import torch

from linear_rope.ops import api, rotary_linear_attention
from linear_rope.ops.backend import choose, record_paths, use_backend
from linear_rope.ops.fused import selfcheck
from linear_rope.ops.fused.selfcheck import NOT_CHECKED, Spec

FP32 = Spec(torch.float32, False, 16, 20, 16, True, False, False)
SPECS = [FP32, Spec(torch.bfloat16, True, 16, 20, 24, True, True, True),
         Spec(torch.float32, True, 16, 12, 16, False, False, True), Spec(torch.float16, False, 16, 20, 16, True, True, False)]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(autouse=True)
def fresh():
    selfcheck.clear()
    yield
    selfcheck.clear()


def _boom(*args):
    raise RuntimeError("PTXASError: ptxas fatal: out of registers\n(more lines)")


def _as_parallel(scale=1.0):
    """A stand-in for the fused launch: the chunk-parallel path, its output times ``scale``."""
    def call(q, k, v, kw, lowp):
        out, S, z = selfcheck._parallel_call(q, k, v, kw, lowp)
        return out * scale, S, z
    return call


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 70, 16, generator=g), torch.randn(1, 2, 70, 16, generator=g)
    return q.to(dtype), k.to(dtype), torch.randn(1, 2, 70, 16, generator=g).to(dtype), torch.randn(20, 16, generator=g)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_the_check_passes_results_within_the_dtype_s_contract_and_fails_wrong_ones(monkeypatch, spec):
    """The chunk-parallel path in the launch's place passes in every dtype's contract; its output
    5% off fails, naming the tensor."""
    monkeypatch.setattr(selfcheck, "_fused_call", _as_parallel())
    assert selfcheck.run_check(spec, torch.device("cpu")) is None
    monkeypatch.setattr(selfcheck, "_fused_call", _as_parallel(1.05))
    assert selfcheck.run_check(spec, torch.device("cpu")).startswith("out: ")


def test_a_failed_launch_sends_the_specialization_to_the_parallel_path_with_one_warning(monkeypatch):
    """Checked once (two calls, one check), one warning line; ``choose`` then takes the
    chunk-parallel path and records why."""
    runs = []
    monkeypatch.setattr(selfcheck, "_fused_call", lambda *a: runs.append(1) or _boom())
    with pytest.warns(RuntimeWarning) as caught:
        why = selfcheck.verdict(FP32, torch.device("cpu"), forced=False)
        assert selfcheck.verdict(FP32, torch.device("cpu"), forced=False) == why
    assert len(runs) == 1 and len(caught) == 1
    msg = str(caught[0].message)
    assert "\n" not in msg and "RuntimeError: PTXASError: ptxas fatal: out of registers" in msg
    assert "chunk-parallel path" in msg and str(FP32) in msg
    q = types.SimpleNamespace(is_cuda=True, device=torch.device("cpu"))
    with record_paths() as paths:
        assert choose(q, causal=True, packed=False, transformed=False, eager=True, fused_refusal=why) == "parallel"
    assert paths == [f"parallel path (auto: CUDA tensors; not fused: {why})"]


def test_results_are_keyed_on_the_specialization_and_the_device(monkeypatch):
    seen = []
    monkeypatch.setattr(selfcheck, "run_check", lambda spec, dev: seen.append((spec, str(dev))))
    for spec in SPECS + [FP32._replace(d=32), FP32._replace(mask=True), FP32._replace(rotary=False)]:
        for dev in ("cpu", "cuda:0", "cuda:1", "cpu"):
            selfcheck.verdict(spec, torch.device(dev), forced=False)
    assert len(seen) == len(set(seen)) == (len(SPECS) + 3) * 3


@needs_triton
def test_a_forced_fused_backend_raises_one_line_instead(monkeypatch):
    """``LINEAR_ROPE_BACKEND=fused`` (CPU tensors let through by the interpreter's switch): the
    failed check is a one-line ValueError at the call, and no warning."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(selfcheck, "_fused_call", _boom)
    q, k, v, w = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_backend("fused"), pytest.raises(ValueError) as err:
            rotary_linear_attention(q, k, v, projection=w)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("backend 'fused' was forced, but the fused kernels failed their self-check")


def test_while_tracing_a_stored_result_decides(monkeypatch):
    """Under tracing or capture no check runs: none stored is ``NOT_CHECKED`` (nothing stored);
    a stored pass or failure is returned as it is, without a warning."""
    monkeypatch.setattr(selfcheck, "capturing", lambda: True)
    monkeypatch.setattr(selfcheck, "run_check", lambda *a: pytest.fail("a check ran while tracing"))
    dev = torch.device("cuda:0")
    assert selfcheck.verdict(FP32, dev, forced=False) == NOT_CHECKED and not selfcheck._RESULTS
    selfcheck._RESULTS[selfcheck._key(FP32, dev)] = None
    assert selfcheck.verdict(FP32, dev, forced=False) is None
    bad = FP32._replace(e=24)
    selfcheck._RESULTS[selfcheck._key(bad, dev)] = "out: 3 x the float32 tolerance"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "out: 3 x the float32 tolerance" in selfcheck.verdict(bad, dev, forced=False)


@needs_triton
def test_under_torch_compile_nothing_stored_takes_the_parallel_path_and_a_stored_pass_the_fused_one(monkeypatch):
    """``torch.compile`` of the op (``LINEAR_ROPE_BACKEND=fused``, CPU tensors through the
    interpreter's switch): with no result stored the graph holds the chunk-parallel path, recorded
    with the reason, and no check runs; with a pass stored it holds the fused op (stubbed)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "fused")
    monkeypatch.setattr(selfcheck, "run_check", lambda *a: pytest.fail("a check ran while tracing"))
    q, k, v, w = _qkv()
    torch._dynamo.reset()
    with record_paths() as paths:
        out = torch.compile(lambda q, k, v: rotary_linear_attention(q, k, v, projection=w), backend="eager",
                            fullgraph=True)(q, k, v)
    with use_backend("parallel"):
        assert torch.allclose(out, rotary_linear_attention(q, k, v, projection=w), rtol=1e-5, atol=1e-6)
    assert paths and paths[0] == f"parallel path (LINEAR_ROPE_BACKEND=fused; not fused: {NOT_CHECKED})"
    selfcheck._RESULTS[selfcheck._key(selfcheck.Spec(torch.float32, False, 16, 20, 16, True, False, False),
                                      torch.device("cpu"))] = None
    monkeypatch.setattr(api, "_fused", lambda q, k, v, a, opts, lowp: torch.full_like(v, 7.0))
    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v: rotary_linear_attention(q, k, v, projection=w), backend="eager",
                        fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(out, torch.full_like(v, 7.0))


@needs_triton
def test_check_backend_checks_the_specializations_it_is_given(monkeypatch):
    """``check_backend(specs=...)`` on CUDA: under ``auto`` the bf16-arithmetic ones are checked
    (a failure warns), under ``fused`` every one (a failure is a one-line ValueError)."""
    from linear_rope.ops.backend import check_backend

    seen = []
    monkeypatch.setattr(selfcheck, "run_check", lambda spec, dev: seen.append(spec) or "out: 9 x the float32 tolerance")
    bf16 = Spec(torch.bfloat16, True, 16, 20, 16, True, False, False)
    with pytest.warns(RuntimeWarning, match="self-check"):
        assert check_backend("cuda", specs=[FP32, bf16]) == "auto"
    assert seen == [bf16]
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "fused")
    with pytest.raises(ValueError, match="^LINEAR_ROPE_BACKEND=fused: the fused kernels failed their self-check") as err:
        check_backend("cuda", specs=[FP32])
    assert "\n" not in str(err.value) and seen == [bf16, FP32]


def test_pricing_only_takes_every_specialization_as_passed_and_stores_nothing():
    """benchmarks.gpu_predict compiles for a fake GPU, where no check can run."""
    from linear_rope.ops.fused import selfcheck

    spec = selfcheck.Spec(torch.bfloat16, True, 64, 266, 64, True, False, False)
    before = dict(selfcheck._RESULTS)
    with selfcheck.pricing_only():
        assert selfcheck.verdict(spec, "cuda:7", forced=False) is None
    assert selfcheck._RESULTS == before
