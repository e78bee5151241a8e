"""ops/workspace.py: the causal op's kept buffers are reused between calls, never while in use."""
import pytest
import torch

from linear_rope import naive_rotary_linear_attention, rotary_linear_attention
from linear_rope.features import draw_orthogonal_projection
from linear_rope.ops import chunk_fwd, workspace


@pytest.fixture(autouse=True)
def fresh_pool():
    workspace.clear()
    yield
    workspace.clear()


def test_a_buffer_comes_back_only_when_nothing_holds_it():
    like = torch.empty(0, dtype=torch.float64)
    a = workspace.empty((3, 4), like)
    b = workspace.empty((3, 4), like)
    assert a.data_ptr() != b.data_ptr()
    view_of_a = a[1:]
    ptr = a.data_ptr()
    del a
    c = workspace.empty((12,), like)
    assert c.data_ptr() != ptr  # a view of a's storage is still alive
    del view_of_a
    d = workspace.empty((2, 6), like)
    assert d.data_ptr() == ptr and d.shape == (2, 6)
    assert workspace.held_bytes() == 3 * 12 * 8


def test_the_pool_holds_at_most_its_limit(monkeypatch):
    monkeypatch.setattr(workspace, "LIMIT_BYTES", 1000)
    like = torch.empty(0)
    kept = [workspace.empty((100,), like) for _ in range(5)]  # 400 bytes each: two fit
    assert workspace.held_bytes() == 800
    assert len({t.data_ptr() for t in kept}) == 5


def _inputs(seed, B=2, H=2, N=200, d=8, e=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, x, generator=g, dtype=torch.float64, requires_grad=True) for x in (d, d, e)]


def _reference(q, k, v, w):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = naive_rotary_linear_attention(q, k, v, projection=w)
    return out, q, k, v


def test_pending_backwards_keep_their_own_buffers():
    """Two forwards of the same shapes before either backward, one backward run twice
    (retain_graph): every gradient is the reference's, so no call reused a buffer another
    call's backward still needed."""
    w = draw_orthogonal_projection(16, 8, torch.Generator().manual_seed(0)).double()
    plan = chunk_fwd.keep_plan((4, 4, 64, 16, 5), True, True, torch.empty(0, dtype=torch.float64), sizes_only=True)
    assert {"A", "phq", "phk", "S", "z"} <= set(plan)  # the backward reads kept buffers here
    calls = [_inputs(1), _inputs(2), _inputs(3)]
    outs = [rotary_linear_attention(q, k, v, projection=w) for q, k, v in calls[:2]]
    held = workspace.held_bytes()
    assert held > 0
    gouts = [torch.randn_like(o) for o in outs]
    outs[1].backward(gouts[1], retain_graph=True)
    out3 = rotary_linear_attention(*calls[2], projection=w)  # outs[1]'s graph is still retained
    held3 = workspace.held_bytes()  # outs[0]'s graph is pending too: a third set of buffers
    outs[1].backward(gouts[1])
    outs[0].backward(gouts[0])
    out3.backward(torch.ones_like(out3))
    for (q, k, v), out, gout, times in zip(calls, outs + [out3], gouts + [torch.ones_like(out3)], (1, 2, 1)):
        ref, rq, rk, rv = _reference(q, k, v, w)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        ref.backward(gout)
        for got, want in ((q, rq), (k, rk), (v, rv)):
            torch.testing.assert_close(got.grad, times * want.grad, rtol=1e-9, atol=1e-11)
    assert held3 == held * 3 // 2
    # every graph is gone: a new call of the same shapes takes the pooled buffers, no new ones
    rotary_linear_attention(*_inputs(4), projection=w).sum().backward()
    assert workspace.held_bytes() == held3


def test_a_new_size_evicts_idle_buffers_of_old_sizes_not_buffers_in_use(monkeypatch):
    monkeypatch.setattr(workspace, "LIMIT_BYTES", 1000)
    like = torch.empty(0)
    in_use = workspace.empty((100,), like)  # 400 bytes, held
    idle = workspace.empty((50,), like)  # 200 bytes
    del idle
    big = workspace.empty((75,), like)  # 300: 900 fit, nothing evicted
    assert workspace.held_bytes() == 900
    del big
    new = workspace.empty((120,), like)  # 480: evicts the idle 50 and 75, keeps the one in use
    assert workspace.held_bytes() == 880
    in_use.fill_(1.0), new.fill_(2.0)
    assert (in_use == 1).all() and (new == 2).all()
    other = workspace.empty((100,), like)  # both held buffers in use: no room, a plain allocation
    assert workspace.held_bytes() == 880 and other.data_ptr() not in (in_use.data_ptr(), new.data_ptr())
