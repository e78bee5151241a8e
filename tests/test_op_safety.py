"""The op as a hostile caller uses it: forward-mode AD and the torch.func transforms, garbage in
padding, packed documents of very different scales, huge positions, NaN hyperparameters and
states, a compiled overflow, bools where numbers or flags belong, keywords that would do
nothing, and the crashes that used to come out of torch instead of one clear error. Each is
checked against the float64 reference (``naive``) or against the same call without the hostile
part, outputs and gradients, on the torch and the chunk-parallel backends (``auto`` takes the
torch path on a CPU). A check that reads tensor values runs on the chunk-parallel path (the
GPU's, whose reads would make the GPU wait) with ``LINEAR_ROPE_CHECKS=1`` only; what that path
does without it, as documented, is tested too."""
import math
import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from linear_rope import (
    FavorFeatures,
    LinearAttentionState,
    PerformerLM,
    RotaryLinearAttention,
    apply_rotary,
    naive_rotary_linear_attention as naive,
    rotary_linear_attention as fast,
    rotary_linear_attention_step as step,
)
from linear_rope.model import MODEL_PRESETS, ModelConfig
from linear_rope.ops import recurrent_rotary_linear_attention as recurrent
from linear_rope.reference import apply_rotary_ref, layer_ref
from linear_rope.rotary import MAX_POSITION
from linear_rope.softmax_attention import SoftmaxAttention

F64 = dict(dtype=torch.float64)
BACKENDS = ["torch", "parallel"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Every call of the test on this backend, with the value checks as it has them by default."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", request.param)
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    return request.param


@pytest.fixture(params=BACKENDS)
def checked(request, monkeypatch):
    """For a check that reads tensor values: each backend with that check on (the chunk-parallel
    path: ``LINEAR_ROPE_CHECKS=1``)."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", request.param)
    if request.param == "parallel":
        monkeypatch.setenv("LINEAR_ROPE_CHECKS", "1")
    else:
        monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)
    return request.param


@pytest.fixture
def unchecked(monkeypatch):
    """The chunk-parallel path as the GPU has it by default: no value read."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", "parallel")
    monkeypatch.delenv("LINEAR_ROPE_CHECKS", raising=False)


def one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg
H, D, M, E = 2, 6, 8, 5
MODES = [pytest.param(True, id="causal"), pytest.param(False, id="bidir")]
INPUTS = [pytest.param(False, id="features"), pytest.param(True, id="favor")]


def make(B, N, favor, seed=0):
    """q, k (features, or raw with a FAVOR+ projection w), v in float64."""
    g = torch.Generator().manual_seed(seed)
    if favor:
        q, k = (torch.randn(B, H, N, D, generator=g, **F64) for _ in range(2))
        torch.manual_seed(seed)
        w = FavorFeatures(D, M).projection.double()
    else:
        q, k = (torch.rand(B, H, N, M, generator=g, **F64) + 0.05 for _ in range(2))
        w = None
    return q, k, torch.randn(B, H, N, E, generator=g, **F64), w


def state(rows, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, H, M, E, generator=g, **F64).to(dtype),
            (torch.rand(rows, H, M, generator=g, **F64) + 0.5).to(dtype))


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def pad_mask(B, N):
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[-1, N - 6:] = False  # right padding
    mask[-1, N // 2] = False  # a hole
    return mask


# --- forward-mode AD and the torch.func transforms: correct, never a silent zero --------------

CASES = ["plain", "mask+offsets+state", "cu+offsets+state"]


def _case(case, causal, favor, N=21):
    """Inputs (q, k, v, S0, z0 or q, k, v) and the keywords of one case."""
    B = 1 if case.startswith("cu") else 2
    q, k, v, w = make(B, N, favor, seed=len(case))
    kw = dict(causal=causal, projection=w)
    if "mask" in case:
        kw["mask"] = pad_mask(B, N)
    if case.startswith("cu"):
        kw["cu_seqlens"] = torch.tensor([0, 7, 8, N], dtype=torch.int32)
        kw["offset"] = torch.tensor([3, 0, 900])
    elif "offsets" in case:
        kw["offset"] = torch.tensor([2, 1000])
    primals = [q, k, v]
    if "state" in case:
        primals += list(state(3 if case.startswith("cu") else B))
    return primals, kw


def _call(op, kw):
    """f(q, k, v[, S0, z0]) -> out, or (out, S, z) with a state."""
    def f(q, k, v, *st):
        if not st:
            return op(q, k, v, **kw)
        out, (S, z) = op(q, k, v, initial_state=LinearAttentionState(*st), output_final_state=True, **kw)
        return out, S, z
    return f


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("causal", MODES)
def test_forward_mode_ad_matches_the_reference(causal, favor, case):
    """torch.func.jvp and torch.autograd.forward_ad give the float64 reference's tangents (the
    causal path used to return 0 with no error)."""
    primals, kw = _case(case, causal, favor)
    g = torch.Generator().manual_seed(7)
    tangents = [torch.randn(p.shape, generator=g, **F64) for p in primals]
    got = torch.func.jvp(_call(fast, kw), tuple(primals), tuple(tangents))
    want = torch.func.jvp(_call(naive, kw), tuple(primals), tuple(tangents))
    for a, b in zip(got, want):  # (out[, S, z]), then the tangents
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            close(x, y, 1e-9)
    tan = got[1][0] if isinstance(got[1], tuple) else got[1]
    assert tan.abs().max() > 1e-2  # not a silent zero
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents)]
        out = _call(fast, kw)(*duals)
        out = out[0] if isinstance(out, tuple) else out
        close(fwAD.unpack_dual(out).tangent, tan, 1e-9)


