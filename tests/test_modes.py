"""Every mode after every other: the op (torch and parallel backends), the layer, the model's
forward, ``generate``, the ``Decoder`` and the Hugging Face model, each called under
``inference_mode``, ``no_grad``, a bfloat16 autocast and plain, in every order of two. Each call
equals the same call made first in a fresh process (or gives the same one-line refusal);
``torch.compile`` and ``torch.jit.trace`` pairs on the op and the layer give the same results, or
one refusal from every path.

One subprocess per target (``python tests/test_modes.py TARGET``): it forks a child per mode
before any call (a fresh process as far as every cache of the package goes) for the reference,
then walks one sequence of calls in which every ordered pair of modes occurs, each call compared
with its mode's reference.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "no_grad", "inference", "autocast")
# every ordered pair of the four modes occurs once as neighbours (a de Bruijn sequence, 17 calls)
# (inference first: what a buffer or cache made under inference_mode leaves for the calls after)
SEQUENCE = ["inference", "plain", "autocast", "no_grad", "no_grad", "inference", "no_grad", "autocast", "inference",
            "inference", "autocast", "autocast", "plain", "plain", "no_grad", "plain", "inference"]
TARGETS = ("op_torch", "op_parallel", "layer", "model", "generate", "decoder", "hf")


def _mode(name):
    import torch

    return {"plain": contextlib.nullcontext(), "no_grad": torch.no_grad(), "inference": torch.inference_mode(),
            "autocast": torch.autocast("cpu", dtype=torch.bfloat16)}[name]


def _target(name):
    """A function of no arguments: what the call returns (tensors, detached), with the gradients
    of a plain call's inputs (where it has any) or its one-line refusal as a string."""
    import torch

    from linear_rope import PerformerLM, RotaryLinearAttention, rotary_linear_attention
    from linear_rope.decode import Decoder
    from linear_rope.ops.backend import use_backend

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name.startswith("op_"):
        backend = name[3:]
        q, k, v = (torch.randn(2, 2, 70, 8, generator=g) for _ in range(3))
        w = torch.randn(12, 8, generator=g)

        def call():
            qq, kk, vv = (t.clone().requires_grad_(torch.is_grad_enabled()) for t in (q, k, v))
            with use_backend(backend):
                out, st = rotary_linear_attention(qq, kk, vv, projection=w, output_final_state=True)
            grads = torch.autograd.grad(out.float().square().sum(), (qq, kk, vv)) if out.requires_grad else ()
            return [out, st.S, st.z, *grads]
        return call
    if name == "layer":
        layer = RotaryLinearAttention(32, heads=2, dim_head=16)
        x = torch.randn(2, 70, 32, generator=g)

        def call():
            layer.zero_grad(set_to_none=True)
            out = layer(x)
            if out.requires_grad:
                out.float().square().sum().backward()
                return [out, layer.to_qkv.weight.grad.clone()]
            return [out]
        return call
    model = PerformerLM.from_preset("tiny", position="rope").eval()
    ids = torch.randint(0, 256, (2, 40), generator=g)
    if name == "model":
        def call():
            model.zero_grad(set_to_none=True)
            logits, states = model(ids, output_final_state=True)
            out = [logits, *[t for s in states for t in (s.S, s.z)]]
            if logits.requires_grad:
                logits.float().square().mean().backward()
                out.append(model.head.weight.grad.clone())
            return out
        return call
    if name == "generate":
        return lambda: [torch.tensor(list(model.generate(b"the rotary ", 8, top_k=1)))]
    if name == "decoder":
        dec = Decoder(model, 2, 48, compile=False)

        def call():
            logits = [dec.prefill(ids[:, :30])]
            tok = logits[-1].argmax(-1)
            for _ in range(4):
                logits.append(dec.step(tok))
                tok = logits[-1].argmax(-1)
            return logits
        return call
    if name == "hf":
        from linear_rope.hf import LinearRopeForCausalLM

        hf = LinearRopeForCausalLM.from_performer(model).eval()
        return lambda: [hf(input_ids=ids).logits]
    raise ValueError(name)


def _run(call):
    import torch

    try:
        out = call()
    except Exception as e:  # noqa: BLE001 -- a refusal: compared as its one line
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in out]


