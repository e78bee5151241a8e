"""Inductor compiling for an H100 on a machine with no GPU and a CPU-only PyTorch: the harness
under ``benchmarks.gpu_predict``. Nothing here builds or runs a GPU kernel.

Three things stand between a CPU-only build and Inductor's CUDA code generation:

* autograd asks the device guard of every CUDA tensor for a stream, and ``at::getAccelerator``
  for the current one: a CPU-only build has neither. ``install()`` builds (once, with the system
  C++ compiler, about 2 s) and loads a 20-line library that registers c10's own
  ``FakeGuardImpl<CUDA>`` and marks the CUDA hooks as built. This changes the process for good,
  so run it in a process of its own (the predictor's command, its tests' subprocess).
* ``torch.cuda`` and Inductor's device interface ask the driver for the device: ``patched()``
  answers with an H100 SXM's properties (sm_90, 132 SMs) and keeps device moves on fake tensors.
* the generated module would compile its Triton kernels when loaded: ``patched()`` replaces
  that load with ``record()``, which keeps what Inductor scheduled (kernel by kernel, with its
  bytes) and returns a module that cannot run.

Inductor's choices that time kernels on the GPU are switched off (``INDUCTOR_CONFIG``): GEMM
padding (``shape_padding``, which benchmarks padded against unpadded GEMMs), max-autotune, and
the joint graph's constant folding (which evaluates constants on the device).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

import torch

H100_PROPS = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 * 2**30,
    regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
    shared_memory_per_block_optin=232448, L2_cache_size=50 * 2**20, gcnArchName="")
INDUCTOR_CONFIG = dict(fx_graph_cache=False, compile_threads=1, max_autotune=False, max_autotune_gemm=False,
                       shape_padding=False, joint_graph_constant_folding=False)

_SHIM = r"""
#include <cstring>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace {
struct BuiltCudaHooks final : at::CUDAHooksInterface {
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
};
static_assert(sizeof(BuiltCudaHooks) == sizeof(at::CUDAHooksInterface), "the same object, another vtable");
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_cuda_guard;
}
extern "C" int install_fake_cuda() {
  c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &fake_cuda_guard);
  auto& hooks = const_cast<at::CUDAHooksInterface&>(at::detail::getCUDAHooks());
  BuiltCudaHooks built;
  std::memcpy(static_cast<void*>(&hooks), static_cast<void*>(&built), sizeof(void*));
  return at::detail::getCUDAHooks().isBuilt();
}
"""
_INSTALLED = False


def install() -> None:
    """Give this CPU-only process a fake CUDA device guard and accelerator (see the docstring).
    RuntimeError (one line) where there is no C++ compiler or the build fails."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.version.cuda is not None:
        raise RuntimeError("the predictor needs a CPU-only PyTorch build (this one has CUDA); run it on a CPU machine")
    tdir = Path(torch.__file__).parent
    key = hashlib.sha256((_SHIM + torch.__version__ + str(tdir)).encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"linear_rope_fake_cuda_{key}.so"
    if not lib.exists():
        cxx = os.environ.get("CXX", "g++")
        src = lib.with_suffix(f".{os.getpid()}.cpp")
        tmp = lib.with_suffix(f".{os.getpid()}.so")
        src.write_text(_SHIM)
        cmd = [cxx, "-O1", "-shared", "-fPIC", "-std=c++17", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", f"-I{tdir / 'include'}",
               str(src), f"-L{tdir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{tdir / 'lib'}", "-o", str(tmp)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            why = getattr(e, "stderr", None) or str(e)
            raise RuntimeError(f"building the fake CUDA guard failed ({cxx}): {why.strip().splitlines()[-1][:200]}") \
                from None
        finally:
            src.unlink(missing_ok=True)
        os.replace(tmp, lib)  # atomic: a second process sees the whole library or none
    if not ctypes.CDLL(str(lib)).install_fake_cuda():
        raise RuntimeError("the fake CUDA hooks did not take")
    _INSTALLED = True


class Recorder:
    """What Inductor scheduled, graph by graph: ``graphs`` is a list of dicts (``backward``,
    ``inference``, ``nodes``: ``describe(node)`` of the scheduler's nodes after fusion, while the
    graph is current; ``code``: the wrapper's source; ``outputs``: the graph outputs' bytes)."""

    def __init__(self, describe=lambda node: node):
        self.graphs, self.describe = [], describe

    def record(self, graph, wrapper_code):
        nodes = [self.describe(n) for n in graph.scheduler.nodes]
        outs = []
        for o in graph.graph_outputs:
            try:
                outs.append(_numel(o.get_size()) * o.get_dtype().itemsize)
            except (AttributeError, NotImplementedError, TypeError):
                outs.append(0)
        self.graphs.append({"backward": bool(graph.is_backward), "inference": bool(graph.is_inference),
                            "nodes": nodes, "code": wrapper_code.value, "outputs": outs})
        mod = types.ModuleType("linear_rope_gpu_predict_unbuilt")
        mod.__file__ = os.devnull

        def call(*args, **kwargs):
            raise RuntimeError("this module was generated for a GPU and never built")
        mod.call = call
        return mod


def _numel(size) -> int:
    n = 1
    for s in size:
        n *= int(s)
    return n


def _constant_name(orig, fake_mode):
    """Inductor copies a CPU constant to the GPU at compile time: here a fake copy."""
    from torch._subclasses.fake_tensor import FakeTensor

    def constant_name(self, name, device_override):
        t = self.constants[name]
        if device_override is None or t.device == device_override or isinstance(t, FakeTensor):
            return orig(self, name, device_override)
        self.constants[name] = fake_mode.from_tensor(t)
        try:
            return orig(self, name, device_override)
        finally:
            self.constants[name] = t
    return constant_name


def _flash_sdpa(orig):
    """``F.scaled_dot_product_attention`` as CUDA runs it on an H100: without a mask, bf16 or
    fp16 (after autocast's cast), head size a multiple of 8 up to 256, flash attention (PyTorch's
    first choice there). A CPU-only build's choice would be the math fallback; anything else
    takes the original function."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not (q.is_cuda and attn_mask is None and not enable_gqa and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256):
            return orig(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if torch.is_autocast_enabled("cuda"):
            dt = torch.get_autocast_dtype("cuda")
            q, k, v = (t.to(dt) for t in (q, k, v))
        if q.dtype not in (torch.bfloat16, torch.float16):
            return orig(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    return sdpa


@contextlib.contextmanager
def patched(recorder: Recorder, fake_mode):
    """torch.cuda and Inductor as if an H100 were device 0, generated modules recorded unbuilt."""
    import torch._inductor.config as iconfig
    import torch.utils._triton as utriton
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.runtime.driver import driver as triton_driver
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    install()
    with contextlib.ExitStack() as st:
        def p(obj, name, value):
            st.enter_context(mock.patch.object(obj, name, value))
        zero = staticmethod(lambda *a: 0)
        for name, v in (("is_available", lambda: True), ("device_count", lambda: 1), ("current_device", lambda: 0),
                        ("get_device_properties", lambda d=None: H100_PROPS),
                        ("get_device_capability", lambda d=None: (9, 0)), ("_lazy_init", lambda: None),
                        ("get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8)),
                        ("set_rng_state", lambda s, device="cuda": None), ("_exchange_device", lambda d: 0),
                        ("_maybe_exchange_device", lambda d: 0), ("set_device", lambda d: None)):
            p(torch.cuda, name, v)
        for name, v in (("get_device_properties", staticmethod(lambda d=None: H100_PROPS)), ("current_device", zero),
                        ("device_count", staticmethod(lambda: 1)), ("is_available", staticmethod(lambda: True)),
                        ("exchange_device", zero), ("maybe_exchange_device", zero),
                        ("set_device", staticmethod(lambda d: None))):
            p(CudaInterface, name, v)
        p(utriton, "triton_backend", lambda: make_backend(GPUTarget("cuda", 90, 32)))
        # Triton's driver, asked for the target when a user kernel (triton_op) is analysed: sm_90
        p(triton_driver, "_active", types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
        p(utriton, "triton_hash_with_backend", lambda: "F" * 64)
        p(FakeTensorMode, "avoid_device_init", property(lambda self: True))
        p(GraphLowering, "constant_name", _constant_name(GraphLowering.constant_name, fake_mode))
        p(GraphLowering, "_compile_to_module_lines", lambda self, code: recorder.record(self, code))
        p(torch.compiler, "_is_compiling_flag", True)  # what the model's code sees under torch.compile
        p(torch.nn.functional, "scaled_dot_product_attention",
          _flash_sdpa(torch.nn.functional.scaled_dot_product_attention))
        st.enter_context(iconfig.patch(**INDUCTOR_CONFIG))
        st.enter_context(torch._functorch.config.patch(force_non_lazy_backward_lowering=True,
                                                       enable_autograd_cache=False))
        yield


def compile_for_gpu(fn, inputs, fake_mode, describe=lambda node: node) -> list[dict]:
    """Inductor's compilation of ``fn(*inputs)`` (fake CUDA tensors of ``fake_mode``; those that
    require grad get the backward too) for an H100: the recorded graphs, forward first."""
    from torch._inductor.compile_fx import compile_fx

    g = torch.fx.Graph()
    args = tuple(g.placeholder(f"arg{i}") for i in range(len(inputs)))
    g.output((g.call_function(fn, args),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    rec = Recorder(describe)
    with patched(rec, fake_mode):
        compile_fx(gm, list(inputs))
    return rec.graphs


def fake_cuda(fake_mode, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """A fake copy of ``t`` on cuda:0."""
    install()
    with fake_mode, torch.no_grad():
        f = fake_mode.from_tensor(t).to(torch.device("cuda", 0))
    return f.detach().requires_grad_(requires_grad)


if __name__ == "__main__":  # pragma: no cover - a smoke check: python -m benchmarks.gpu_fake_cuda
    install()
    print("fake CUDA installed:", torch._C._accelerator_getAccelerator(), file=sys.stderr)