@pytest.mark.parametrize("causal", MODES)
def test_grad_jacrev_jacfwd_and_vmap_match_the_reference(causal):
    """torch.func.grad / jacrev / jacfwd and vmap of the op equal the reference (they used to fail
    with "must override setup_context" and ".item()" errors)."""
    (q, k, v, S0, z0), kw = _case("mask+offsets+state", causal, False, N=9)
    up = torch.randn(2, H, 9, E, generator=torch.Generator().manual_seed(3), **F64)

    def loss(op):
        return lambda q, k, v: (_call(op, kw)(q, k, v, S0, z0)[0] * up).sum()

    for a, b in zip(torch.func.grad(loss(fast), argnums=(0, 1, 2))(q, k, v),
                    torch.func.grad(loss(naive), argnums=(0, 1, 2))(q, k, v)):
        close(a, b, 1e-9)
    small = [t[:1, :1, :4].contiguous() for t in (q, k, v)]
    kw1 = dict(causal=causal)
    f, r = (lambda q: op(q, *small[1:], **kw1) for op in (fast, naive))
    close(torch.func.jacrev(f)(small[0]), torch.func.jacrev(r)(small[0]), 1e-9)
    close(torch.func.jacfwd(f)(small[0]), torch.func.jacrev(r)(small[0]), 1e-9)
    # vmap over a leading dim: each entry as its own call
    qs, ks, vs = (torch.stack([t, t.flip(2) + 0.1]) for t in (q.abs(), k.abs(), v))
    batched = torch.func.vmap(lambda a, b, c: fast(a, b, c, **kw))(qs, ks, vs)
    for i in range(2):
        close(batched[i], naive(qs[i], ks[i], vs[i], **kw))
    # second order through the transforms (the fast path's own backward is first order only)
    def second(op):
        return torch.func.jacfwd(torch.func.grad(lambda q: (op(q, *small[1:], **kw1) ** 2).sum()))(small[0])
    close(second(fast), second(naive), 1e-9)


def test_jvp_through_a_causal_layer_matches_its_reference():
    torch.manual_seed(0)
    layer = RotaryLinearAttention(12, heads=2, dim_head=6, nb_features=8).double()
    x, t = (torch.randn(2, 11, 12, generator=torch.Generator().manual_seed(s), **F64) for s in (1, 2))
    out, tan = torch.func.jvp(layer, (x,), (t,))
    ref, tref = torch.func.jvp(lambda x: layer_ref(layer, x), (x,), (t,))
    close(out, ref), close(tan, tref, 1e-9)
    assert tan.abs().max() > 1e-2


# --- padding selects, never multiplies ---------------------------------------------------------

PATHS = {"chunk": (fast, True, True), "chunk-eq18": (fast, True, False), "bidirectional": (fast, False, True),
         "naive": (naive, True, True), "naive-bidirectional": (naive, False, True), "recurrent": (recurrent, True, True)}
FILLS = [pytest.param(float("nan"), id="nan"), pytest.param(float("inf"), id="inf"),
         pytest.param(-float("inf"), id="-inf"), pytest.param(1e300, id="huge")]


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("favor", INPUTS)
@pytest.mark.parametrize("path, backend_name", [(p, b) for p in PATHS for b in (BACKENDS if PATHS[p][0] is fast
                                                                                else BACKENDS[:1])])
