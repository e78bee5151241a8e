"""Every position a signature accepts is rotated exactly or refused: offsets (ints and per-row
tensors), mask-derived positions, the one-token step's position, explicit ``positions`` and the
Decoder's, up to ``MAX_POSITION`` = 2**62 - 1 and past it, on the torch and chunk-parallel
backends. "Exactly" is against angles formed in Python integers and fractions (``exact_turns``);
"refused" is a one-line ValueError where the value checks run (CPU tensors, or
``LINEAR_ROPE_CHECKS=1``), and NaN where they do not (the GPU's rule, which
``LINEAR_ROPE_BACKEND=parallel`` stands for on a CPU): never the angle of another position (an
offset near 2**63 used to wrap around int64 and be rotated as a negative position, silently)."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from linear_rope.decode import Decoder
from linear_rope import (
    FavorFeatures,
    PerformerLM,
    RotaryLinearAttention,
    apply_rotary,
    naive_rotary_linear_attention as naive,
    rotary_linear_attention as fast,
    rotary_linear_attention_step as step,
)
from linear_rope.model import MODEL_PRESETS, ModelConfig
from linear_rope.reference import layer_ref
from linear_rope.rotary import MAX_POSITION, PI, rope_thetas, rope_turns, rotary_tables

F64 = dict(dtype=torch.float64)
H, M, E, N = 2, 6, 3, 7
TOP = MAX_POSITION - N + 1  # the largest offset whose N positions all lie within the bound


def exact_turns(p: int, dim: int, base: float) -> list[float]:
    """frac(p theta_i / 2 pi) from the float64 thetas in exact rational arithmetic (pi to 75
    digits: an error below 2**62 * 1e-74 turns), rounded once to float64."""
    return [float((p * Fraction(t) / (2 * PI)) % 1) for t in rope_thetas(dim, base)]


def turn_error(got: torch.Tensor, want: list[float]) -> float:
    d = (got.double() - torch.tensor(want, **F64)).abs()
    return torch.minimum(d, 1 - d).max().item()  # on the circle: 1 - 2**-60 and 0 are neighbours


@pytest.fixture(params=["torch", "parallel", "parallel+checks"])
def backend(request, monkeypatch):
    name, _, checks = request.param.partition("+")
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", name)
    if checks:
        monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
    else:
        monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    return request.param


def reads(backend: str) -> bool:
    """Whether the op reads per-row offsets on this backend (CPU tensors)."""
    return backend != "parallel"


def make(B=2, favor=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if favor:
        q, k = (torch.randn(B, H, N, 4, generator=g, **F64) for _ in range(2))
        torch.manual_seed(seed)
        w = FavorFeatures(4, M).projection.double()
    else:
        q, k = (torch.rand(B, H, N, M, generator=g, **F64) + 0.05 for _ in range(2))
        w = None
    return q, k, torch.randn(B, H, N, E, generator=g, **F64), w


# --- the angles themselves ------------------------------------------------------------------------

EDGE = [0, 1, 2**53 + 1, 2**61 + 12345, MAX_POSITION - 1, MAX_POSITION]


@pytest.mark.parametrize("base", [10000.0, 500.0, 1e6])
def test_rope_turns_are_exact_up_to_the_bound_and_nan_beyond(base):
    dim = 10
    pos = torch.tensor(EDGE + [-p for p in EDGE])
    turns = rope_turns(pos, dim, base)
    for p, row in zip(pos.tolist(), turns):
        assert turn_error(row, exact_turns(p, dim, base)) < 2**-48, p
    beyond = torch.tensor([MAX_POSITION + 1, 2**63 - 1, -(2**62), -(2**63), -(2**63) + 5])
    assert rope_turns(beyond, dim, base).isnan().all()
    # an offset plus a length that wraps past 2**63 lands on one of these, never on a valid position
    wrapped = torch.tensor([2**63 - 3]) + torch.arange(6)
    assert (wrapped[3:] < 0).all() and rope_turns(wrapped[3:], dim, base).isnan().all()


@pytest.mark.parametrize("backend_name", ["torch", "parallel"])
def test_explicit_positions_are_exact_or_refused(monkeypatch, backend_name):
    """apply_rotary / rotary_tables with explicit positions: exact for |p| <= MAX_POSITION,
    negative ones included; beyond, a ValueError on a CPU tensor, NaN where nothing is read."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", backend_name)
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    x = torch.randn(1, 3, 8, **F64)
    pos = torch.tensor([[MAX_POSITION, -MAX_POSITION, 5]])
    cos, sin = rotary_tables(3, 8, positions=pos, dtype=torch.float64)
    for j, p in enumerate(pos[0].tolist()):
        want = torch.tensor(exact_turns(p, 8, 10000.0), **F64) * 2 * torch.pi
        torch.testing.assert_close(cos[0, j], want.cos(), rtol=0, atol=1e-13)
        torch.testing.assert_close(sin[0, j], want.sin(), rtol=0, atol=1e-13)
    apply_rotary(x, positions=pos)
    for bad in (MAX_POSITION + 1, 2**63 - 1, -(2**63)):
        pos = torch.tensor([[0, bad, 1]])
        if backend_name == "torch":
            with pytest.raises(ValueError, match=r"positions: \[-?\d+\] past MAX_POSITION") as err:
                apply_rotary(x, positions=pos)
            assert "\n" not in str(err.value)
        else:
            out = apply_rotary(x, positions=pos)
            assert out[:, 1].isnan().all() and not out[:, [0, 2]].isnan().any()
    for dt in (torch.uint64, torch.float64, torch.bool):
        with pytest.raises(ValueError, match="positions must be an integer tensor"):
            apply_rotary(x, positions=torch.zeros(1, 3, dtype=dt))


