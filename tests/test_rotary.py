import math

import pytest
import torch

from linear_rope import apply_rotary
from linear_rope.reference import apply_rotary_ref
from linear_rope.rotary import rotary_tables

torch.manual_seed(0)
F64 = dict(dtype=torch.float64)


@pytest.mark.parametrize("offset", [0, 7, 1000])
@pytest.mark.parametrize("shape", [(1, 2), (3, 5, 8), (2, 3, 63, 266)], ids=str)
def test_matches_reference(shape, offset):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, **F64)
    torch.testing.assert_close(apply_rotary(x, offset=offset), apply_rotary_ref(x, offset=offset), rtol=0, atol=1e-12)


def test_hand_computed_4dim():
    # D = 4: theta_0 = 1, theta_1 = 10000^(-2/4) = 0.01. Position 3.
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], **F64)
    a0, a1 = 3 * 1.0, 3 * 0.01
    want = torch.tensor(
        [[
            1 * math.cos(a0) - 2 * math.sin(a0),
            1 * math.sin(a0) + 2 * math.cos(a0),
            3 * math.cos(a1) - 4 * math.sin(a1),
            3 * math.sin(a1) + 4 * math.cos(a1),
        ]],
        **F64,
    )
    torch.testing.assert_close(apply_rotary(x, offset=3), want, rtol=0, atol=1e-15)
    # position 0 is the identity
    torch.testing.assert_close(apply_rotary(x), x, rtol=0, atol=0)


def test_preserves_norm():
    x = torch.randn(4, 100, 32, **F64)
    torch.testing.assert_close(apply_rotary(x, offset=5).norm(dim=-1), x.norm(dim=-1), rtol=1e-13, atol=0)


def test_inner_product_depends_only_on_relative_position():
    a, b = torch.randn(2, 16, **F64)
    def dot(m, n):
        ra = apply_rotary(a[None].expand(1, 16), offset=m)[0]
        rb = apply_rotary(b[None].expand(1, 16), offset=n)[0]
        return (ra * rb).sum()
    for delta in (0, 1, 5, 37):
        vals = torch.stack([dot(m, m + delta) for m in (0, 3, 100, 2500)])
        torch.testing.assert_close(vals, vals[:1].expand(4), rtol=1e-11, atol=1e-11)
    assert not torch.isclose(dot(0, 1), dot(0, 2))


def test_rope_pre_layout_matches_performer_pytorch():
    from performer_pytorch.performer_pytorch import FixedPositionalEmbedding, apply_rotary_pos_emb

    q, k = torch.randn(2, 2, 3, 50, 64)
    pos = FixedPositionalEmbedding(64, 50)(q[0])  # (1, N, 64): sin half, cos half
    pq, pk = apply_rotary_pos_emb(q, k, pos)
    torch.testing.assert_close(apply_rotary(q), pq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(k), pk, rtol=1e-5, atol=1e-5)


def test_low_precision_tables_are_float32():
    cos, sin = rotary_tables(8, 4, dtype=torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.float32
    x = torch.randn(3, 4096, 8)
    want = apply_rotary_ref(x.double(), offset=10_000)
    out = apply_rotary(x.bfloat16(), offset=10_000)
    assert out.dtype == torch.bfloat16
    # bf16 has 8 bits of mantissa: only the input/output rounding shows, not the angles,
    # which at positions ~14000 would be off by whole radians if formed in bf16.
    err = (out.double() - want).abs().max().item()
    assert err < 0.05 * x.abs().max().item()


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(3, 5)), "even"),
    (dict(x=torch.randn(3, 4), offset=-1), "offset"),
    (dict(x=torch.randn(4)), "shape"),
])
def test_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary(**bad)


def test_limb_tables_are_made_once_per_device_and_equal_fresh_ones(monkeypatch):
    """rope_turns keeps its float64 limb tables per (dim, base, device): a second call copies
    nothing from Python lists (a host sync on CUDA), and gives what fresh tables give."""
    from linear_rope import rotary

    pos = torch.arange(-5, 300, 7)
    first = rotary.rope_turns(pos, 18, 777.0)
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    again = rotary.rope_turns(pos, 18, 777.0)
    assert made == [] and torch.equal(first, again)
    monkeypatch.setattr(rotary, "_LIMB_TENSORS", {})  # fresh tables: the same values
    assert torch.equal(rotary.rope_turns(pos, 18, 777.0), first) and len(made) == 2


@pytest.mark.parametrize("backend", ["torch", "auto", "parallel"])
def test_tensor_offsets_are_range_checked_where_value_checks_run(monkeypatch, backend):
    """A CPU tensor's values are read by default (no device sync there); with
    LINEAR_ROPE_BACKEND=parallel, which stands for the GPU's path, only with LINEAR_ROPE_CHECKS=1."""
    from linear_rope.rotary import check_offset

    bad = torch.tensor([0, -3])
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", backend)
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    msg = r"offset must lie in \[0, MAX_POSITION = 2\*\*62 - 1\], got \[0, -3\]"
    if backend == "parallel":
        assert torch.equal(check_offset(bad, rows=2), bad)  # no value read: no host sync
        monkeypatch.setenv("LINEAR_ROPE_CHECKS", "0")
        assert torch.equal(check_offset(bad, rows=2), bad)
    else:
        with pytest.raises(ValueError, match=msg):
            check_offset(bad, rows=2)
    monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
    with pytest.raises(ValueError, match=msg):
        check_offset(bad, rows=2)
    assert torch.equal(check_offset(bad, rows=2, read=False), bad)
