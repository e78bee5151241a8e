"""What PerformerLM and RotaryLinearAttention do with malformed inputs (one ValueError, one line,
naming the argument; they used to pass some silently or fail inside torch with a matmul's
message), and the value checks of the model on a CPU: on by default there, since reading a CPU
tensor costs no device sync (an id of 256 used to give NaN logits without a word), and the
GPU's rule (NaN, ``LINEAR_ROPE_CHECKS=1`` to check) where ``LINEAR_ROPE_BACKEND=parallel`` stands
for the GPU's path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from linear_rope import PerformerLM, RotaryLinearAttention
from linear_rope.model import MODEL_PRESETS, ModelConfig

BACKENDS = ["torch", "auto", "parallel"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", request.param)
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    return request.param


def tiny(**kw) -> PerformerLM:
    torch.manual_seed(0)
    return PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], **kw})).eval()


def refused(call, match: str) -> str:
    with pytest.raises(ValueError, match=match) as err:
        call()
    msg = str(err.value)
    assert "\n" not in msg and msg.strip() == msg, msg
    return msg


# --- value checks on a CPU -----------------------------------------------------------------------

@pytest.mark.parametrize("position", ["rope", "absolute", "softmax"])
@pytest.mark.parametrize("bad", [256, -1])
def test_ids_outside_the_vocabulary(backend, monkeypatch, position, bad):
    """torch / auto on a CPU: a ValueError naming the id, by default (LINEAR_ROPE_CHECKS=0 does
    not turn it off there: it costs nothing). parallel (the GPU's rule): NaN logits at that
    token, as documented, and the ValueError with LINEAR_ROPE_CHECKS=1."""
    model = tiny(position=position)
    ids = torch.tensor([[1, bad, 3]])
    _, states = model(ids[:, :1], output_final_state=True)
    calls = {"ids": lambda: model(ids), "token": lambda: model.step(torch.tensor([bad]), states, 1)}
    for name, call in calls.items():
        if backend == "parallel":
            out = call()
            out = out[0][:, 1] if isinstance(out, tuple) else out[:, 1]
            assert out.isnan().all()
            monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
        else:
            monkeypatch.setenv("LINEAR_ROPE_CHECKS", "0")
        refused(call, rf"^{name}: 1 id\(s\) outside \[0, vocab_size=256\): {bad}$")
        monkeypatch.delenv("LINEAR_ROPE_CHECKS")


def test_per_row_offsets_and_positions_of_the_layer(backend, monkeypatch):
    """A negative per-row offset (a CPU tensor): refused by default on torch / auto, and on
    parallel with LINEAR_ROPE_CHECKS=1; without it parallel rotates at the (exact) negative
    position, as documented."""
    torch.manual_seed(0)
    for position in ("rope", "rope_pre", "none"):
        layer = RotaryLinearAttention(8, heads=2, dim_head=4, position=position)
        x = torch.randn(2, 3, 8)
        off = torch.tensor([0, -2])
        if backend == "parallel":
            assert torch.isfinite(layer(x, offset=off)).all()
            monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
        refused(lambda: layer(x, offset=off), r"^offset must lie in \[0, MAX_POSITION")
        monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    with pytest.raises(ValueError, match="^position must lie in"):  # the step reads its arguments everywhere
        layer.step(torch.randn(2, 8), None, torch.tensor([1, -1]))


def test_the_value_checks_rule(monkeypatch):
    """``checks.value_checks``: CPU tensors unless the backend is parallel; CUDA / meta tensors
    only with LINEAR_ROPE_CHECKS=1; never while compiling."""
    from linear_rope.checks import value_checks

    cpu, meta = torch.ones(1), torch.ones(1, device="meta")
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    for name, want in (("torch", True), ("auto", True), ("parallel", False)):
        monkeypatch.setenv("LINEAR_ROPE_BACKEND", name)
        assert value_checks(cpu) is want and value_checks(meta) is False and value_checks(None) is False
    monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
    assert value_checks(cpu) and value_checks(meta)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not value_checks(cpu)


# --- malformed inputs ----------------------------------------------------------------------------

def test_forward_refuses_malformed_inputs(backend):
    model = tiny()
    ids = torch.tensor([[1, 2, 3]])
    cases = {
        "ids": [lambda: model([[1, 2, 3]]), lambda: model(ids.float()), lambda: model(ids[0]), lambda: model(ids[None]),
                lambda: model(ids[:, :0]), lambda: model(ids.short()), lambda: model(ids.bool())],
        "ids is on meta": [lambda: model(ids.to("meta"))],
        "mask": [lambda: model(ids, mask=torch.ones(1, 3, dtype=torch.long)), lambda: model(ids, mask=[[True] * 3]),
                 lambda: model(ids, mask=torch.ones(1, 4, dtype=torch.bool)),
                 lambda: model(ids, mask=torch.ones(1, 3, dtype=torch.bool, device="meta"))],
        "output_final_state": [lambda: model(ids, output_final_state=1), lambda: model(ids, output_final_state="no")],
    }
    for name, calls in cases.items():
        for call in calls:
            refused(call, f"^{name}")
    assert model(ids[:0]).shape == (0, 3, 256)  # an empty batch: empty logits, as nn.Linear gives


def test_step_refuses_malformed_inputs(backend):
    model = tiny()
    _, states = model(torch.tensor([[1, 2, 3]]), output_final_state=True)
    tok = torch.tensor([4])
    cases = {
        "token": [lambda: model.step([4], states, 3), lambda: model.step(tok.float(), states, 3),
                  lambda: model.step(tok[None], states, 3), lambda: model.step(torch.tensor([True]), states, 3),
                  lambda: model.step(tok.to("meta"), states, 3)],
        "states": [lambda: model.step(tok, states[:1], 3), lambda: model.step(tok, states[0], 3),
                   lambda: model.step(tok, [1, 2], 3)],
        "position": [lambda: model.step(tok, states, 3.0), lambda: model.step(tok, states, -1),
                     lambda: model.step(tok, states, torch.tensor([3.0])),
                     lambda: model.step(tok, states, torch.tensor([[3]])),
                     lambda: model.step(tok, states, torch.tensor([-3])), lambda: model.step(tok, states, True)],
        "state": [lambda: model.step(torch.tensor([4, 5]), states, 3)],  # a batch of 2 on states of 1
    }
    for name, calls in cases.items():
        for call in calls:
            refused(call, f"^{name}")


def test_generate_refuses_malformed_inputs():
    model = tiny()
    cases = {
        "prompt": [lambda: model.generate("abc", 2), lambda: model.generate([], 2), lambda: model.generate([b""], 2),
                   lambda: model.generate(["abc"], 2), lambda: model.generate([b"a", "b"], 2),
                   lambda: model.generate(memoryview(b"abc"), 2), lambda: model.generate(torch.tensor([1, 2]), 2),
                   lambda: model.generate(None, 2)],
        "max_new_tokens": [lambda: model.generate(b"a", -1), lambda: model.generate(b"a", 2.0),
                           lambda: model.generate(b"a", True), lambda: model.generate(b"a", np.int64(2)),
                           lambda: model.generate(b"a", None)],
        "temperature": [lambda: model.generate(b"a", 2, temperature=-1.0),
                        lambda: model.generate(b"a", 2, temperature="1"),
                        lambda: model.generate(b"a", 2, temperature=float("nan"))],
        "top_k": [lambda: model.generate(b"a", 2, top_k=0), lambda: model.generate(b"a", 2, top_k=1.0)],
        "compile": [lambda: model.generate(b"a", 2, compile=1)],
    }
    for name, calls in cases.items():
        for call in calls:
            refused(call, f"^{name}")
    small = tiny(vocab_size=10)  # bytes past the vocabulary are refused on the host, whatever the device
    refused(lambda: small.generate([b"\x01\x02", b"\x01a"], 2), r"^prompt: byte 97 is outside the vocabulary")
    assert len(small.generate(b"\x01\x09", 3, top_k=1)) == 3


def test_layer_refuses_malformed_inputs(backend):
    torch.manual_seed(0)
    layer = RotaryLinearAttention(8, heads=2, dim_head=4)
    x = torch.randn(1, 3, 8)
    cases = {
        "x must have shape": [lambda: layer(x[0]), lambda: layer(x[:, :0]), lambda: layer([[1.0] * 8])],
        "x must be a floating-point tensor": [lambda: layer(x.long())],
        "x: the last dim is 6, the layer's dim is 8": [lambda: layer(torch.randn(1, 3, 6))],
        "x is torch.float64, the layer's weights torch.float32": [lambda: layer(x.double())],
        "x is on meta, the layer on cpu": [lambda: layer(x.to("meta"))],
        "offset": [lambda: layer(x, offset=1.5), lambda: layer(x, offset=torch.tensor([1.0]))],
        "mask": [lambda: layer(x, mask=torch.ones(1, 3)), lambda: layer(x, mask=torch.ones(1, 2, dtype=torch.bool))],
        "initial_state": [lambda: layer(x, initial_state=3)],
        "output_final_state": [lambda: layer(x, output_final_state=1)],
        "x_t must be a floating-point tensor": [lambda: layer.step(torch.ones(1, 8, dtype=torch.long), None, 0),
                                                lambda: layer.step(x, None, 0)],
        "x_t: the last dim is 6": [lambda: layer.step(torch.randn(1, 6), None, 0)],
        "x_t is torch.float64": [lambda: layer.step(torch.randn(1, 8, dtype=torch.float64), None, 0)],
        "position": [lambda: layer.step(torch.randn(1, 8), None, 0.5), lambda: layer.step(torch.randn(1, 8), None, -1)],
        "state": [lambda: layer.step(torch.randn(1, 8), 5, 0)],
    }
    for name, calls in cases.items():
        for call in calls:
            refused(call, f"^{name}")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts x: another dtype is no error there ...
        assert torch.isfinite(layer(x.half())).all()
        refused(lambda: layer(x.double()), "^x is torch.float64")  # ... but float64 it never casts
    cross = RotaryLinearAttention(8, heads=2, dim_head=4, position="none", causal=False)
    refused(lambda: cross(x, context=torch.randn(1, 5, 6)), "^context must have shape")
    refused(lambda: cross(x, context=torch.randn(1, 5, 8).long()), "^context must be a floating-point tensor")