# --- the op: int and per-row offsets, with and without a mask -------------------------------------

@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
@pytest.mark.parametrize("favor", [False, True], ids=["features", "favor"])
def test_offsets_at_the_bound_are_exact(backend, favor, masked):
    """Per-row offsets [TOP, 3] (the last token of row 0 at MAX_POSITION): the float64 reference
    to 1e-10, causal and bidirectional, and the same output as each row at offset 0 (no state:
    Eq. 19 sees relative positions only)."""
    q, k, v, w = make(favor=favor)
    mask = None
    if masked:
        mask = torch.ones(2, N, dtype=torch.bool)
        mask[0, :2] = False
    for causal in (True, False):
        kw = dict(causal=causal, projection=w, mask=mask)
        off = torch.tensor([TOP, 3])
        out = fast(q, k, v, offset=off, **kw)
        torch.testing.assert_close(out, naive(q, k, v, offset=off, **kw), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out, naive(q, k, v, **kw), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(fast(q, k, v, offset=TOP, **kw), naive(q, k, v, **kw), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("offset", [TOP + 1, MAX_POSITION, 2**62, 2**63 - 3, 2**63 - 1], ids=lambda o: hex(o))
def test_per_row_offsets_past_the_bound_are_refused_or_nan(backend, offset):
    """A row whose positions run past MAX_POSITION: one ValueError naming the offset where the
    values are read; unread, NaN exactly at the tokens past the bound (the others exact), and
    the other rows untouched. 2**63 - 3 used to wrap around int64 and be rotated as -2**63 + ..."""
    q, k, v, _ = make()
    off = torch.tensor([offset, 3])
    if reads(backend):
        with pytest.raises(ValueError, match="offset") as err:
            fast(q, k, v, offset=off)
        assert "MAX_POSITION" in str(err.value) and "\n" not in str(err.value)
        return
    out = fast(q, k, v, offset=off)
    at0 = naive(q, k, v)
    past = torch.tensor([offset + t > MAX_POSITION for t in range(N)])
    assert out[0, :, past].isnan().all()
    torch.testing.assert_close(out[0, :, ~past], at0[0, :, ~past], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1], at0[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend_name", ["torch", "parallel"])
def test_int_offsets_past_the_bound_are_refused_everywhere(monkeypatch, backend_name):
    """An int offset is checked on the host, whatever the backend (no device sync)."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", backend_name)
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    q, k, v, _ = make()
    for bad in (TOP + 1, 2**62, 2**63 - 1, 2**64):
        for causal in (True, False):
            with pytest.raises(ValueError, match="MAX_POSITION"):
                fast(q, k, v, offset=bad, causal=causal)
    fast(q, k, v, offset=TOP)


# --- the one-token step, the layer and the model --------------------------------------------------

def test_step_positions_at_and_past_the_bound(backend):
    """The step reads its arguments on every backend: a per-row position past MAX_POSITION is a
    ValueError; at the bound it equals the full op at that offset (int and tensor positions)."""
    q, k, v, _ = make(favor=False)
    one = [t[:, :, :1] for t in (q, k, v)]
    for p in (MAX_POSITION, 2**53 + 1):
        want = naive(*one, offset=p)[:, :, 0]
        got_int, _ = step(*(t[:, :, 0] for t in one), None, p)
        got_row, _ = step(*(t[:, :, 0] for t in one), None, torch.tensor([p, p]))
        torch.testing.assert_close(got_int, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_row, want, rtol=1e-10, atol=1e-10)
    for bad in (MAX_POSITION + 1, 2**63 - 1):
        with pytest.raises(ValueError, match="position"):
            step(*(t[:, :, 0] for t in one), None, torch.tensor([0, bad]))
        with pytest.raises(ValueError, match="position"):
            step(*(t[:, :, 0] for t in one), None, bad)


@pytest.mark.parametrize("position", ["rope", "rope_pre", "rope_norm"])
def test_layer_per_row_offsets_at_the_bound(backend, position):
    """The layer at per-row offsets [TOP, 5]: each row equals the float64 reference at its own
    offset; past the bound, refused where the values are read, NaN (never finite and wrong)
    where they are not."""
    torch.manual_seed(0)
    layer = RotaryLinearAttention(12, heads=2, dim_head=6, nb_features=8, position=position).double()
    x = torch.randn(2, N, 12, generator=torch.Generator().manual_seed(1), **F64)
    out = layer(x, offset=torch.tensor([TOP, 5]))
    for b, off in enumerate((TOP, 5)):
        torch.testing.assert_close(out[b : b + 1], layer_ref(layer, x[b : b + 1], offset=off), rtol=1e-9, atol=1e-9)
    bad = torch.tensor([2**63 - 3, 5])
    if reads(backend):
        with pytest.raises(ValueError, match="offset|positions"):
            layer(x, offset=bad)
    else:
        got = layer(x, offset=bad)
        assert got[0].isnan().all() and not got[1].isnan().any()


def test_model_step_and_decoder_positions_past_the_bound(backend):
    torch.manual_seed(0)
    lm = PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"])).eval()
    _, states = lm(torch.tensor([[1, 2, 3], [4, 5, 6]]), output_final_state=True)
    tok = torch.tensor([7, 8])
    with torch.no_grad():
        a, _ = lm.step(tok, states, torch.tensor([MAX_POSITION, MAX_POSITION]))
        b, _ = lm.step(tok, states, MAX_POSITION)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for bad in (torch.tensor([3, MAX_POSITION + 1]), torch.tensor([3, 2**63 - 1]), MAX_POSITION + 1):
        with pytest.raises(ValueError, match="position"):
            lm.step(tok, states, bad)
    dec = Decoder(lm, 2, 8)  # its RoPE rows run from the smallest position to max_len past it
    with torch.no_grad():
        dec.load(states, torch.tensor([MAX_POSITION - 7, MAX_POSITION - 7]))
        torch.testing.assert_close(dec.step(tok), lm.step(tok, states, MAX_POSITION - 7)[0], rtol=1e-5, atol=1e-5)
        for bad in (MAX_POSITION - 6, torch.tensor([3, MAX_POSITION + 1]), torch.tensor([2**63 - 1, 2**63 - 1])):
            with pytest.raises(ValueError, match="positions") as err:
                dec.load(states, bad)
            assert "\n" not in str(err.value)
