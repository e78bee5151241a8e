"""The checks row of ``benchmarks.gpu``: is the default path right on the device?

Every keyword case in float64, float32, bfloat16 and float16 on the path a user's call takes
(``LINEAR_ROPE_BACKEND`` unset: auto; each check records the path), against the naive op in
float64 on the same rounded inputs; strict causality; step = forward; finite training steps.
How it measures: docs/performance.md, "Methods" (``benchmarks.gpu_checks``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from linear_rope import (
    FavorFeatures, PerformerLM, RotaryLinearAttention, naive_rotary_linear_attention, rotary_linear_attention,
    rotary_linear_attention_step,
)

from linear_rope.ops.tolerances import HALF_CONTRACT, check, rounded_error, tolerance
from linear_rope.ops.backend import record_paths

from .common import one_line

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
FULL = dict(B=2, H=3, N=300, d=64, m=266)  # paper head dims; N > one 256-token block
QUICK = dict(B=2, H=2, N=70, d=64, m=266)


def _rand(shape, g, *, positive=False):
    return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.01) if positive else \
        torch.randn(shape, generator=g, dtype=torch.float64)


def _record(name: str, dtype, tol: dict, errs: dict) -> dict:
    """A check's record from its measured errors (``tolerances.check`` of each tensor)."""
    worst = max(e["worst_over_tol"] for e in errs.values())
    return {"check": name, "dtype": str(dtype)[6:], "rtol": tol["rtol"], "atol": tol["atol"], "why": tol["why"],
            "errors": errs, "worst_over_tol": worst, "max_rel_to_max": max(e["max_rel_to_max"] for e in errs.values()),
            "passed": bool(worst <= 1.0)}


def _causal(name: str, dtype, a: torch.Tensor, b: torch.Tensor, t0: int, dim: int) -> dict:
    """Outputs before ``t0`` must not move at all (along ``dim``); those from ``t0`` on must."""
    d = (a.double() - b.double()).abs()
    diff, moved = float(d.narrow(dim, 0, t0).max()), float(d.narrow(dim, t0, d.shape[dim] - t0).max())
    return {"check": name, "dtype": str(dtype)[6:], "max_abs_before_t0": diff, "max_abs_from_t0": moved,
            "passed": diff == 0.0 and moved > 0}


def _outputs(res):
    """(out, tensors of a final state or ()) of an op result."""
    return (res[0], tuple(res[1])) if isinstance(res, tuple) else (res, ())


# --- the keyword cases: each builds inputs (float64, CPU) and calls an op -------------------------

def _case_inputs(s, g, *, features=False, M=None):
    B, H, N, x = s["B"], s["H"], s["N"], (s["m"] if features else s["d"])
    q = _rand((B, H, N, x), g, positive=features)
    k = _rand((B, H, M or N, x), g, positive=features)
    v = _rand((B, H, M or N, s["d"]), g)
    return [q, k, v]


def _pad_mask(B, N, device):
    """Row 0 left-padded by 7, row 1 right-padded by 13 (other rows full)."""
    mask = torch.ones(B, N, dtype=torch.bool, device=device)
    mask[0, :7] = False
    mask[1 % B, N - 13:] = False
    return mask