def test_padding_is_selected_never_multiplied(path, backend_name, favor, fill, monkeypatch):
    """NaN, inf or huge values in masked positions of q, k, v leave the outputs, the final state
    and every gradient exactly (bit for bit) what they are with zeros there."""
    monkeypatch.setenv("LINEAR_ROPE_BACKEND", backend_name)
    op, causal, rotary = PATHS[path]
    N = 23
    q, k, v, w = make(2, N, favor, seed=5)
    mask = pad_mask(2, N)
    S0, z0 = state(2)
    g = torch.Generator().manual_seed(9)
    ups = [torch.randn(2, H, N, E, generator=g, **F64), torch.randn(2, H, M, E, generator=g, **F64),
           torch.randn(2, H, M, generator=g, **F64)]

    def run(value):
        xs = [t.clone() for t in (q, k, v)]
        for t in xs:
            t.masked_fill_(~mask[:, None, :, None], value)
        leaves = [t.requires_grad_() for t in xs + [S0.clone(), z0.clone()]]
        out, (S, z) = op(*leaves[:3], causal=causal, rotary=rotary, projection=w, mask=mask,
                         output_final_state=True, initial_state=LinearAttentionState(*leaves[3:]))
        grads = torch.autograd.grad(sum((a * u).sum() for a, u in zip((out, S, z), ups)), leaves)
        return [out, S, z, *grads]

    clean, dirty = run(0.0), run(fill)
    for a, b in zip(clean, dirty):
        assert torch.isfinite(b).all()
        assert torch.equal(a, b)
    close(clean[0], naive(q, k, v, causal=causal, rotary=rotary, projection=w, mask=mask,
                          initial_state=LinearAttentionState(S0, z0)))


# --- the feature scale is normalised per packed document and per row ---------------------------

