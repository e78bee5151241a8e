"""Numbers behind the results figures: RoPE's decay bound, Eq. 19 weights, length extrapolation,
and TensorBoard curves as plain tables. No plotting here (see ``linear_rope.plots``).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..attention import ROW_SUM_FLOOR
from ..enwik8.runtime import Dist
from ..enwik8.trainer import evaluate
from ..model import PerformerLM
from ..ops import eq19_weights as _eq19_weights_op
from ..ops import rotary_linear_attention
from ..rotary import apply_rotary

__all__ = ["rope_decay_bound", "eq19_weights", "row_sums", "bpc_at_lengths", "read_scalars", "wall_seconds",
           "steps_to_reach", "fit_power_law", "power_law_at", "power_law_steps_to", "backtest_power_law"]


def rope_decay_bound(dim: int, max_distance: int, base: float = 10000.0) -> torch.Tensor:
    """RoFormer Fig. 2: ``(1 / (dim/2)) sum_{j=1}^{dim/2} |S_j|`` at relative distances
    ``0..max_distance``, with ``S_j = sum_{k=0}^{j-1} exp(i r theta_k)``, ``theta_k =
    base^(-2k/dim)`` (Sec. 3.4.3). By Abel summation the RoPE inner product is bounded by
    ``max_k |h_{k+1} - h_k|`` times this sum, which decays with the distance r.

    Returns float64 `[max_distance + 1]`.
    """
    if dim < 2 or dim % 2:
        raise ValueError(f"dim must be even and >= 2, got {dim}")
    if max_distance < 0:
        raise ValueError(f"max_distance must be >= 0, got {max_distance}")
    theta = base ** (-2.0 * torch.arange(dim // 2, dtype=torch.float64) / dim)
    r = torch.arange(max_distance + 1, dtype=torch.float64)
    z = torch.polar(torch.ones(len(r), len(theta), dtype=torch.float64), r[:, None] * theta)
    return z.cumsum(-1).abs().mean(-1)  # mean over j of |S_j|


@torch.no_grad()
def eq19_weights(model: PerformerLM, ids: torch.Tensor, layer: int,
                 head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The effective causal weight matrix of one head, and its row sums.

    ``W[m, n] = (R_m phi(q_m))^T (R_n phi(k_n)) / sum_{n' <= m} phi(q_m)^T phi(k_{n'})`` for
    ``n <= m`` (Eq. 19; without ``R`` for the other variants, whose rows sum to 1; ``rope_norm``
    divides each row by its sum floored at ``ROW_SUM_FLOOR``; ``softmax``: the exact causal
    softmax of the rotated scores), so that the
    head's output is ``W @ v``. ids: `[N]` bytes. Returns float64 ``W`` `[N, N]` and `[N]` sums.
    """
    if not 0 <= layer < len(model.blocks):
        raise ValueError(f"layer must be in [0, {len(model.blocks)}), got {layer}")
    attn = model.blocks[layer].attn
    if not 0 <= head < attn.heads:
        raise ValueError(f"head must be in [0, {attn.heads}), got {head}")
    seen = {}
    hook = attn.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    was_training = model.training
    try:
        model.eval()
        model(ids.reshape(1, -1).long())
    finally:
        hook.remove()
        model.train(was_training)
    if attn.position == "softmax":  # exact: softmax(R q . R k / sqrt(d)) over n <= m
        q, k, _ = attn._qkv(seen["x"])
        q, k = (apply_rotary(t[0, head].double(), base=attn.base) for t in (q, k))
        scores = (q @ k.T) / q.shape[-1] ** 0.5
        causal = torch.ones_like(scores, dtype=torch.bool).tril()
        w = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return w, w.sum(-1)
    q, k, _ = attn._qkv(seen["x"], None)  # (1, H, N, d)
    if attn.position == "rope_pre":
        q, k = apply_rotary(q, base=attn.base), apply_rotary(k, base=attn.base)
    q, k, projection = attn._op_inputs(q, k)
    w = _eq19_weights_op(q[:, head : head + 1].double(), k[:, head : head + 1].double(),
                         rotary=attn.position in ("rope", "rope_norm"), base=attn.base,
                         projection=None if projection is None else projection.double())[0, 0]
    if attn.position == "rope_norm":
        w = w / w.sum(-1, keepdim=True).clamp_min(ROW_SUM_FLOOR)
    return w, w.sum(-1)


@torch.no_grad()
def row_sums(model: PerformerLM, ids: torch.Tensor) -> torch.Tensor:
    """Row sums of every layer's and head's effective weights ``W`` (see :func:`eq19_weights`)
    in one forward pass, without forming ``W``: the op on a value of ones returns them. ids:
    `[N]` bytes. Returns float64 `[depth, heads, N]` (exactly 1 for the normalised variants)."""
    seen = []
    hooks = [b.attn.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
             for b in model.blocks]
    was_training = model.training
    try:
        model.eval()
        model(ids.reshape(1, -1).long())
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    sums = []
    for block, x in zip(model.blocks, seen):
        attn = block.attn
        if attn.position not in ("rope", "rope_norm"):  # softmax and plain linear rows sum to 1
            sums.append(x.new_ones(attn.heads, x.shape[1], dtype=torch.float64))
            continue
        q, k, _ = attn._qkv(x, None)
        ones = q.new_ones(q.shape[:-1] + (1,), dtype=torch.float64)
        q, k, projection = attn._op_inputs(q.double(), k.double())
        s = rotary_linear_attention(q, k, ones, causal=attn.causal, rotary=True, base=attn.base,
                                    projection=None if projection is None else projection.double())
        s = s[0, ..., 0]
        sums.append(s / s.clamp_min(ROW_SUM_FLOOR) if attn.position == "rope_norm" else s)
    return torch.stack(sums)


