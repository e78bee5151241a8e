"""Non-negative feature maps phi for linear attention: FAVOR+, elu+1 and relu.

FAVOR+ (Performer, Choromanski et al. 2020) estimates the softmax kernel
``exp(q.k / sqrt(d))`` with positive orthogonal random features::

    phi(x)_j = exp(w_j . x' - |x'|^2 / 2) / sqrt(m),    x' = x * d^(-1/4),  j = 1..m

so that ``E_w[phi(q) . phi(k)] = exp(q.k / sqrt(d))``. The readable, unstabilised form is
``linear_rope.reference.favor_features_ref``.

Stabiliser: strictly causal, nothing added
-------------------------------------------
``exp`` overflows unless the exponent is shifted. performer-pytorch shifts keys by the max over
the *whole sequence* and adds ``eps = 1e-4``: the shift lets future keys change past outputs,
and with unit-variance keys the ``eps`` is larger than every feature, which flattens attention.

Here every shift is either per query token or data-independent, and both cancel exactly in the
ratio of Eq. 18/19. Let ``c_j = max(|w_a|^2, |w_b|^2) / 2`` over the rotation pair
``{a, b} = {2i, 2i+1}`` that holds feature j (a lone last feature when m is odd is its own pair):

* keys:    ``phi(k)_j = exp(w_j.k' - |k'|^2/2 - c_j)``                 (<= 1, see below)
* queries: ``phi(q)_j = exp(s_j - max_i s_i)`` with ``s_j = w_j.q' + c_j``   (<= 1)

The numerator and denominator are both linear in ``phi(q_m)``, so the per-token factor
``exp(-|q'|^2/2 - max_i s_i)`` cancels. The factor ``exp(c_j)`` moves from the key to the query
feature; RoPE rotates within a pair, and both features of a pair carry the same ``c_j``, so
``(R_m phi(q))^T (R_n phi(k))`` is unchanged too. (A shift per *feature* would not survive the
rotation.) Keys are bounded for any input: ``w.k' - |k'|^2/2 <= |w||k'| - |k'|^2/2 <= |w|^2/2``.
The key shift depends on the fixed projection only and the query max on one token's features,
so no information moves between positions: the map is strictly causal. No constant is added.
Sharing ``c_j`` per pair keeps key features far from underflow compared with one global bound
``max_j |w_j|^2 / 2`` (typically ``exp(-36)`` against ``exp(-54)`` for d = 64).

Features come out in float32 or wider, whatever the input dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FavorFeatures", "FEATURE_KINDS", "default_nb_features", "draw_orthogonal_projection", "favor_features",
           "key_exponent_floor", "favor_projection", "check_projection", "favor_inputs", "favor_exp_"]

FEATURE_KINDS = ("favor", "elu", "relu")


def default_nb_features(dim_head: int) -> int:
    """int(d ln d), rounded up to an even number (266 for d = 64, as in performer-pytorch)."""
    m = int(dim_head * math.log(dim_head))
    return max(2, m + (m % 2))


def draw_orthogonal_projection(
    nb_features: int, dim_head: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`[m, d]` block-orthogonal Gaussian projection, drawn by performer-pytorch.

    performer-pytorch takes Q from ``torch.linalg.qr`` without fixing the signs of R's
    diagonal, so Q is not Haar: row i of each block leans towards -e_i (mean about -0.4 on that
    axis for d = 4), and the FAVOR+ estimate it feeds is biased (about -8% for
    ``E exp(w.u)`` at |u| = 1.2, d = 16). Multiplying every row by an independent random sign
    makes each block exactly Haar again (Haar measure is invariant under sign flips), so each
    row is marginally N(0, I_d) and the estimator is unbiased.

    With a ``generator`` the draw is reproducible and the global RNG is left untouched: the
    generator yields a seed for a forked CPU RNG in which performer-pytorch draws.
    """
    from performer_pytorch.performer_pytorch import gaussian_orthogonal_random_matrix

    if torch.empty(0).device.type == "meta":  # a model built on the meta device (transformers'
        return torch.empty(nb_features, dim_head)  # from_pretrained) gets its projection loaded

    def draw():
        w = gaussian_orthogonal_random_matrix(nb_features, dim_head, scaling=0)
        signs = torch.randint(0, 2, (nb_features, 1)).to(w) * 2 - 1
        return w * signs

    if generator is None:
        return draw()
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return draw()