@pytest.mark.parametrize("causal", MODES)
def test_packed_documents_of_very_different_scales_each_get_what_they_get_alone(causal, backend):
    """Keys x1e-30 in one packed document and x1e30 in the next (float32): each document's output
    and final state are what it gets alone (document 0 used to come out all zeros)."""
    lengths, scales = [3, 2, 6], [1e-30, 1e30, 1.0]
    q, k, v, _ = make(1, sum(lengths), False, seed=4)
    cu = torch.tensor([0, 3, 5, 11], dtype=torch.int32)
    for d, s in enumerate(scales):
        k[:, :, cu[d] : cu[d + 1]] *= s
    q, k, v = (t.float() for t in (q, k, v))
    out, st = fast(q, k, v, cu_seqlens=cu, causal=causal, output_final_state=True)
    for d in range(3):
        sl = slice(int(cu[d]), int(cu[d + 1]))
        ref, ref_st = naive(*(t[:, :, sl].double() for t in (q, k, v)), causal=causal, output_final_state=True)
        alone = fast(*(t[:, :, sl] for t in (q, k, v)), causal=causal)
        torch.testing.assert_close(out[:, :, sl].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        torch.testing.assert_close(out[:, :, sl], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
        torch.testing.assert_close(st.z[d : d + 1].double(), ref_st.z, rtol=1e-5, atol=0)


def test_batch_rows_of_very_different_scales_each_get_what_they_get_alone(backend):
    q, k, v, _ = make(2, 17, False, seed=6)
    k[0] *= 1e-30
    k[1] *= 1e30
    q, k, v = (t.float() for t in (q, k, v))
    out = fast(q, k, v)
    for b in range(2):
        ref = naive(*(t[b : b + 1].double() for t in (q, k, v)))
        torch.testing.assert_close(out[b : b + 1].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


# --- positions: integers up to MAX_POSITION, exact angles, one clear error beyond --------------

BIG = [pytest.param(2**53 + 1, id="2^53+1"), pytest.param(2**61 + 12345, id="2^61"),
       pytest.param(MAX_POSITION - 30, id="max")]


@pytest.mark.parametrize("offset", BIG)
@pytest.mark.parametrize("causal", MODES)
def test_huge_offsets_keep_float64_accuracy(causal, offset, backend):
    """At any offset up to MAX_POSITION the op matches the reference to 1e-10 (offset 2**53 + 1
    used to be off by 33%), and, with no state, equals itself at offset 0: Eq. 19 then depends on
    relative positions only. The second check holds the reference to the same standard."""
    q, k, v, w = make(2, 31, True, seed=8)
    out = fast(q, k, v, causal=causal, projection=w, offset=offset)
    at0 = naive(q, k, v, causal=causal, projection=w)
    close(out, naive(q, k, v, causal=causal, projection=w, offset=offset))
    close(out, at0)
    close(naive(q, k, v, causal=causal, projection=w, offset=offset), at0)
    per_row = fast(q, k, v, causal=causal, projection=w, offset=torch.tensor([offset, 5]))
    close(per_row, at0)


def test_huge_positions_in_the_step_and_apply_rotary(backend):
    q, k, v, w = make(2, 6, True, seed=2)
    p = 2**53 + 1
    full, st = fast(q, k, v, projection=w, offset=p, output_final_state=True)
    _, st5 = fast(q[:, :, :5], k[:, :, :5], v[:, :, :5], projection=w, offset=p, output_final_state=True)
    out, _ = step(q[:, :, 5], k[:, :, 5], v[:, :, 5], st5, p + 5, projection=w)
    assert out.shape == (2, H, E)  # it used to return [B, H, 2, 2]
    close(out, full[:, :, 5])
    x = torch.randn(3, 7, 8, **F64)
    close(apply_rotary(x, offset=p), apply_rotary_ref(x, offset=p), 1e-12)


@pytest.mark.parametrize("bad", [2**62, 2**63, 2**64], ids=["2^62", "2^63", "2^64"])
def test_positions_past_the_bound_are_one_clear_error(bad, checked):
    q, k, v, _ = make(2, 5, False)
    layer = RotaryLinearAttention(8, heads=2, dim_head=4)
    for call in (lambda: fast(q, k, v, offset=bad), lambda: naive(q, k, v, offset=bad),
                 lambda: fast(q, k, v, offset=bad, causal=False),
                 lambda: step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, bad),
                 lambda: apply_rotary(q, offset=bad), lambda: layer(torch.randn(2, 5, 8), offset=bad)):
        with pytest.raises(ValueError, match="MAX_POSITION") as err:
            call()
        one_line(err)
    with pytest.raises(ValueError, match="MAX_POSITION"):  # the last token past it
        fast(q, k, v, offset=MAX_POSITION - 2)
    if bad < 2**63:  # a tensor's values: read on a CPU, and on the chunk-parallel path with LINEAR_ROPE_CHECKS=1
        for causal in (True, False):
            with pytest.raises(ValueError, match="MAX_POSITION"):
                fast(q, k, v, offset=torch.tensor([0, bad]), causal=causal)
            with pytest.raises(ValueError, match="MAX_POSITION"):  # the last token past it
                fast(q, k, v, offset=torch.tensor([0, MAX_POSITION - 2]), causal=causal)
    fast(q, k, v, offset=MAX_POSITION - 4)  # the last token at the bound is fine
    fast(q, k, v, offset=torch.tensor([0, MAX_POSITION - 4]))


def test_unchecked_positions_past_the_bound_are_nan(unchecked):
    """Without LINEAR_ROPE_CHECKS the chunk-parallel path reads no offset: a token past the
    bound gets NaN (the tokens before it their exact values), as documented."""
    q, k, v, _ = make(2, 5, False)
    out = fast(q, k, v, offset=torch.tensor([0, MAX_POSITION - 2]))
    assert out[1, :, 3:].isnan().all() and not out[1, :, :3].isnan().any() and not out[0].isnan().any()
    close(out[:, :, :3], naive(q, k, v)[:, :, :3])


# --- hyperparameters, states and flags: refused up front ----------------------------------------

@pytest.mark.parametrize("base", [float("nan"), float("inf"), 0.0, -2.0, True, "1e4"], ids=str)
def test_a_bad_rope_base_is_refused_everywhere(base, backend):
    q, k, v, _ = make(1, 4, False)
    calls = [lambda: fast(q, k, v, base=base), lambda: naive(q, k, v, base=base),
             lambda: step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, 0, base=base),
             lambda: apply_rotary(q, base=base),
             lambda: RotaryLinearAttention(8, heads=2, dim_head=4, base=base),
             lambda: SoftmaxAttention(8, heads=2, dim_head=4, base=base),
             lambda: PerformerLM(ModelConfig(**{**MODEL_PRESETS["tiny"], "rope_base": base}))]
    for call in calls:  # ModelConfig checks field types first: a bool or str rope_base is a TypeError there
        with pytest.raises((ValueError, TypeError), match="base"):
            call()


@pytest.mark.parametrize("where", ["S", "z"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_initial_state_is_refused(value, where, checked):
    """A NaN in initial_state.z used to make the denominator NaN, which the guard then took for 0:
    a finite output from a NaN state, in the reference too."""
    q, k, v, w = make(2, 6, False)
    S0, z0 = state(2)
    (S0 if where == "S" else z0)[1, 0, 2] = value
    st = LinearAttentionState(S0, z0)
    for call in (lambda: fast(q, k, v, initial_state=st), lambda: fast(q, k, v, initial_state=st, causal=False),
                 lambda: naive(q, k, v, initial_state=st), lambda: recurrent(q, k, v, initial_state=st)):
        with pytest.raises(ValueError, match="initial_state: S and z must be finite"):
            call()
    with pytest.raises(ValueError, match="^state: S and z must be finite"):
        step(q[:, :, 0], k[:, :, 0], v[:, :, 0], st, 0)
    torch.manual_seed(0)
    layer = RotaryLinearAttention(8, heads=2, dim_head=4, nb_features=M)
    with pytest.raises(ValueError, match="initial_state: S and z must be finite"):
        layer(torch.randn(2, 6, 8), initial_state=LinearAttentionState(S0[:, :, :, :4], z0))


def test_unchecked_value_errors_give_nan_or_what_the_values_give(unchecked):
    """The chunk-parallel path without LINEAR_ROPE_CHECKS, as documented: a NaN state, a NaN
    projection give NaN outputs; negative features give Eq. 19 of those features (what
    allow_negative=True gives); an overflowing key sum gives z = inf. No error, no sync."""
    q, k, v, w = make(2, 6, True)
    qf, kf, vf, _ = make(2, 6, False)
    S0, z0 = state(2)
    z0[1, 0, 2] = float("nan")
    out = fast(qf, kf, vf, initial_state=LinearAttentionState(S0, z0))
    assert out[1, 0].isnan().all() and not out[0].isnan().any()
    assert fast(q, k, v, projection=w.clone().fill_(float("nan"))).isnan().all()
    close(fast(qf, kf - 0.5, vf), naive(qf, kf - 0.5, vf, allow_negative=True))
    big = (kf / kf.max() * 3e38).float()
    _, st = fast(qf.float(), big, vf.float(), output_final_state=True)
    assert torch.isinf(st.z).any()


@pytest.mark.parametrize("causal", MODES)
def test_a_nan_denominator_stays_nan(causal, backend):
    """The guard divides by 1 where the denominator is <= 0, never where it is NaN: a NaN in a real
    key gives NaN outputs wherever it is seen, as in the reference (the recurrent path, which
    returns a state at every token, refuses the non-finite state instead)."""
    q, k, v, _ = make(1, 9, False)
    k[0, 0, 4, 0] = float("nan")
    ref = naive(q, k, v, causal=causal)
    out = fast(q, k, v, causal=causal)
    assert torch.equal(out.isnan(), ref.isnan()) and out[0, 0, 4 if causal else 0:].isnan().all()
    with pytest.raises(ValueError, match="not finite"):
        recurrent(q, k, v)


def test_a_compiled_call_refuses_an_overflowing_state_as_eager_does(checked):
    """k * 3e38 with output_final_state: eager raises; compiled code used to return z = inf. It
    raises the same message now (torch._assert_async: a RuntimeError when the graph runs)."""
    q, k, v, _ = (None if t is None else t.float() for t in make(1, 40, False))
    k = k / k.max() * 3e38
    with pytest.raises(ValueError, match="final state's key sum z is not finite"):
        fast(q, k, v, output_final_state=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: fast(a, b, c, output_final_state=True), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(RuntimeError, match="final state's key sum z is not finite"):
        compiled(q, k, v)
    torch._dynamo.reset()


@pytest.mark.parametrize("flag", ["causal", "rotary", "output_final_state", "allow_negative"])
@pytest.mark.parametrize("value", [1, 0, "yes", None, torch.tensor(True)], ids=["1", "0", "str", "None", "tensor"])
def test_flags_must_be_bools(flag, value, backend):
    q, k, v, _ = make(1, 4, False)
    with pytest.raises(ValueError, match=f"{flag} must be True or False"):
        fast(q, k, v, **{flag: value})
    with pytest.raises(ValueError, match=f"{flag} must be True or False"):
        naive(q, k, v, **{flag: value})


def test_bools_are_not_tokens_positions_or_inputs(backend):
    torch.manual_seed(0)
    lm = PerformerLM(ModelConfig(**MODEL_PRESETS["tiny"]))
    _, states = lm(torch.tensor([[1, 2, 3]]), output_final_state=True)
    with pytest.raises(ValueError, match="token must be an integer tensor"):
        lm.step(torch.tensor([True]), states, 3)
    q, k, v, _ = make(1, 4, False)
    with pytest.raises(ValueError, match="position"):
        step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, True)
    with pytest.raises(ValueError, match="position"):
        step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, torch.tensor([True]))
    layer = RotaryLinearAttention(8, heads=2, dim_head=4)
    with pytest.raises(ValueError, match="x_t must be a floating-point tensor"):
        layer.step(torch.ones(1, 8, dtype=torch.bool), None, 0)
    with pytest.raises(ValueError, match="offset"):
        fast(q, k, v, offset=True)


# --- a keyword that would do nothing is refused, not dropped ------------------------------------

def test_keywords_without_effect_are_refused(backend):
    q, k, v, w = make(1, 6, True)
    qf, kf, vf, _ = make(1, 6, False)
    cases = {
        "offset": lambda: fast(qf, kf, vf, rotary=False, offset=3),
        "offset ": lambda: naive(qf, kf, vf, rotary=False, offset=torch.tensor([0])),
        "base": lambda: fast(qf, kf, vf, rotary=False, base=500.0),
        "base ": lambda: step(qf[:, :, 0], kf[:, :, 0], vf[:, :, 0], None, 0, rotary=False, base=500.0),
        "allow_negative": lambda: fast(q, k, v, projection=w, allow_negative=True),
        "allow_negative ": lambda: step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, 0, projection=w, allow_negative=True),
        "chunk_size": lambda: fast(qf, kf, vf, causal=False, chunk_size=16),
        "block_size": lambda: fast(qf, kf, vf, causal=False, block_size=16),
        "context_mask": lambda: RotaryLinearAttention(8, heads=2, dim_head=4)(
            torch.randn(1, 3, 8), context_mask=torch.ones(1, 3, dtype=torch.bool)),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError, match=name.strip()) as err:
            call()
        assert "effect" in str(err.value) and "\n" not in str(err.value), (name, err.value)
    # what the defaults and the effective keywords do is unchanged
    close(fast(qf, kf, vf, rotary=False, offset=0, base=10000.0), naive(qf, kf, vf, rotary=False))
    close(fast(qf, kf, vf, chunk_size=2, block_size=4), naive(qf, kf, vf))


# --- every documented check, on every backend, for the calls that reach it ----------------------

def _misuse():
    """(argument named, call, what the message says) for every check of the op's shapes, types
    and host-side values: none reads a tensor's values, so they hold on every backend."""
    q, k, v, w = make(2, 5, True)
    qf, kf, vf, _ = make(2, 5, False)
    S0, z0 = state(2)
    st = LinearAttentionState(S0, z0)
    one = [t[:1] for t in (qf, kf, vf)]
    cu = lambda c, **kw: fast(*one, cu_seqlens=torch.tensor(c, dtype=torch.int32), **kw)  # noqa: E731
    layer = RotaryLinearAttention(8, heads=2, dim_head=4, nb_features=M)
    x = torch.randn(2, 5, 8)
    return [
        ("q", lambda: fast(qf.long(), kf, vf), "floating-point"),
        ("q", lambda: fast(qf[0], kf[0], vf[0]), r"\[B, H, N, \.\]"),
        ("k", lambda: fast(qf, kf[:, :1], vf), "must have shape"),
        ("v", lambda: fast(qf, kf, vf[:, :, :3]), "must have shape"),
        ("q, k, v", lambda: fast(qf, kf.float(), vf), "share a dtype"),
        ("q", lambda: fast(qf[..., :5], kf[..., :5], vf), "even number of features"),
        ("projection", lambda: fast(q, k, v, projection=w[:, :3]), r"\[m, d=6\]"),
        ("projection", lambda: fast(q[..., :5], k[..., :5], v, projection=w[:5, :5]), "even number"),
        ("mask", lambda: fast(qf, kf, vf, mask=torch.ones(2, 4, dtype=torch.bool)), r"shape \[2, 5\]"),
        ("mask", lambda: fast(qf, kf, vf, mask=torch.ones(2, 5)), "bool tensor"),
        ("mask", lambda: fast(qf, kf, vf, mask=torch.ones(2, 5, dtype=torch.bool, device="meta")), "is on meta"),
        ("mask", lambda: layer(x, mask=torch.ones(2, 5, dtype=torch.long)), "bool tensor"),
        ("key_mask", lambda: fast(qf, kf, vf, key_mask=torch.ones(2, 5, dtype=torch.bool)), "cross-attention"),
        ("initial_state", lambda: fast(qf, kf, vf, initial_state=S0), "LinearAttentionState"),
        ("initial_state", lambda: fast(qf, kf, vf, initial_state=(S0[..., :3], z0)), r"want S \[2, 2, 8, 5\]"),
        ("initial_state", lambda: fast(qf, kf, vf, initial_state=(S0.long(), z0.long())), "floating point"),
        ("initial_state", lambda: fast(qf, kf, vf, initial_state=(S0.to("meta"), z0.to("meta"))), "is on meta"),
        ("initial_state", lambda: layer(x, initial_state=st), r"want S \[2, 2, 8, 4\]"),
        ("state", lambda: step(qf[:, :, 0], kf[:, :, 0], vf[:, :, 0], (S0[:1], z0[:1]), 0), "do not match"),
        ("cu_seqlens", lambda: cu([0, 3, 2, 5]), "never decrease"),
        ("cu_seqlens", lambda: cu([0, 3, 4]), "end at T=5"),
        ("cu_seqlens", lambda: cu([1, 3, 5]), "start at 0"),
        ("cu_seqlens", lambda: fast(*one, cu_seqlens=torch.tensor([0.0, 5.0])), "int32"),
        ("cu_seqlens", lambda: fast(qf, kf, vf, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), "one row"),
        ("cu_seqlens", lambda: layer(x[:1], cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)), "end at T=5"),
        ("offset", lambda: fast(qf, kf, vf, offset=1.5), "an int or an integer tensor"),
        ("offset", lambda: fast(qf, kf, vf, offset=-1), "non-negative"),
        ("offset", lambda: fast(qf, kf, vf, offset=torch.tensor([0, 1, 2])), r"integer tensor \[2\]"),
        ("offset", lambda: cu([0, 2, 5], offset=torch.tensor([0])), r"integer tensor \[2\]"),
        ("position", lambda: step(qf[:, :, 0], kf[:, :, 0], vf[:, :, 0], None, torch.tensor([0.5, 1.0])), "integer"),
        ("base", lambda: fast(qf, kf, vf, base=float("nan")), "finite number > 0"),
        ("chunk_size", lambda: fast(qf, kf, vf, chunk_size=0), "positive int"),
        ("block_size", lambda: fast(qf, kf, vf, block_size=2.0), "positive int"),
        ("chunk_size", lambda: fast(qf, kf, vf, causal=False, chunk_size=4), "no effect"),
        ("offset", lambda: fast(qf, kf, vf, rotary=False, offset=2), "no effect"),
        ("allow_negative", lambda: fast(q, k, v, projection=w, allow_negative=True), "no effect"),
        ("causal", lambda: fast(qf, kf, vf, causal=1), "True or False"),
        ("q_t", lambda: step(qf, kf, vf, None, 0), "one token"),
    ]