def _same(got, want, tol: float) -> str | None:
    import torch

    if isinstance(got, str) or isinstance(want, str):
        return None if got == want else f"{got!r} != {want!r}"
    if len(got) != len(want):
        return f"{len(got)} results, {len(want)} wanted"
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"result {i}: {a.dtype} {tuple(a.shape)}, wanted {b.dtype} {tuple(b.shape)}"
        if not torch.allclose(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=True):
            return f"result {i}: off by {(a.double() - b.double()).abs().max().item():.3g}"
    return None


def _fresh(name: str, mode: str):
    """The call under ``mode`` made first in a child forked before any call."""
    import pickle

    import torch

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: build, one call, send, exit
        os.close(r)
        try:
            call = _target(name)
            with _mode(mode):
                res = _run(call)
            buf = io.BytesIO()
            torch.save(res, buf)
            data = buf.getvalue()
        except BaseException as e:  # noqa: BLE001
            data = pickle.dumps(f"child failed: {type(e).__name__}: {e}")
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return torch.load(io.BytesIO(data), weights_only=False)


def main(name: str) -> int:
    import torch

    torch.set_num_threads(1)  # (before any op: no thread pool is forked)
    want = {m: _fresh(name, m) for m in MODES}
    for m, w in want.items():
        if isinstance(w, str) and w.startswith("child failed"):
            print(f"{name}: the fresh {m} call: {w}")
            return 1
    call = _target(name)
    bad = []
    for i, m in enumerate(SEQUENCE):
        with _mode(m):
            got = _run(call)
        why = _same(got, want[m], 0 if m != "autocast" else 1e-6)
        if why:
            bad.append(f"call {i} ({SEQUENCE[i - 1] if i else 'first'} -> {m}): {why}")
    print("\n".join(bad) or f"{name}: {len(SEQUENCE)} calls, every order of two modes, as fresh")
    return 1 if bad else 0


@pytest.mark.parametrize("target", TARGETS)
def test_every_mode_after_every_other_equals_a_fresh_call(target):
    if target == "hf":
        pytest.importorskip("transformers", reason="the hf extra (transformers)")
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    p = subprocess.run([sys.executable, __file__, target], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


# -- torch.compile and torch.jit.trace on the op and the layer ----------------------------------------

@pytest.mark.parametrize("what", ["op_torch", "op_parallel", "layer"])
def test_jit_trace_is_one_refusal_from_every_path(what):
    import torch

    from linear_rope import RotaryLinearAttention, rotary_linear_attention
    from linear_rope.ops.backend import use_backend

    torch.manual_seed(0)
    x = torch.randn(2, 70, 32)
    q, k, v = (torch.randn(1, 2, 70, 8) for _ in range(3))
    layer = RotaryLinearAttention(32, heads=2, dim_head=16)
    backend = what[3:] if what.startswith("op_") else "torch"
    fn, args = ((lambda a, b, c: rotary_linear_attention(a, b, c)), (q.abs(), k.abs(), v)) if what != "layer" \
        else (layer, (x,))
    with use_backend(backend), pytest.raises(RuntimeError, match="jit.trace cannot record the causal paths"):
        torch.jit.trace(fn, args, check_trace=False)
    for b in ("torch", "parallel"):  # and the same calls after the refusal, as before it
        with use_backend(b):
            torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("what", ["op_parallel", "layer"])
def test_compiled_then_eager_then_compiled_agree(what):
    """A compiled call between eager ones (and the reverse): each equals its fresh counterpart."""
    import torch

    from linear_rope import RotaryLinearAttention, rotary_linear_attention
    from linear_rope.ops.backend import use_backend

    torch.manual_seed(0)
    if what == "layer":
        layer = RotaryLinearAttention(32, heads=2, dim_head=16)
        x = torch.randn(2, 70, 32)
        eager, args = layer, (x,)
    else:
        w = torch.randn(12, 8)
        args = tuple(torch.randn(2, 2, 70, 8) for _ in range(3))

        def eager(q, k, v):
            with use_backend("parallel"):
                return rotary_linear_attention(q, k, v, projection=w)
    compiled = torch.compile(eager, dynamic=False)
    first = eager(*args).detach()
    outs = [compiled(*args).detach(), eager(*args).detach(), compiled(*args).detach(), eager(*args).detach()]
    for i, o in enumerate(outs):
        torch.testing.assert_close(o, first, rtol=1e-4, atol=1e-5, msg=f"call {i}")
    with torch.inference_mode():  # and under inference mode, after the compiled calls
        torch.testing.assert_close(eager(*args), first, rtol=0, atol=0)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1]))