def check_projection(w: torch.Tensor, name: str = "projection") -> torch.Tensor:
    """``w``, or ValueError if an entry is NaN or inf (a NaN or inf row makes every output NaN).
    Run where a projection enters (its draw, a state dict), not in every forward: reading a
    GPU tensor's values waits for the GPU."""
    if w.device.type != "meta" and w.is_floating_point() and w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name} must be finite (a NaN or inf row makes every output NaN)")
    return w


def pair_shift(w: torch.Tensor) -> torch.Tensor:
    """c_j = max |w|^2 / 2 over the rotation pair (2i, 2i+1) holding feature j. w: `[m, d]` -> `[m]`."""
    half_sq = 0.5 * (w * w).sum(-1)  # (m,)
    m = half_sq.shape[0]
    padded = torch.cat((half_sq, half_sq[-1:])) if m % 2 else half_sq
    return padded.view(-1, 2).amax(-1).repeat_interleave(2)[:m]


class FavorFeatures(nn.Module):
    """Feature map phi: `[..., N, d]` -> `[..., N, m]`, non-negative, float32 or wider.

    Args:
        dim_head: d, the per-head dim of q and k.
        nb_features: m. For ``favor`` it defaults to int(d ln d) rounded up to even; ``elu``
            and ``relu`` act elementwise, so m = d and ``nb_features`` must be None or d.
        kind: ``"favor"`` (FAVOR+ positive orthogonal random features of the softmax kernel),
            ``"elu"`` (elu(x) + 1, Katharopoulos et al.) or ``"relu"``.
    """

    def __init__(self, dim_head: int, nb_features: int | None = None, *, kind: str = "favor"):
        super().__init__()
        if kind not in FEATURE_KINDS:
            raise ValueError(f"kind must be one of {FEATURE_KINDS}, got {kind!r}")
        if isinstance(dim_head, bool) or not isinstance(dim_head, int) or dim_head < 1:
            raise ValueError(f"dim_head must be a positive int, got {dim_head!r}")
        if kind == "favor":
            nb_features = default_nb_features(dim_head) if nb_features is None else nb_features
            if isinstance(nb_features, bool) or not isinstance(nb_features, int) or nb_features < 1:
                raise ValueError(f"nb_features must be a positive int, got {nb_features!r}")
        elif nb_features not in (None, dim_head):
            raise ValueError(
                f"nb_features: kind={kind!r} is elementwise, so it has m = dim_head = {dim_head} "
                f"features; got nb_features={nb_features}"
            )
        self.kind = kind
        self.dim_head = dim_head
        self.out_features = nb_features if kind == "favor" else dim_head
        if kind == "favor":
            self.register_buffer("projection", draw_orthogonal_projection(self.out_features, dim_head))
        else:
            self.register_buffer("projection", None)

    def extra_repr(self) -> str:
        return f"dim_head={self.dim_head}, out_features={self.out_features}, kind={self.kind!r}"

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a new projection (FAVOR+ only; a no-op for elu/relu). It is drawn on the CPU and
        checked there (``check_projection``); the copy to the GPU does not wait for it."""
        if self.projection is None:
            return
        w = check_projection(draw_orthogonal_projection(self.out_features, self.dim_head, generator))
        if self.projection.is_cuda:
            w = w.pin_memory()  # an asynchronous copy (from pageable memory it is a synchronous one)
        self.projection.copy_(w, non_blocking=True)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A projection enters here too (a checkpoint, ``from_pretrained``): checked as it loads."""
        w = state_dict.get(prefix + "projection")
        if isinstance(w, torch.Tensor):
            check_projection(w, f"{prefix}projection")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        """x: `[..., N, d]` queries or keys -> `[..., N, m]` features in float32 or wider.

        ``is_query`` picks the stabiliser (see the module docstring); elu/relu ignore it.
        """
        if x.shape[-1] != self.dim_head:
            raise ValueError(f"x: last dim must be dim_head={self.dim_head}, got {tuple(x.shape)}")
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        if self.kind == "elu":
            return F.elu(x) + 1.0
        if self.kind == "relu":
            return F.relu(x)
        return favor_features(x, self.projection, is_query=is_query)