def test_every_shape_and_type_check_holds_on_every_backend(backend):
    for name, call, says in _misuse():
        with pytest.raises(ValueError) as err:
            call()
        msg = one_line(err)
        assert msg.startswith(name) and re.search(says, msg), (name, says, msg)


def test_negative_features_are_refused_unless_allowed(checked):
    """features >= 0 (a value check): the op causal and bidirectional, masked padding never
    read, the step, the layer's elu / relu inputs are non-negative by construction."""
    q, k, v, _ = make(2, 5, False)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 0] = False
    for name, call in (("q", lambda: fast(q - 1.0, k, v)), ("k", lambda: fast(q, k - 1.0, v, causal=False)),
                       ("q_t", lambda: step(q[:, :, 0] - 1.0, k[:, :, 0], v[:, :, 0], None, 0)),
                       ("q", lambda: fast(q - 1.0, k, v, mask=mask))):
        with pytest.raises(ValueError, match="features must be non-negative.*allow_negative=True") as err:
            call()
        assert one_line(err).startswith(("q", "k"))
    qp = q.clone()
    qp[0, :, 0] = -5.0  # a padded token: never read
    close(fast(qp, k, v, mask=mask), naive(q, k, v, mask=mask))
    for causal in (True, False):
        close(fast(q - 0.01, k, v, allow_negative=True, causal=causal),
              naive(q - 0.01, k, v, allow_negative=True, causal=causal))


