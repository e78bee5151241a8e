"""The fused path in ``benchmarks.gpu_predict --backend fused``: the model compiled with the real
kernels (``linear_rope/ops/fused``), each launch priced by ``linear_rope/ops/fused/pricing.py``.

Under ``fused_core()`` the model's calls take the backend the package takes on CUDA by default
(``auto``: the fused path for bf16 calls; the predictor's fake CUDA tensors are CUDA tensors to
it), so Inductor sees the ``triton_op``s ``linear_rope::fused_forward`` / ``fused_backward`` and
calls their kernels as user Triton kernels: ``_states``, ``_output`` forward; ``_dden``,
``_dstates`` and ``_dqkv`` three times (PART 0, 1, 2: dq, dk, dv) backward. ``fused_kernel`` prices one such
launch from its arguments (shapes, dtypes, constexprs) by the formulas: unique bytes priced,
re-read bytes shown, FLOPs as executed, the grid's fill; its grid is checked against the
formula's. ``check_fused``: a fused compilation without every launch is an error.
"""
from __future__ import annotations

import contextlib

from linear_rope.ops.fused import pricing


@contextlib.contextmanager
def fused_core():
    """Within the block, the op's backend is ``auto`` (the package's default), whatever
    ``LINEAR_ROPE_BACKEND`` says: on (fake) CUDA tensors, bf16 calls take the fused kernels. The
    self-check (``fused/selfcheck.py``) cannot run on a fake device (nothing runs here): every
    specialization is taken as passed for the block (``selfcheck.pricing_only``), as on a GPU
    where it passed; nothing is stored."""
    from linear_rope.ops.backend import use_backend
    from linear_rope.ops.fused import selfcheck

    with use_backend("auto"), selfcheck.pricing_only():
        yield


def _dims(x) -> list[int]:
    return [int(s) for s in x.get_size()]


def _const(kw: dict, name: str, default=None):
    x = kw.get(name, default)
    return bool(x) if isinstance(x, bool) else x


def fused_kernel(fname: str, ir, k: dict, l2_bytes_s: float) -> dict:
    """The entry of one launch of a fused kernel (``ir``: Inductor's UserDefinedTritonKernel),
    priced by ``pricing.price``: a launch without a formula, or one the formulas do not cover
    (a mask, an initial state, a final state's gradient), is an error."""
    kw = dict(ir.kwargs)
    name = pricing.kernel_name(fname, {"PART": _const(kw, "PART")})
    for flag in ("MASK", "INIT", "FINAL_S", "FINAL_Z"):
        if _const(kw, flag):
            raise RuntimeError(f"fused kernel {name}: {flag} launches are not priced by linear_rope.ops.fused.pricing")
    x = kw.get("q", kw.get("k", kw.get("do")))
    B, H, N = _dims(x)[:3]
    d = _dims(x)[3] if "do" not in kw or "q" in kw else 0
    e = _dims(kw["v"])[-1] if "v" in kw else _dims(kw["do"])[-1]
    m = _dims(kw["wa"])[0] if "wa" in kw else 0
    lowp = bool(_const(kw, "LOWP", False))
    rotary = bool(_const(kw, "ROTARY", False))
    shape = pricing.Shape(B, H, N, d, m, e, itemsize=x.get_dtype().itemsize, lowp=lowp, rotary=rotary)
    try:
        entry = pricing.price(name, shape)
    except KeyError as err:
        raise RuntimeError(str(err.args[0])) from None
    grid = getattr(ir, "grid", None)
    if grid:
        g = grid[0] if isinstance(grid, (list, tuple)) and isinstance(grid[0], (list, tuple)) else grid
        programs = 1
        for n in g:
            programs *= int(n)
        if programs != entry["programs"]:
            raise RuntimeError(f"fused kernel {name}: its grid {list(g)} has {programs} programs, the formula "
                               f"{entry['programs']}")
    entry["reread_l2_us"] = round(1e6 * entry["reread_bytes"] / l2_bytes_s, 3)
    return dict(k, name=name, kind="own", inductor_bytes=k["bytes"], **entry)


def check_fused(graphs: list[dict], variant: str, N: int) -> None:
    """Every fused launch in the compiled step, else a RuntimeError (a fused row without them)."""
    seen = {k["name"] for g in graphs for k in g["nodes"] if k is not None and k["kind"] == "own"}
    if not seen & set(pricing.KERNELS):
        raise RuntimeError(f"--backend fused: none of the fused kernels ({', '.join(pricing.KERNELS)}) appears in "
                           f"the compiled step of {variant} at N = {N}")
    if not set(pricing.KERNELS) <= seen:
        raise RuntimeError(f"--backend fused: the step of {variant} at N = {N} has {sorted(seen)}, not all of "
                           f"{', '.join(pricing.KERNELS)}")


def design_sweep(res: dict, devices, make_row, price_us, l2_bytes_s: float) -> list[dict]:
    """The fused rows again with the block sizes of ``pricing.ALTERNATIVES`` (C, BM): the same
    compiled step, its fused launches re-priced by the formulas (the rest unchanged). Per design
    and N: step bytes and ms, the ratios to softmax's row of the same N (tokens/s, bytes), and per
    layer the launches' priced time and their re-reads at the L2 check's rate (not priced)."""
    from linear_rope.model import MODEL_PRESETS, ModelConfig
    soft = {r["N"]: r for r in res["rows"] if r["variant"] == "softmax"}
    out = []
    for row in (r for r in res["rows"] if r.get("backend") == "fused"):
        runs = [r for r in res["runs"] if r.get("backend") == "fused" and r["variant"] == row["variant"]
                and r["N"] == row["N"]]
        s1, s2 = (next(r for r in runs if r["depth"] == dp) for dp in (1, 2))
        cfg = ModelConfig(**{**MODEL_PRESETS["paper"], "position": row["variant"], "depth": row["layers"]})
        for alt in pricing.ALTERNATIVES:
            design = {**pricing.DESIGN, **alt}
            again, layer = [], {}
            for s in (s1, s2):
                s = dict(s, us=dict(s["us"]))
                for k in (k for g in s["graphs"] for k in g["kernels"] if k["kind"] == "own"):
                    new = dict(k, **pricing.reprice(k["name"], k["shape"], k["itemsize"], k["lowp"], k["rotary"],
                                                    **design))
                    s["bytes"] += new["bytes"] - k["bytes"]
                    for d in devices:
                        s["us"][d] += price_us(new, d) - k["us"][d]
                    if not again:  # depth 1: one layer's launches
                        layer[new["name"]] = new
                again.append(s)
            r = make_row(row["variant"], row["N"], row["B"], *again, cfg, devices, row["params"])
            item = {**design, "N": row["N"], "step_bytes": r["step_bytes"],
                    "kernels_us_h100": {n: round(price_us(k, "h100"), 1) for n, k in layer.items()},
                    "kernels_reread_l2_us": {n: round(1e6 * k["reread_bytes"] / l2_bytes_s, 1) for n, k in layer.items()}}
            sm = soft.get(row["N"])
            for d in devices:
                item[d] = {"step_ms": r[d]["step_ms"], "tokens_s": r[d]["tokens_s"]}
                if sm:
                    item[d]["vs_softmax_tokens_s"] = r[d]["tokens_s"] / sm[d]["tokens_s"]
            if sm:
                item["vs_softmax_bytes"] = r["step_bytes"] / sm["step_bytes"]
            out.append(item)
    return out