def key_exponent_floor(dtype: torch.dtype) -> float:
    """The smallest exponent a key feature gets: 8 above the log of the dtype's smallest normal
    number (-79.3 in float32, -700 in float64). Keys of large norm otherwise have every feature
    underflow in float32 (``exp(w.k' - |k'|^2/2 - c)`` with ``|k'|^2/2`` near 90); a query that
    sees only such keys gets a subnormal denominator, and the backward's ``1 / den`` overflows
    to inf and NaN. Measured in training: ``cpu20m`` at lr 2e-3, den down to 1e-44, NaN
    gradients from step 1652 (`none`) and 2654 (Eq. 19). The floor only changes features that
    float32 could not represent as normal numbers anyway."""
    return math.log(torch.finfo(dtype).tiny) + 8.0


def favor_projection(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stabiliser folded into the projection: (wq `[m, d+1]`, wk `[m, d+2]`).

    With ``favor_inputs`` (x' plus a column of ones for queries; x', -|x'|^2/2 and ones for keys)
    one GEMM gives the shifted exponents of the module docstring: ``w.q' + c`` and
    ``w.k' - |k'|^2/2 - c``."""
    c = pair_shift(w)[:, None]  # (m, 1)
    return torch.cat((w, c), dim=1), torch.cat((w, torch.ones_like(c), -c), dim=1)


def favor_inputs(x: torch.Tensor, *, is_query: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`[..., d]` -> x' = x d^(-1/4) augmented for ``favor_projection``: `[..., d+1]` / `[..., d+2]`.

    ``key_mask`` (broadcastable to `x.shape[:-1]`, 0 = padding), for queries or keys: a padded
    token's x' is 0 (selected: whatever it held, NaN included, is gone), and a padded key's
    -|k'|^2/2 column holds -1e30, so ``favor_exp_`` gives it features of exactly 0 (no pass over
    the features)."""
    xs = x * x.shape[-1] ** -0.25
    pad = None if key_mask is None else key_mask.eq(0).unsqueeze(-1)
    if pad is not None:
        xs.masked_fill_(pad, 0.0)
    ones = xs.new_ones(xs.shape[:-1] + (1,))
    if is_query:
        return torch.cat((xs, ones), dim=-1)
    half_sq = -0.5 * (xs * xs).sum(-1, keepdim=True)
    if pad is not None:
        half_sq = half_sq - pad.to(xs.dtype) * 1e30
    return torch.cat((xs, half_sq, ones), dim=-1)


def favor_exp_(a: torch.Tensor, *, is_query: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """In place: the shifted exponents `[..., m]` of ``favor_projection`` -> features in (0, 1].

    Queries: minus their row max (per token, it cancels in the ratio). Keys: clamped to
    [``key_exponent_floor``, 0] (<= 0 in exact arithmetic; the clamp removes round-off), and
    masked keys (``key_mask`` `[..., 1]` broadcastable, 0 = masked) set back to exactly 0."""
    if is_query:
        a -= a.amax(-1, keepdim=True).detach()
        return a.exp_()
    a.clamp_(min=key_exponent_floor(a.dtype), max=0.0).exp_()
    return a if key_mask is None else a.mul_(key_mask)


def favor_features(x: torch.Tensor, projection: torch.Tensor, *, is_query: bool) -> torch.Tensor:
    """Stabilised FAVOR+ features (see the module docstring).

    x: `[..., N, d]` queries (``is_query``) or keys, projection `[m, d]` -> `[..., N, m]` in
    float32 or wider, each feature in (0, 1]. Autocast is off inside: the map stays in fp32.
    The one place the stabiliser is written: ``favor_projection``, ``favor_inputs`` and
    ``favor_exp_``, which the fused path of ``linear_rope.ops`` calls block by block.
    """
    with torch.autocast(x.device.type, enabled=False):
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        wq, wk = favor_projection(projection.to(x.dtype))
        a = favor_inputs(x, is_query=is_query) @ (wq if is_query else wk).t()  # (..., N, m)
        return favor_exp_(a, is_query=is_query)