def test_the_removed_triton_backend_is_one_line(monkeypatch):
    """LINEAR_ROPE_BACKEND=triton names where the removed kernels are, in one line, at the op's
    first call (and at a program's start: tests/test_cli.py)."""
    from linear_rope.ops import backend

    q, k, v, _ = make(1, 6, False)
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="were removed") as e:
        fast(q, k, v)
    assert "\n" not in str(e.value) and "docs/gpu.md" in str(e.value)
    with pytest.raises(ValueError, match="were removed"):
        with backend.use_backend("triton"):
            pass


# --- the crashes that used to come from inside torch --------------------------------------------

def test_clear_errors_instead_of_internal_crashes(checked):
    q, k, v, w = make(2, 5, True)
    with pytest.raises(ValueError, match="projection has 0 rows"):
        fast(q, k, v, projection=w[:0])
    with pytest.raises(ValueError, match="projection must be finite"):
        fast(q, k, v, projection=w.clone().fill_(float("nan")))
    meta = [t.to("meta") for t in (q, k, v)]
    with pytest.raises(ValueError, match="meta tensors"):
        fast(*meta, projection=w.to("meta"))
    with pytest.raises(ValueError, match="meta tensors"):
        RotaryLinearAttention(8, heads=2, dim_head=4).to("meta")(torch.randn(1, 3, 8, device="meta"))
    with pytest.raises(ValueError, match="share a device"):
        fast(q, k.to("meta"), v, projection=w)
    torch.manual_seed(0)
    sm = SoftmaxAttention(8, heads=2, dim_head=4)
    _, cache = sm(torch.randn(3, 4, 8), output_final_state=True)
    with pytest.raises(ValueError, match=r"state: a KVCache of k, v \[B=2"):
        sm.step(torch.randn(2, 8), cache, 4)
    with pytest.raises(ValueError, match="x_t must be a floating-point tensor"):
        sm.step(torch.ones(3, 8, dtype=torch.long), cache, 4)