def _cases(s: dict, dev: torch.device):
    """name -> (inputs (float64 CPU), call(op, q, k, v, W) -> result). W is the projection in
    the dtype the caller chose (float32 for the fast path, float64 for the reference)."""
    g = torch.Generator().manual_seed(0)
    B, N = s["B"], s["N"]
    offs = torch.tensor([0, 1000] + [5] * (B - 2), device=dev)
    docs = torch.tensor([0, N // 3, N // 3 + 1, N], dtype=torch.int32, device=dev)  # a 1-token document too
    split = N // 3 + 5
    cases = {
        "features_first (per-row offsets)": (
            _case_inputs(s, g, features=True),
            lambda op, q, k, v, W: op(q, k, v, offset=offs)),
        "projection (FAVOR+ inside)": (
            _case_inputs(s, g),
            lambda op, q, k, v, W: op(q, k, v, projection=W, offset=1000)),
        "bidirectional": (
            _case_inputs(s, g),
            lambda op, q, k, v, W: op(q, k, v, projection=W, causal=False)),
        "mask (left + right padding)": (
            _case_inputs(s, g),
            lambda op, q, k, v, W: op(q, k, v, projection=W, mask=_pad_mask(B, N, dev))),
        "cu_seqlens + final state": (
            [t[:1] for t in _case_inputs(s, g)],
            lambda op, q, k, v, W: op(q, k, v, projection=W, cu_seqlens=docs, output_final_state=True)),
        "key_mask (cross-attention)": (
            _case_inputs(s, g)[:1] + _case_inputs(s, g, M=N + 37)[1:],
            lambda op, q, k, v, W: op(q, k, v, projection=W, causal=False, rotary=False,
                                      mask=_pad_mask(B, N, dev), key_mask=_pad_mask(B, N + 37, dev))),
        "small blocks (chunk 16, block 48, mask)": (
            _case_inputs(s, g),
            lambda op, q, k, v, W: op(q, k, v, projection=W, mask=_pad_mask(B, N, dev),
                                      **({} if op is naive_rotary_linear_attention else dict(chunk_size=16, block_size=48)))),
    }
    # A state on the scale real ones have: that of a 50-token prefix (features are far below 1,
    # so a random state would swamp them and push the fp16 gradients of k, v below fp16's range).
    prefix = [t[:, :, :50].to(dev) for t in _case_inputs(s, g)]

    def with_state(op, q, k, v, W):
        _, st = naive_rotary_linear_attention(*prefix, projection=W.double(), output_final_state=True)
        return op(q, k, v, projection=W, offset=offs + 50, initial_state=st, output_final_state=True)

    def chained(op, q, k, v, W):
        if op is naive_rotary_linear_attention:  # the reference: one call over the whole sequence
            return op(q, k, v, projection=W, output_final_state=True)
        o1, st = op(q[:, :, :split], k[:, :, :split], v[:, :, :split], projection=W, output_final_state=True)
        o2, st = op(q[:, :, split:], k[:, :, split:], v[:, :, split:], projection=W, offset=split,
                    initial_state=st, output_final_state=True)
        return torch.cat((o1, o2), dim=2), st

    cases["initial_state + output_final_state"] = (_case_inputs(s, g), with_state)
    cases[f"state chaining (split at {split})"] = (_case_inputs(s, g), chained)
    return cases


def _run(op, call, xs, W, ups=None):
    """(out, state tensors, grads of xs) of one case; ``ups`` None: fresh random upstream grads."""
    out, st = _outputs(call(op, *xs, W))
    if ups is None:
        g = torch.Generator().manual_seed(1)
        ups = [_rand(t.shape, g).to(t.device, t.dtype) for t in (out, *st)]
    grads = torch.autograd.grad([out, *st], xs, [u.to(t.dtype) for u, t in zip(ups, (out, *st))])
    return out, st, grads, ups


def _check_case(name, inputs, call, dtype, ctx, W32) -> dict:
    """One keyword case on the default path (``LINEAR_ROPE_BACKEND`` as set; unset: auto), the
    path it took recorded, against the naive op in float64 on the same rounded inputs."""
    tol = tolerance(dtype)
    rec = {"check": name, "dtype": str(dtype)[6:], "rtol": tol["rtol"], "atol": tol["atol"],
           "grad_atol": tol["grad_atol"], "why": tol["why"]}
    xs = [t.to(ctx.device, dtype).requires_grad_() for t in inputs]
    refs = [t.detach().double().requires_grad_() for t in xs]  # the same rounded values
    with record_paths() as paths:
        out, st, grads, ups = _run(rotary_linear_attention, call, xs, W32.double() if dtype == torch.float64 else W32)
    rec["path"] = "; ".join(dict.fromkeys(paths)) or "not recorded"
    rout, rst, rgrads, _ = _run(naive_rotary_linear_attention, call, refs, W32.double(), ups)
    names = ["out", *("S", "z")[:len(st)], "dq", "dk", "dv"]
    fast, ref = [out, *st, *grads], [rout, *rst, *rgrads]
    errs = {n: check(a, b, tol, grad=n.startswith("d")) for n, a, b in zip(names, fast, ref)}
    contract = True
    if dtype != torch.float64:  # what a plain float32 computation, rounded once to dtype, achieves
        b32 = [t.detach().float().requires_grad_() for t in xs]
        bout, bst, bgrads, _ = _run(naive_rotary_linear_attention, call, b32, W32.float(), ups)
        for n, a, b in zip(names, [bout, *bst, *bgrads], ref):
            base = rounded_error(a, b, dtype) if dtype != torch.float32 else check(a, b, tol)["max_rel_to_max"]
            errs[n]["naive_fp32_max_rel_to_max"] = base
            if dtype in (torch.bfloat16, torch.float16):  # the half-precision contract: within 2x of it
                errs[n]["over_fp32_rounded"] = errs[n]["max_rel_to_max"] / max(base, torch.finfo(dtype).eps / 8)
                contract &= errs[n]["over_fp32_rounded"] <= HALF_CONTRACT
    worst = max(e["worst_over_tol"] for e in errs.values())
    rec.update(errors=errs, worst_over_tol=worst, max_rel_to_max=max(e["max_rel_to_max"] for e in errs.values()),
               passed=bool(worst <= 1.0 and contract))
    if not contract:
        rec["error"] = f"more than {HALF_CONTRACT}x float32 rounded to {str(dtype)[6:]}"
    return rec


def _layer_context(ctx, s: dict) -> dict:
    """The layer's ``context=`` / ``context_mask=`` against the naive op on the layer's own
    projections, float64."""
    tol = tolerance(torch.float64)
    torch.manual_seed(0)
    H, d = s["H"], s["d"]
    layer = RotaryLinearAttention(H * d, heads=H, dim_head=d, nb_features=s["m"], causal=False, position="none")
    layer = layer.to(ctx.device, torch.float64)
    g = torch.Generator().manual_seed(2)
    B, N, M = s["B"], s["N"], s["N"] + 37
    x, c = _rand((B, N, H * d), g).to(ctx.device), _rand((B, M, H * d), g).to(ctx.device)
    qm, cm = _pad_mask(B, N, ctx.device), _pad_mask(B, M, ctx.device)
    out = layer(x, context=c, context_mask=cm, mask=qm)
    w = layer.to_qkv.weight
    heads = lambda t: t.view(B, t.shape[1], H, d).transpose(1, 2)  # noqa: E731
    q, k, v = heads(x @ w[:H * d].t()), heads(c @ w[H * d:2 * H * d].t()), heads(c @ w[2 * H * d:].t())
    ref = naive_rotary_linear_attention(q, k, v, causal=False, rotary=False, projection=layer.features.projection,
                                        mask=qm, key_mask=cm)
    ref = layer.to_out(ref.transpose(1, 2).reshape(B, N, H * d))
    return _record("layer context= / context_mask=", torch.float64, tol, {"out": check(out, ref, tol)})


def _causality_op(ctx, s: dict, dtype) -> dict:
    g = torch.Generator().manual_seed(3)
    q, k, v = (t.to(ctx.device, dtype) for t in _case_inputs(s, g))
    W = FavorFeatures(s["d"], s["m"]).projection.to(ctx.device)
    t0 = s["N"] // 2 + 3  # inside a chunk
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :, t0:] = 3 * _rand(t[:, :, t0:].shape, g).to(t)
    with torch.no_grad():
        a = rotary_linear_attention(q, k, v, projection=W)
        b = rotary_linear_attention(q2, k2, v2, projection=W)
    return _causal(f"strict causality: op, change from t={t0}", dtype, a, b, t0, 2)


def _causality_lm(ctx, s: dict, dtype) -> dict:
    torch.manual_seed(0)
    model = PerformerLM.from_preset("tiny").to(ctx.device)
    N = s["N"]
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (2, N), generator=g).to(ctx.device)
    t0 = N // 2 + 3
    ids2 = ids.clone()
    ids2[:, t0:] = torch.randint(0, 256, (2, N - t0), generator=g).to(ctx.device)
    with torch.no_grad(), torch.autocast(ctx.device.type, dtype=dtype):
        a, b = model(ids), model(ids2)
    return _causal(f"strict causality: tiny LM logits, change from t={t0} ({str(dtype)[6:]} autocast)", dtype, a, b,
                   t0, 1)


