"""Every way the Triton kernels can fail to run falls back to the torch ops (on CUDA the
chunk-parallel path) with one warning line and their correct result, and ``LINEAR_ROPE_BACKEND=triton`` raises instead:
Triton not importable, too old, a compute capability the kernels were not built for, a kernel
that fails to build, and one that fails to launch (forward or backward).

The CPU has no CUDA, so "a CUDA call" is simulated: ``dispatch._on_gpu`` answers True for these
CPU tensors and ``dispatch._gpu_capability`` gives the capability under test (the kernels then
run in Triton's interpreter, as in test_triton.py).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.language is imported (see conftest.py)
triton = pytest.importorskip("triton", reason="triton is not installed (pip install '.[triton]')")

import linear_rope  # noqa: E402
from linear_rope.features import FavorFeatures  # noqa: E402
from linear_rope.ops import naive_rotary_linear_attention  # noqa: E402
from linear_rope.ops.triton import chunk as triton_chunk  # noqa: E402
from linear_rope.ops.triton import dispatch  # noqa: E402
from linear_rope.ops.triton import chunk_kernels as CK  # noqa: E402

IMPORT = dispatch._triton_import  # cached: cleared around each test
WARNING = "linear_rope: warning: Triton kernels unavailable, using the torch ops"


@pytest.fixture
def gpu(monkeypatch):
    """CPU tensors treated as a CUDA call on an sm_90 GPU; fresh fallback records and caches."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "_on_gpu", lambda t: True)
    monkeypatch.setattr(dispatch, "_gpu_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "_FALLBACKS", {})
    monkeypatch.setattr(dispatch, "_TRITON_MEASURED_FASTER", True)  # as if this process timed them faster
    IMPORT.cache_clear()
    calls = []
    real = triton_chunk.rotary_linear_attention
    monkeypatch.setattr(triton_chunk, "rotary_linear_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    yield calls
    IMPORT.cache_clear()


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    w = FavorFeatures(8, 10).projection.double()
    q, k, v = (torch.randn(2, 2, 37, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :4] = False
    return (q, k, v), dict(projection=w, mask=mask, offset=torch.tensor([0, 9]), output_final_state=True)


def _run_and_compare(capsys, expect: str):
    """The public op (and its gradients) equal the float64 reference; exactly one warning line,
    naming ``expect``, on stderr, and the fallback is on record."""
    (q, k, v), kw = _case()
    out, st = linear_rope.rotary_linear_attention(q, k, v, **kw)
    up = torch.randn_like(out)
    grads = torch.autograd.grad((out * up).sum() + st.S.sum(), (q, k, v))
    out2, _ = linear_rope.rotary_linear_attention(q, k, v, **kw)  # a second call: no second warning
    ref, ref_st = naive_rotary_linear_attention(q, k, v, **kw)
    ref_grads = torch.autograd.grad((ref * up).sum() + ref_st.S.sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out2, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(WARNING) and expect in lines[0], lines
    assert any(expect in r for r in dispatch.fallbacks()), dispatch.fallbacks()


def test_the_simulated_gpu_takes_the_kernels(gpu, capsys):
    """The baseline of this file: with nothing broken, the simulated CUDA call runs the kernels
    (no fallback, no warning), and records its path."""
    (q, k, v), kw = _case()
    with dispatch.record_paths() as paths:
        out, _ = linear_rope.rotary_linear_attention(q, k, v, **kw)
    assert gpu and paths == [f"triton kernels (sm_90, triton {triton.__version__})"]
    torch.testing.assert_close(out, naive_rotary_linear_attention(q, k, v, **kw)[0], rtol=1e-10, atol=1e-10)
    assert not capsys.readouterr().err and not dispatch.fallbacks()


def test_auto_takes_the_parallel_path_until_the_kernels_are_measured_faster(gpu, capsys, monkeypatch):
    """On CUDA ``auto`` takes the chunk-parallel path (recorded, no warning: a choice) until a run
    in this process measures the kernels faster (``note_triton_measured``); then the kernels.
    Forcing ``triton`` takes them either way; on the CPU ``auto`` keeps the torch path."""
    monkeypatch.setattr(dispatch, "_TRITON_MEASURED_FASTER", False)
    (q, k, v), kw = _case()
    with dispatch.record_paths() as paths:
        out, _ = linear_rope.rotary_linear_attention(q, k, v, **kw)
        with dispatch.use_backend("triton"):
            linear_rope.rotary_linear_attention(q, k, v, **kw)
        dispatch.note_triton_measured(True)
        linear_rope.rotary_linear_attention(q, k, v, **kw)
        dispatch.note_triton_measured(False)
        linear_rope.rotary_linear_attention(q, k, v, **kw)
        monkeypatch.setattr(dispatch, "_on_gpu", lambda t: False)
        linear_rope.rotary_linear_attention(q, k, v, **kw)
    assert paths[0].startswith("parallel path (auto on CUDA") and paths[3] == paths[0], paths
    assert paths[1].startswith("triton kernels") and paths[2].startswith("triton kernels"), paths
    assert paths[4] == "torch path (tensors on cpu: the kernels run on CUDA)", paths
    assert len(gpu) == 2 and not capsys.readouterr().err and not dispatch.fallbacks()
    ref, _ = naive_rotary_linear_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_auto_takes_the_torch_path_above_the_measured_size(gpu, capsys, monkeypatch):
    """``auto`` takes the kernels up to ``AUTO_KERNEL_ROWS`` query rows (B*H*N), where a GPU
    measured them faster, and the chunk-parallel path above (no warning: a choice, not a fallback);
    forcing ``triton`` still takes them."""
    (q, k, v), kw = _case()  # B*H*N = 148
    monkeypatch.setattr(dispatch, "AUTO_KERNEL_ROWS", 148)
    with dispatch.record_paths() as paths:
        linear_rope.rotary_linear_attention(q, k, v, **kw)
        monkeypatch.setattr(dispatch, "AUTO_KERNEL_ROWS", 147)
        out, _ = linear_rope.rotary_linear_attention(q, k, v, **kw)
        with dispatch.use_backend("triton"):
            linear_rope.rotary_linear_attention(q, k, v, **kw)
    assert paths[0].startswith("triton kernels") and paths[2].startswith("triton kernels")
    assert paths[1] == "parallel path (auto: B*H*N = 148 > 147, where a GPU measured it faster)"
    assert len(gpu) == 2 and not capsys.readouterr().err and not dispatch.fallbacks()
    torch.testing.assert_close(out, naive_rotary_linear_attention(q, k, v, **kw)[0], rtol=1e-10, atol=1e-10)


def _break_triton(monkeypatch):
    """Triton installed but broken, as a wheel built for another CUDA or Python is: found, and
    ``import triton`` raises."""
    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise ImportError("libtriton.so: undefined symbol: cuLaunchKernelEx (simulated)")

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            return importlib.util.spec_from_loader(name, Loader()) if name == "triton" else None

    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])


def test_triton_not_importable(gpu, capsys, monkeypatch):
    _break_triton(monkeypatch)
    _run_and_compare(capsys, "triton failed to import (ImportError: libtriton.so")
    assert not gpu


def test_triton_too_old(gpu, capsys, monkeypatch):
    monkeypatch.setattr(dispatch, "_triton_import", lambda: ("3.1.0", ""))
    _run_and_compare(capsys, "triton 3.1.0 is too old")
    assert not gpu


def test_triton_newer_than_tested_falls_back_unless_forced(gpu, capsys, monkeypatch):
    monkeypatch.setattr(dispatch, "_triton_import", lambda: ("9.0.0", ""))
    _run_and_compare(capsys, "triton 9.0.0 is newer than the releases the kernels are tested with")
    assert not gpu
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")  # forced: tried
    (q, k, v), kw = _case()
    linear_rope.rotary_linear_attention(q, k, v, **kw)
    assert gpu


def test_compute_capability_too_low(gpu, capsys, monkeypatch):
    monkeypatch.setattr(dispatch, "_gpu_capability", lambda device: (7, 5))
    _run_and_compare(capsys, "compute capability 7.5 (sm_75)")
    assert not gpu


def test_kernel_that_fails_to_build(gpu, capsys, monkeypatch):
    """A real build failure: 48 pairs per program is not a power of two, which tl.arange refuses."""
    real = dispatch.pick_config

    def bad(dtype):
        cfg = real(dtype)
        cfg["state"]["BP"] = 48
        return cfg
    monkeypatch.setattr(triton_chunk, "pick_config", bad)
    _run_and_compare(capsys, "the state kernel failed to build or launch")
    assert gpu  # the kernels were tried, then the torch path answered


class _OutOfSharedMemory:
    """A kernel whose launch fails as a launch on a GPU with too little shared memory does."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise triton.runtime.errors.OutOfResources(262144, 232448, "shared memory")
        return launch


@pytest.mark.parametrize("kernel", ["_out_kernel", "_dv_kernel"])
def test_kernel_that_fails_to_launch(gpu, capsys, monkeypatch, kernel):
    """Forward: the call takes the torch path. Backward (the forward ran on the kernels): the
    gradients come from the torch path, recomputed from the saved inputs."""
    monkeypatch.setattr(CK, kernel, _OutOfSharedMemory())
    what = "the output kernel" if kernel == "_out_kernel" else "the dv kernel"
    _run_and_compare(capsys, f"{what} failed to build or launch (OutOfResources")
    assert gpu


@pytest.mark.parametrize("broken", ["import", "old", "capability", "launch"])
def test_forced_backend_raises_instead(gpu, monkeypatch, broken):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    if broken == "import":
        _break_triton(monkeypatch)
    elif broken == "old":
        monkeypatch.setattr(dispatch, "_triton_import", lambda: ("3.1.0", ""))
    elif broken == "capability":  # an untested capability is tried when forced; a failing launch raises
        monkeypatch.setattr(dispatch, "_gpu_capability", lambda device: (7, 5))
        monkeypatch.setattr(CK, "_out_kernel", _OutOfSharedMemory())
    else:
        monkeypatch.setattr(CK, "_dq_kernel", _OutOfSharedMemory())
    (q, k, v), kw = _case()
    with pytest.raises((ValueError, dispatch.KernelError), match="forced|failed to build or launch"):
        out, _ = linear_rope.rotary_linear_attention(q, k, v, **kw)
        out.sum().backward()
    assert not dispatch.fallbacks()


def test_trainer_names_the_path(tmp_path, corpus, monkeypatch):
    """The trainer's first lines name the attention path, and config.json records it."""
    import json

    from helpers import run_main

    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    code, _, err = run_main(["--preset", "tiny", "--variants", "rope", "--steps", "1", "--eval-every", "0",
                             "--data", str(corpus), "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "r")])
    assert code == 0, err
    head = err.splitlines()[:6]
    assert any("rope-seed0: attention: torch path (tensors on cpu" in ln for ln in head), head
    assert json.loads((tmp_path / "r/rope-seed0/config.json").read_text())["attention"].startswith("torch path")