# --- no tokens: N = 0 and empty packed documents ------------------------------------------------

@pytest.mark.parametrize("causal", MODES)
def test_no_tokens_pass_the_state_through(causal, backend):
    q, k, v, _ = make(2, 0, False)
    S0, z0 = (t.requires_grad_() for t in state(2))
    out, (S, z) = fast(q, k, v, causal=causal, initial_state=LinearAttentionState(S0, z0), output_final_state=True)
    assert out.shape == (2, H, 0, E)
    assert torch.equal(S, S0) and torch.equal(z, z0)
    dS, dz = torch.autograd.grad(S.sum() + 2 * z.sum(), (S0, z0))
    assert (dS == 1).all() and (dz == 2).all()
    ref = naive(q, k, v, causal=causal, initial_state=LinearAttentionState(S0, z0), output_final_state=True)
    close(ref[1].S, S0), close(ref[1].z, z0)


@pytest.mark.parametrize("path", ["chunk", "bidirectional", "recurrent"])
def test_empty_packed_documents_keep_their_state(path, backend):
    op = recurrent if path == "recurrent" else fast
    causal = path != "bidirectional"
    q, k, v, _ = make(1, 10, False, seed=3)
    cu = torch.tensor([0, 0, 4, 4, 10, 10], dtype=torch.int32)  # documents 0, 2 and 4 are empty
    S0, z0 = state(5)
    kw = dict(causal=causal, cu_seqlens=cu, offset=torch.tensor([1, 2, 3, 4, 5]),
              initial_state=LinearAttentionState(S0, z0), output_final_state=True)
    out, st = op(q, k, v, **kw)
    ref, ref_st = naive(q, k, v, **kw)
    close(out, ref), close(st.S, ref_st.S), close(st.z, ref_st.z)
    for d in (0, 2, 4):
        assert torch.equal(st.S[d], S0[d]) and torch.equal(st.z[d], z0[d])
    _, fresh = op(q, k, v, causal=causal, cu_seqlens=cu, output_final_state=True)
    assert (fresh.S[[0, 2, 4]] == 0).all() and (fresh.z[[0, 2, 4]] == 0).all()


def test_uninitialised_memory_is_nan_in_the_test_run():
    """conftest.py fills every uninitialised allocation with NaN, so a buffer read before it is
    written shows up; the op's buffer pool hands out poisoned buffers too, also when reused."""
    from linear_rope.ops import workspace

    assert torch.empty(3).isnan().all() and torch.empty_like(torch.ones(2)).isnan().all()
    assert torch.ones(1).new_empty(4).isnan().all() and torch.empty_strided((2,), (1,)).isnan().all()
    assert (torch.empty(2, dtype=torch.long) == torch.iinfo(torch.long).max).all()
    like = torch.ones(1)
    a = workspace.empty((5,), like)
    a.fill_(1.0)
    del a
    assert workspace.empty((5,), like).isnan().all()
    assert math.isnan(float(torch.empty(1)))