def _step_op(ctx, s: dict, dtype) -> dict:
    tol = tolerance(dtype)
    g = torch.Generator().manual_seed(5)
    q, k, v = (t.to(ctx.device, dtype) for t in _case_inputs(s, g))
    W = FavorFeatures(s["d"], s["m"]).projection.to(ctx.device, torch.promote_types(dtype, torch.float32))
    offs = torch.tensor([0, 1000] + [5] * (s["B"] - 2), device=ctx.device)
    with torch.no_grad():
        full, (S, z) = rotary_linear_attention(q, k, v, projection=W, offset=offs, output_final_state=True)
        state, outs = None, []
        for t in range(s["N"]):
            o, state = rotary_linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, offs + t, projection=W)
            outs.append(o)
    return _record("step = forward: op, per-row positions", dtype, tol,
                   {"out": check(torch.stack(outs, 2), full, tol), "S": check(state.S, S, tol), "z": check(state.z, z, tol)})


def _step_lm(ctx, s: dict, dtype) -> dict:
    tol = tolerance(dtype)
    torch.manual_seed(0)
    model = PerformerLM.from_preset("tiny").to(ctx.device, dtype).eval()
    g = torch.Generator().manual_seed(6)
    N, p = s["N"], s["N"] // 3
    ids = torch.randint(0, 256, (2, N), generator=g).to(ctx.device)
    with torch.no_grad():
        full = model(ids)
        logits, states = model(ids[:, :p], output_final_state=True)
        outs = [logits]
        for t in range(p, N):
            lt, states = model.step(ids[:, t], states, t)
            outs.append(lt[:, None])
    return _record(f"step = forward: tiny LM, prefill {p} then steps", dtype, tol,
                   {"logits": check(torch.cat(outs, 1), full, tol)})


