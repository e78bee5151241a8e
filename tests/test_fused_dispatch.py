"""Which calls the fused path takes (``backend.choose`` with ``fused.fused_refusal``), without
running its kernels: never CPU tensors under ``auto``; a forced ``fused`` backend refuses with the
reason; the start check wants CUDA. The kernels themselves: ``test_fused_kernel.py``."""
from __future__ import annotations

import types

import pytest
import torch

from linear_rope.ops import rotary_linear_attention
from linear_rope.ops.backend import check_backend, choose, record_paths, use_backend
from linear_rope.ops.fused import fused_refusal, supports_fused
from linear_rope.ops.utils import Options, check_args


def _args(q, k, v, **kw):
    opts = Options(causal=True, rotary=True, offset=0, base=10000.0, projection=kw.get("projection"),
                   mask=kw.get("mask"), key_mask=None, cu_seqlens=None, initial_state=None, allow_negative=False,
                   output_final_state=False)
    return check_args(q, k, v, opts)


def _qkv(dtype=torch.float32, d=16, e=16, m=20):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, 10, d, generator=g).to(dtype), torch.randn(1, 2, 10, d, generator=g).to(dtype),
            torch.randn(1, 2, 10, e, generator=g).to(dtype), torch.randn(m, d, generator=g))


def test_auto_never_takes_cpu_tensors():
    q, k, v, w = _qkv(torch.bfloat16)
    with record_paths() as paths:
        rotary_linear_attention(q, k, v, projection=w)
    assert paths == ["torch path (auto: tensors on cpu)"]


def test_forced_fused_refuses_cpu_tensors_with_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, w = _qkv(torch.bfloat16)
    with use_backend("fused"), pytest.raises(ValueError, match="backend 'fused' was forced, but tensors on cpu"):
        rotary_linear_attention(q, k, v, projection=w)


def test_forced_fused_keeps_the_rules_of_every_backend():
    """Bidirectional calls take the closed form, packed documents the torch path."""
    q, k, v, w = _qkv()
    with use_backend("fused"), record_paths() as paths:
        rotary_linear_attention(q, k, v, projection=w, causal=False)
        rotary_linear_attention(q, k, v, projection=w, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))
    assert paths == ["torch path (forced)"]  # (bidirectional calls record no path)


def test_what_the_fused_path_takes():
    q, k, v, w = _qkv()
    a = _args(q, k, v, projection=w)
    assert supports_fused(q, k, v, w, a, True) is None
    assert "features given" in supports_fused(q.abs(), k.abs(), v, None, _args(q.abs(), k.abs(), v), True)
    assert "causal=False" in supports_fused(q, k, v, w, a, False)
    q2, k2, v2, w2 = _qkv(d=144)
    assert "d = 144" in supports_fused(q2, k2, v2, w2, _args(q2, k2, v2, projection=w2), True)
    q3, k3, v3, w3 = _qkv(e=200)
    assert "e = 200" in supports_fused(q3, k3, v3, w3, _args(q3, k3, v3, projection=w3), True)
    big = torch.empty(1, 1, 1, 16).expand(64, 64, 64 * 1024, 16)
    assert "GiB" in supports_fused(big, big, big, w, a, True)
    q4, k4, v4, w4 = (t.double() for t in _qkv())
    assert "dtype" in supports_fused(q4, k4, v4, w4, _args(q4, k4, v4, projection=w4), True)


def test_auto_takes_bf16_arithmetic_only(monkeypatch):
    import linear_rope.ops.fused as fused

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets CPU tensors through the device check; nothing runs
    monkeypatch.setattr(fused, "triton_available", lambda: True)  # the rule holds whether triton is here or not
    q, k, v, w = _qkv()
    a = _args(q, k, v, projection=w)
    assert "float32 arithmetic" in fused_refusal(q, k, v, w, a, True, lowp=False, forced=False)
    assert fused_refusal(q, k, v, w, a, True, lowp=False, forced=True) is None
    assert fused_refusal(q, k, v, w, a, True, lowp=True, forced=False) is None
    assert "block_size" in fused_refusal(q, k, v, w, a, True, lowp=True, forced=False, sizes=True)


def test_choose_on_cuda_tensors():
    """``auto`` on CUDA tensors: the fused path where it takes the call, else the parallel path
    with the reason recorded."""
    q = types.SimpleNamespace(is_cuda=True, device=torch.device("cpu"))
    with record_paths() as paths:
        assert choose(q, causal=True, packed=False, transformed=False, eager=True, fused_refusal=None) == "fused"
        assert choose(q, causal=True, packed=False, transformed=False, eager=True, fused_refusal="why") == "parallel"
        assert choose(q, causal=True, packed=True, transformed=False, eager=True, fused_refusal=None) == "torch"
        assert choose(q, causal=True, packed=False, transformed=True, eager=False, fused_refusal=None) == "composite"
    assert paths[:2] == ["fused path (auto: CUDA tensors)", "parallel path (auto: CUDA tensors; not fused: why)"]
    with use_backend("parallel"):
        assert choose(q, causal=True, packed=False, transformed=False, eager=False, fused_refusal=None) == "parallel"


def test_the_start_check_wants_cuda_for_fused(monkeypatch):
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "fused")
    with pytest.raises(ValueError, match="fused Triton kernels need a CUDA device"):
        check_backend("cpu")


def test_projection_operands_follow_every_write():
    """The fused path's projection operands are made at every call (docs/caches.md): a write
    through ``.data`` (no version counter moves) is seen at the next call."""
    op = pytest.importorskip("linear_rope.ops.fused.op", reason="triton is not installed")
    w = torch.randn(20, 16)
    first = op._projection_of(w, True)
    assert first[0].dtype == torch.bfloat16 and first[0].shape == (20, 16)
    w.data.mul_(2)
    again = op._projection_of(w, True)
    assert torch.equal(again[0].float(), 2 * first[0].float())
    assert not hasattr(op, "_PROJECTIONS")
