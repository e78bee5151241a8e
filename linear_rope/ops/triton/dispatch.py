"""Which path a call takes, the Triton kernels or the torch ops, and the fallback when the kernels
cannot run. Imports Triton only when a call could take the kernels.

``should_use_triton(q, k, v, **kwargs)`` is the one question the op asks: the backend comes from
``force`` (``"torch"``, ``"parallel"``, ``"triton"``, ``"auto"``), else the ``LINEAR_ROPE_BACKEND``
environment variable, else ``"auto"``; ``takes_parallel`` the second.

* ``auto`` takes the chunk-parallel path (``ops/parallel.py``) for CUDA tensors, and the torch
  path's block walk on other devices (the fastest there). The Triton kernels are opt-in: ``auto``
  takes them only once a GPU run in this process has measured them faster than the chunk-parallel
  path (``note_triton_measured``), and then only for CUDA tensors of at most ``AUTO_KERNEL_ROWS`` query rows (B * H * N:
  above that a GPU measured the torch path faster) where they can run: Triton imports, its version
  is one the kernels are tested with (``TRITON_TESTED``), the GPU's compute capability is one the
  kernels were built and checked for (``CAPABILITIES``: the sm_80 and sm_90 builds of
  ``aot.py``) and ``supports`` accepts the call. Where Triton is installed but fails one of
  those checks, or a kernel later fails to build or launch (``KernelError``), the call takes
  the torch path and one line on stderr names the reason, once per reason per process.
* ``triton`` takes the kernels wherever ``supports`` accepts (on the CPU that needs
  ``TRITON_INTERPRET=1``, set before Triton is imported) and raises with the reason otherwise,
  and when a kernel fails: never a silent fallback. An untested Triton version or capability is
  tried when forced.
* ``torch`` never takes them: the block walk of ``ops/chunk_op.py`` on any device.
* ``parallel`` takes the chunk-parallel path on any device (so that the CPU can test and count it).
* ``fla`` takes neither: the op sends every call to the fla-core path (``ops/fla_path.py``),
  which raises with the reason for a call it does not take. ``auto`` never picks fla: no GPU has
  timed it yet (the first run's op-speed part ran out of time before its cells).

``record_paths`` collects the path each call takes (the trainer names it in its first lines).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import sys

import torch

__all__ = ["AUTO_KERNEL_ROWS", "BACKENDS", "note_triton_measured", "takes_parallel", "BF16_TENSOR_CORES", "CAPABILITIES", "ENV_VAR", "GPU_DTYPES",
           "MAX_HEAD_DIM", "TRITON_TESTED", "KernelError", "record_paths", "dispatch_configs", "fallback",
           "fallbacks", "kernel_status", "pick_config", "should_use_triton", "supports", "triton_available",
           "use_backend", "check_backend"]

ENV_VAR = "LINEAR_ROPE_BACKEND"
BACKENDS = ("auto", "torch", "parallel", "triton", "fla")
MAX_HEAD_DIM = 64  # d and e, padded to this (the paper's 64): the ahead-of-time builds check this size
NUM_STAGES = 2  # the block loop's loads (projection rows, chunk states) pipelined one block ahead
NUM_WARPS = 4  # 128 threads per program: the chunk-parallel grid has NT x BH programs to fill the SMs
CHUNK = 64  # tokens per chunk: 64-row tiles (sm_90's wgmma takes M = 64)
PAIRS = 8  # rotation pairs per block of the chunk-parallel kernels (16 features: m = 266 is 17 blocks); the
# products over a block's features take its even and odd halves interleaved (K = 16). With 16 pairs
# the sm_90 bf16 builds spilled and the sm_80 fp16 / bf16 dq build outgrew shared memory.
STATE_PAIRS = 16  # and of the state passes (32 features x 32 values of state per program)
STATE_VALUES = 32  # value columns per state-pass program (fewer registers, twice the programs on the serial part)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton releases the kernels are tested with (CI: the interpreter tests under both; the
# ahead-of-time sm_80 / sm_90 builds under the oldest): older ones fall back, newer ones too
# unless forced.
TRITON_TESTED = ((3, 6), (3, 9))
# Compute capabilities the kernels are built and checked for (``aot.py``'s targets).
CAPABILITIES = ((8, 0), (9, 0))


class KernelError(RuntimeError):
    """A Triton kernel failed to build or to launch (shared memory, registers, a driver error)."""


def triton_available() -> bool:
    """Triton is installed (it is not imported here; see ``kernel_status`` for whether it works)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _version_tuple(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.lru_cache(maxsize=None)
def _triton_import() -> tuple[str | None, str]:
    """(version, "") if ``import triton`` and the kernels' module work, else (None, why)."""
    if not triton_available():
        return None, "triton is not installed (pip install 'linear_rope[triton]')"
    try:
        import triton

        from . import kernels  # noqa: F401 - decorating the kernels is the first use of triton.language
    except Exception as e:  # noqa: BLE001 - a broken install raises anything at import
        return None, f"triton failed to import ({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})"
    return str(getattr(triton, "__version__", "0.0")), ""


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device (None for other devices)."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def kernel_status(device: torch.device | None = None, *, forced: bool = False) -> tuple[bool, str]:
    """(True, "triton kernels (sm_90, triton 3.6.0)") where the kernels can run on ``device``
    (a CUDA device; None: the interpreter), else (False, the reason). ``forced``: an untested
    newer Triton or capability is allowed (``LINEAR_ROPE_BACKEND=triton``)."""
    version, why = _triton_import()
    if version is None:
        return False, why
    vt = _version_tuple(version)
    if vt < TRITON_TESTED[0]:
        return False, (f"triton {version} is too old: the kernels are tested with "
                       f"{', '.join('%d.%d' % v for v in TRITON_TESTED)}")
    if vt > TRITON_TESTED[-1] and not forced:
        return False, (f"triton {version} is newer than the releases the kernels are tested with "
                       f"({', '.join('%d.%d' % v for v in TRITON_TESTED)}); LINEAR_ROPE_BACKEND=triton tries it")
    cap = None if device is None else _gpu_capability(device)
    if cap is None:
        return True, f"triton kernels (interpreter, triton {version})"
    arch = f"sm_{cap[0]}{cap[1]}"
    if cap not in CAPABILITIES and not forced:
        return False, (f"compute capability {cap[0]}.{cap[1]} ({arch}): the kernels are built and checked for "
                       f"{', '.join('sm_%d%d' % c for c in CAPABILITIES)} only; LINEAR_ROPE_BACKEND=triton tries it")
    return True, f"triton kernels ({arch}, triton {version})"


_FALLBACKS: dict[str, int] = {}  # reason -> calls that fell back for it, in order of first occurrence


def fallback(reason: str) -> None:
    """Record that a call took the torch ops (the chunk-parallel path on CUDA, else the torch
    path) because the kernels could not run, and say so on stderr the first time a reason
    occurs in this process (one line)."""
    if reason not in _FALLBACKS:
        print(f"linear_rope: warning: Triton kernels unavailable, using the torch ops: {reason}", file=sys.stderr,
              flush=True)
    _FALLBACKS[reason] = _FALLBACKS.get(reason, 0) + 1


def fallbacks() -> dict[str, int]:
    """The fallback reasons of this process (reason -> number of calls), oldest first."""
    return dict(_FALLBACKS)


# ``auto`` takes the kernels on CUDA up to this many query rows (B * H * N), the largest size a GPU
# measured them faster at: on the H200 (benchmarks/results/h200), B = 1, H = 12, N = 1024, bf16,
# fwd+bwd took 3.30 ms on the kernels, 11.2 ms on the torch path; the `paper` preset's training
# step (B * H * N = 16 * 12 * 1024) ran 1.29x faster on the torch path (91146 vs 70589
# tokens/s). Between the two sizes nothing was measured yet.
AUTO_KERNEL_ROWS = 12 * 1024

# Whether a GPU run in this process measured the Triton kernels faster than the chunk-parallel path
# (``note_triton_measured``): until then ``auto`` does not pick them.
_TRITON_MEASURED_FASTER = False


def note_triton_measured(faster: bool) -> None:
    """A GPU run in this process timed the Triton kernels against the chunk-parallel path: with
    ``faster`` True, ``auto`` takes the kernels for the CUDA calls they take (up to
    ``AUTO_KERNEL_ROWS``); False, it keeps the chunk-parallel path."""
    global _TRITON_MEASURED_FASTER
    _TRITON_MEASURED_FASTER = bool(faster)


def takes_parallel(q: torch.Tensor, name: str | None = None) -> bool:
    """Whether the backend (``name``, else ``backend()``) sends a call on ``q`` to the
    chunk-parallel path: ``parallel`` anywhere, ``auto`` for CUDA tensors."""
    name = backend() if name is None else name
    return name == "parallel" or (name == "auto" and _on_gpu(q))

# bf16 inputs on bf16 tensor cores ("bf16x3" / "bf16w3"): the first GPU run (an H200, Triton 3.6.0,
# benchmarks/results/gpu_triage.json) met an illegal memory access in the dk, dv kernel (and in
# the dq kernel with plain bf16 products) where every fp32 config passed; until a bf16
# tensor-core build passes on a GPU, bf16 inputs take fp16's TF32x3 config (exact, slower).
BF16_TENSOR_CORES = False


def pick_config(dtype: torch.dtype, *, bf16_tensor_cores: bool | None = None) -> dict:
    """The kernels' launch parameters: one config per input dtype, chosen here on the CPU (no
    autotune, so the interpreter and the ahead-of-time builds see exactly what runs).

    ``chunk`` (the chunk-parallel kernels): C = 64 tokens per chunk, BP = 8 rotation pairs per
    block (m = 266 is 133 pairs: 17 blocks, 2% padding), BD = BE = 64 (d and e padded to 64, the
    paper's head size; smaller heads pay for the padding), 4 warps, 2 stages. ``state`` (the
    two state passes): the same chunks, blocks of 16 pairs and 32 value columns. ``qmax``: the
    stabiliser's kernel. The ahead-of-time builds (``aot.py``, docs/gpu.md) check these.

    GEMM precision (see ``kernels.py``): ``XPREC`` for the FAVOR+ exponent products, TF32x3
    (about fp32) for every GPU dtype; ``PREC`` for the rest: bf16 operands for bf16 inputs (the
    bf16 tensor cores; held to the bf16 tolerances under the emulation), TF32x3 for fp16 and
    fp32 inputs (fp16 carries TF32's 10 mantissa bits, so TF32 round-off in the products
    doubled its error: 4x float32-rounded-to-fp16 in dk, dv under the emulation); float64 (the
    interpreter only) runs "ieee"."""
    tc = BF16_TENSOR_CORES if bf16_tensor_cores is None else bf16_tensor_cores
    bf16 = "bf16x3" if tc else "tf32x3"
    prec = {torch.float16: "tf32x3", torch.bfloat16: bf16, torch.float32: "tf32x3"}.get(dtype, "ieee")
    xprec = "tf32x3" if dtype in GPU_DTYPES else "ieee"
    fx = "bf16w3" if dtype == torch.bfloat16 and tc else xprec  # bf16 tensor cores: exact bf16 exponent products
    common = dict(C=CHUNK, BD=MAX_HEAD_DIM, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return dict(chunk=dict(common, BP=PAIRS, BE=MAX_HEAD_DIM, PREC=prec, SPREC=prec, XPREC=fx),
                state=dict(common, BP=STATE_PAIRS, BV=STATE_VALUES, PREC=prec, SPREC=prec, XPREC=fx),
                qmax=dict(common, BP=STATE_PAIRS, XPREC=xprec))


def dispatch_configs() -> list[tuple[torch.dtype, dict]]:
    """Every (input dtype, config) the dispatch can pick on CUDA: what the ahead-of-time builds build."""
    return [(dt, pick_config(dt)) for dt in GPU_DTYPES]


def supports(q, k, v, *, causal=True, rotary=True, offset=0, base=10000.0, projection=None, mask=None,
             key_mask=None, cu_seqlens=None, initial_state=None, output_final_state=False, allow_negative=False,
             chunk_size=None, block_size=None, **_) -> tuple[bool, str]:
    """(True, "") if the Triton kernels compute this call, else (False, the reason): the calls the
    kernels do not take go to the torch path, which takes every call. Argument errors are not
    judged here: the op's checks raise them on either path. Whether Triton works on this
    machine is ``kernel_status``'s question."""
    if not (_on_gpu(q) or _interpreting()):
        return False, f"tensors on {q.device.type}: the kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)"
    if not triton_available():
        return False, "triton is not installed (pip install 'linear_rope[triton]')"
    if key_mask is not None or k.shape[2] != q.shape[2]:
        return False, "cross-attention (key_mask, or k of another length) is bidirectional only (torch path)"
    if not causal:
        return False, "causal=False: the bidirectional closed form is a few GEMMs already (torch path)"
    if cu_seqlens is not None:
        return False, "cu_seqlens (packed documents) is not implemented in the kernels"
    if chunk_size is not None or block_size is not None:
        return False, "chunk_size / block_size apply to the torch path (the kernels pick their own chunk)"
    if q.dtype not in GPU_DTYPES and not (q.dtype == torch.float64 and _interpreting()):
        return False, f"dtype {q.dtype}: the kernels take float16, bfloat16 and float32 (float64: the interpreter only)"
    if q.numel() == 0 or v.numel() == 0:
        return False, "an empty batch or head dim: nothing for a kernel to do (torch path)"
    d, e = q.shape[-1], v.shape[-1]
    if (projection is not None and d > MAX_HEAD_DIM) or e > MAX_HEAD_DIM:
        return False, f"head dims d={d}, e={e}: the kernels take d, e <= {MAX_HEAD_DIM}"
    return True, ""


_OVERRIDE: list[str] = []  # use_backend's stack (innermost last)


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, calls take backend ``name`` ("auto", "torch", "parallel", "triton" or "fla") as if
    ``LINEAR_ROPE_BACKEND`` said so: e.g. to time both paths through the public op."""
    if name not in BACKENDS:
        raise ValueError(f"use_backend: name must be one of {BACKENDS}, got {name!r}")
    _OVERRIDE.append(name)
    try:
        yield
    finally:
        _OVERRIDE.pop()


def backend(force: str | None = None) -> str:
    """``force``, else ``use_backend``'s, else ``LINEAR_ROPE_BACKEND``, else "auto"; ValueError
    for another name."""
    name = force if force is not None else _OVERRIDE[-1] if _OVERRIDE else \
        os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} / force must be one of {BACKENDS}, got {name!r}")
    return name


_RECORDERS: list[list[str]] = []


@contextlib.contextmanager
def record_paths():
    """Within the block, every causal op call appends the path it takes to the yielded list:
    "triton kernels (sm_90, triton 3.6.0)", "parallel path (<reason>)" or "torch path (<reason>)"
    (the trainer's probe)."""
    paths: list[str] = []
    _RECORDERS.append(paths)
    try:
        yield paths
    finally:
        _RECORDERS.remove(paths)


def record(path: str, replace: bool = False) -> None:
    """Note the path a call took, for ``record_paths`` (a no-op outside it); ``replace``: it
    corrects the last note (a kernel that failed after the call chose it)."""
    for paths in _RECORDERS:
        if replace and paths:
            paths[-1] = path
        else:
            paths.append(path)


def _decide(q, k, v, force, kwargs) -> tuple[bool, str]:
    name = backend(force)
    if name == "fla":  # the op routes fla calls before asking; here it means: not the Triton kernels
        return False, "fla path (forced)"
    if name == "torch":
        return False, f"torch path ({ENV_VAR}=torch)" if not force and not _OVERRIDE else "torch path (forced)"
    if name == "parallel":
        return False, f"parallel path ({ENV_VAR}=parallel)" if not force and not _OVERRIDE else "parallel path (forced)"
    if name == "auto" and _on_gpu(q) and not _TRITON_MEASURED_FASTER:
        return False, ("parallel path (auto on CUDA: the Triton kernels are opt-in until a run in this process "
                       "measures them faster)")
    other = "parallel path" if takes_parallel(q, name) else "torch path"  # where a call the kernels do not take goes
    ok, why = supports(q, k, v, **kwargs)
    if name == "triton" and not ok:
        raise ValueError(f"backend 'triton' was forced, but {why}")
    if not ok:
        return False, f"{other} ({why})"
    if name == "auto" and not _on_gpu(q):
        return False, f"{other} (tensors on {q.device.type}: the kernels run on CUDA)"
    rows = q.shape[:-1].numel()
    if name == "auto" and rows > AUTO_KERNEL_ROWS:
        return False, f"{other} (auto: B*H*N = {rows} > {AUTO_KERNEL_ROWS}, where a GPU measured it faster)"
    ready, why = kernel_status(q.device if _on_gpu(q) else None, forced=name == "triton")
    if not ready:
        if name == "triton":
            raise ValueError(f"backend 'triton' was forced, but {why}")
        if triton_available():  # installed but unusable: say so; not installed is the plain torch path
            fallback(why)
        return False, f"{other} ({why})"
    return True, why


def should_use_triton(q, k, v, *, force: str | None = None, **kwargs) -> bool:
    """True when the call should take the Triton kernels (see the module docstring). ``kwargs``:
    the op's keyword arguments. Raises ValueError for an unknown backend, or when ``triton`` is
    forced for a call the kernels do not take or cannot run (with the reason). In ``auto``, a
    CUDA call the kernels take but cannot run here falls back (``fallback``)."""
    use, path = _decide(q, k, v, force, kwargs)
    if _RECORDERS:
        record(path)
    return use


def check_backend(device: torch.device | str | None = None) -> str:
    """The backend ``LINEAR_ROPE_BACKEND`` names (as ``backend()`` reads it), checked once at a
    program's start for work on ``device`` (None: CUDA if available, else the CPU); ValueError,
    one line, for a value that run could not use: a name the op does not know, ``triton``
    without a CUDA device or ``TRITON_INTERPRET=1``, or where Triton cannot run the kernels
    (not installed, too old), ``fla`` without a CUDA device or fla-core. Every other backend
    runs on any device."""
    try:
        name = backend()
    except ValueError:
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r} is not a backend: use one of "
                         f"{', '.join(BACKENDS)}, or unset it") from None
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    where = f"this run is on {dev.type}"
    if name == "triton":
        if dev.type != "cuda" and not _interpreting():
            raise ValueError(f"{ENV_VAR}=triton: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 "
                             f"on the CPU) and {where}; unset {ENV_VAR} or set it to auto or torch")
        ok, why = kernel_status(dev if dev.type == "cuda" else None, forced=True)
        if not ok:
            raise ValueError(f"{ENV_VAR}=triton: {why}")
    elif name == "fla":
        if dev.type != "cuda":
            raise ValueError(f"{ENV_VAR}=fla: fla-core's kernels need a CUDA device and {where}; unset {ENV_VAR} "
                             f"or set it to auto or torch")
        if importlib.util.find_spec("fla") is None:
            raise ValueError(f"{ENV_VAR}=fla: fla-core is not installed (pip install 'linear_rope[fla]')")
    return name