def _first_nonfinite(model: torch.nn.Module):
    """Forward hooks noting the first module (in call order) whose output holds inf or NaN:
    where an overflow starts. Returns (the list it fills, the hooks to remove)."""
    first: list[str] = []

    def hook(name):
        def note(mod, inp, out):
            t = out[0] if isinstance(out, tuple) else out
            if not first and isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                first.append(f"{name} ({str(t.dtype)[6:]} output)")
        return note
    return first, [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]


def _train_finite(ctx, preset: str, dtype, *, batch: int, seq: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = PerformerLM.from_preset(preset).to(ctx.device)
    first, hooks = _first_nonfinite(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(7)
    losses, norms = [], []
    for _ in range(steps):
        ids = torch.randint(0, 256, (batch, seq + 1), generator=g).to(ctx.device)
        with torch.autocast(ctx.device.type, dtype=dtype):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    finite = lambda x: x == x and abs(x) != float("inf")  # noqa: E731
    applied = sum(map(finite, norms))  # fp16: GradScaler skips a step whose gradients overflowed
    params_ok = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    ok = all(map(finite, losses)) and params_ok and (applied == steps if dtype != torch.float16 else applied >= 1)
    return {"check": f"training steps finite: {preset} preset, {batch}x{seq}, {str(dtype)[6:]} autocast"
                     + (" + GradScaler" if dtype == torch.float16 else ""),
            "dtype": str(dtype)[6:], "losses": losses, "grad_norms": norms, "steps_applied": applied,
            "first_nonfinite_module": first[0] if first else None, "passed": ok}


def run(ctx) -> dict:
    """Every check; each records its measured error and pass/fail (or its error)."""
    s = QUICK if ctx.quick else FULL
    torch.manual_seed(0)  # the FAVOR+ projections and the models
    checks = []

    def attempt(name, dtype, fn, *args, **kw):
        if ctx.left() <= 0:
            checks.append({"check": name, "dtype": str(dtype)[6:], "passed": False,
                           "error": "skipped: row budget spent before this check"})
            return
        try:
            checks.append(fn(*args, **kw))
        except Exception as e:  # recorded, and the check fails: never silently
            checks.append({"check": name, "dtype": str(dtype)[6:], "passed": False, "error": one_line(e)})

    W32 = FavorFeatures(s["d"], s["m"]).projection.to(ctx.device)
    cases = _cases(s, ctx.device)
    for dtype in DTYPES:
        for name, (inputs, call) in cases.items():
            attempt(name, dtype, _check_case, name, inputs, call, dtype, ctx, W32)
    attempt("layer context", torch.float64, _layer_context, ctx, s)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        attempt("causality op", dtype, _causality_op, ctx, s, dtype)
    attempt("causality LM", torch.bfloat16, _causality_lm, ctx, s, torch.bfloat16)
    for dtype in (torch.float64, torch.float32):
        attempt("step op", dtype, _step_op, ctx, s, dtype)
        attempt("step LM", dtype, _step_lm, ctx, s, dtype)
    for dtype in (torch.bfloat16, torch.float16):
        attempt("train tiny", dtype, _train_finite, ctx, "tiny", dtype, batch=4, seq=64, steps=3)
    if ctx.cuda:  # the device check that once turned NaN at its third step
        attempt("train paper fp16", torch.float16, _train_finite, ctx, "paper", torch.float16, batch=2, seq=1024, steps=4)
    else:
        checks.append({"check": "training steps finite: paper preset fp16", "dtype": "float16", "passed": None,
                       "error": "skipped: needs CUDA (the paper preset is too slow for the CPU quick mode)"})
    failed = [c["check"] + " / " + c["dtype"] for c in checks if c["passed"] is False]
    return {"sizes": s, "checks": checks, "passed": sum(c["passed"] is True for c in checks), "failed": failed,
            "paths": sorted({c["path"] for c in checks if "path" in c})}