def bpc_at_lengths(model: PerformerLM, split, lengths: list[int], tokens_per_batch: int = 8192,
                   device: str | torch.device = "cpu") -> dict[int, float | None]:
    """BPC over the whole split with non-overlapping windows of each length (no context carried
    across windows; ``trainer.evaluate`` at each length). ``None`` where the model cannot run
    that length (the ``absolute`` table)."""
    dd = Dist(device=torch.device(device))
    return {n: None if model.pos_emb is not None and n > model.cfg.seq_len
            else evaluate(model, split, n, max(1, tokens_per_batch // n), dd, precision="fp32")
            for n in lengths}


def _events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(Path(run_dir)), size_guidance={"scalars": 0})
    ea.Reload()
    return ea


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run as TensorBoard shows it (restarts purged), sorted by step."""
    ea = _events(run_dir)
    return {t: sorted((e.step, e.value) for e in ea.Scalars(t)) for t in ea.Tags()["scalars"]}


def wall_seconds(run_dir) -> float:
    """Seconds from the run's first to its last logged scalar (training and evals)."""
    ea = _events(run_dir)
    times = [e.wall_time for t in ea.Tags()["scalars"] for e in ea.Scalars(t)]
    return max(times) - min(times) if times else 0.0


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First step where a decreasing curve reaches ``target``, linearly interpolated between
    logged points; ``None`` if it never does."""
    prev = None
    for step, value in curve:
        if value <= target:
            if prev is None or prev[1] == value:
                return float(step)
            (s0, v0) = prev
            return s0 + (v0 - target) / (v0 - value) * (step - s0)
        prev = (step, value)
    return None


def fit_power_law(curve: list[tuple[int, float]], start_frac: float = 0.2) -> dict | None:
    """Least-squares fit of ``value ~ a + b * step**(-c)`` (``a >= 0``, ``b > 0``, ``0 < c <= 4``) to the points
    of ``curve`` from ``start_frac`` of its last step on (the early transient is left out).

    ``c`` is searched on a log grid and refined, ``a`` and ``b`` solved exactly for each ``c``. ``a`` is the
    curve's fitted floor. A schedule that decays the learning rate to its end bends the curve
    down there, so the fit says where *this* run's shape points, not what a longer schedule gives;
    see ``backtest_power_law`` for how far it can be trusted. Returns ``{"a", "b", "c", "rmse",
    "n", "from_step"}``, or ``None`` with fewer than 4 points or no decreasing fit."""
    if not curve:
        return None
    first = start_frac * curve[-1][0]
    pts = [(s, v) for s, v in curve if s >= first and s > 0]
    if len(pts) < 4:
        return None
    s = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pts], dtype=torch.float64)

    def solve(c):  # (sse, a, b, c) with a, b exact for this c; None where b <= 0 or a < 0
        x = s ** -c
        xm, ym = x.mean(), y.mean()
        var = ((x - xm) ** 2).sum()
        if var <= 0:
            return None
        b = ((x - xm) * (y - ym)).sum() / var
        a = ym - b * xm
        if b <= 0 or a < 0:  # rising, or a bits-per-byte floor below zero
            return None
        return (((a + b * x - y) ** 2).sum().item(), a.item(), b.item(), c)

    grid = torch.logspace(-3, math.log10(4.0), 400, dtype=torch.float64).tolist()
    best = min((r for c in grid if (r := solve(c))), default=None)
    if best is None:
        return None
    i = grid.index(best[3])  # refine between the grid neighbours of the best c
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    best = min([best] + [r for c in torch.linspace(lo, hi, 201, dtype=torch.float64).tolist()
                         if (r := solve(c))])
    sse, a, b, c = best
    return {"a": a, "b": b, "c": c, "rmse": (sse / len(pts)) ** 0.5, "n": len(pts), "from_step": int(pts[0][0])}


def power_law_at(fit: dict, step: float) -> float:
    """The fitted curve's value at ``step``."""
    return fit["a"] + fit["b"] * step ** -fit["c"]


def power_law_steps_to(fit: dict, target: float) -> float | None:
    """The step where the fitted curve reaches ``target``; ``None`` if its floor ``a`` is not
    below ``target`` (it never does)."""
    if target <= fit["a"]:
        return None
    return (fit["b"] / (target - fit["a"])) ** (1 / fit["c"])


def backtest_power_law(curve: list[tuple[int, float]], frac: float = 0.5,
                       start_frac: float = 0.2) -> dict | None:
    """Fit on the points up to ``frac`` of the last step, predict the last point: the measured
    error of extrapolating this way (``predicted - measured``; negative: the fit was too hopeful).
    Returns ``{"fit_to_step", "step", "predicted", "measured", "error"}`` or ``None``."""
    if not curve:
        return None
    cut = frac * curve[-1][0]
    fit = fit_power_law([p for p in curve if p[0] <= cut], start_frac=start_frac * frac)
    if fit is None:
        return None
    step, measured = curve[-1]
    predicted = power_law_at(fit, step)
    return {"fit_to_step": int(max(s for s, _ in curve if s <= cut)), "step": int(step),
            "predicted": predicted, "measured": measured, "error": predicted - measured}
