"""What the three paths of the op share: the state type, the one set of argument checks, and the
token positions every keyword implies.

Layout everywhere: `[B, H, N, x]`. x is m (features) for q and k when no ``projection`` is given,
d (raw queries / keys) when FAVOR+ is applied inside the op; v is `[B, H, M, e]`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import check_base, check_flag, is_compiling, is_static, require, values
from ..rotary import check_last_position, check_offset, token_positions

__all__ = ["LinearAttentionState", "Args", "Options", "check_args", "check_state", "check_mask", "check_cu_seqlens",
           "normalise_scale", "check_final_state"]


class LinearAttentionState(NamedTuple):
    """Recurrent state after a prefix of tokens.

    S: `[B, H, m, e]` sum of (R_n phi(k_n)) v_n^T, the rotated numerator state.
    z: `[B, H, m]` sum of phi(k_n), the unrotated key sum of the denominator.

    With ``projection`` the keys' features are the stabilised FAVOR+ ones of
    ``linear_rope.features.favor_features`` (no 1/sqrt(m)), so states from the fused and the
    features-first paths are interchangeable. With ``cu_seqlens`` the first dim is the document.
    """

    S: torch.Tensor
    z: torch.Tensor


class Args(NamedTuple):
    """The checked arguments, in the form the paths consume."""

    positions: torch.Tensor | None  # (B, N) long with rotary; None: offset .. offset+N-1 for every row
    offset: int | torch.Tensor  # int, or (B,) / (D,) long per row or document
    qmask: torch.Tensor | None  # (B, N) bool: outputs at False are 0
    kmask: torch.Tensor | None  # (B, M) bool: keys at False add nothing
    docs: list[tuple[int, int]] | None  # [start, end) of every packed document
    m: int  # number of features
    state: LinearAttentionState | None


def _is_compiling() -> bool:
    return is_compiling()


def _check_non_negative(name: str, t: torch.Tensor, real: torch.Tensor | None = None) -> None:
    """Features must be >= 0 (Eq. 19's unrotated denominator can reach 0 or below otherwise);
    ``real`` `[B, N]` bool: only those tokens are read (padding may hold anything).

    Eager: a ValueError naming the minimum (under ``vmap``: of every entry). Under
    ``torch.compile`` the same message from ``torch._assert_async`` (a RuntimeError when the
    compiled graph runs): reading the minimum into Python would break the graph, and skipping
    the check would let compiled code return what eager refuses.
    """
    if t.numel() == 0:
        return
    msg = (f"{name}: features must be non-negative; Eq. 19's unrotated denominator can reach 0 or below "
           "otherwise. Pass allow_negative=True to opt out")
    low = t.detach().amin(-1)  # (B, H, N)
    if real is not None:
        low = torch.where(real[:, None, :], low, 0)
    low = low.min()
    if _is_compiling():
        torch._assert_async(low >= 0, msg)
        return
    low = float(values(low).min())
    if low < 0:
        raise ValueError(msg.replace("non-negative;", f"non-negative (min {low:.3g});"))


def normalise_scale(q, k, kmask, state, docs=None, sync: bool = True):
    """Eq. 19 is unchanged when phi(q_t) is scaled per query, and when every phi(k) of a row (or
    of a packed document) and that row's state (S0, z0) are scaled together. Where a query's
    largest feature, or the largest key feature or z0 entry of a row or document, lies outside
    [2^-32, 2^32], the fast paths divide by the power of two at or below it (exact divisions):
    float32 products and sums then stay far from underflow (features of 1e-25 have products of
    1e-50) and overflow (1e19: sums past 3e38), so the output is the same for finite features
    anywhere in the float32 range, and each row and each packed document gets what it gets
    alone whatever the scale of the others. Inside that range nothing is touched (the scale is
    1): the one result that is not scale-invariant, a query whose denominator is exactly 0
    (output = numerator, as in ``naive``), is then the reference's too.

    q, k `[B, H, N or M, m]` features, kmask `[B, M]` or None, state per row or document, docs
    the [start, end) of packed documents (B = 1) or None. Returns q, k, state scaled, and the
    key scale `[rows, H, 1, 1]` (rows: B, or the documents) to multiply the final state by (it
    is in the caller's scale again). ``sync=False``: always divide (two passes), never ask the
    device whether every scale is 1 (a host sync).
    """

    def pow2(x):  # the power of two at or below x outside [2^-32, 2^32]; 1 inside, and at 0
        far = (x > 0) & ((x < 2.0**-32) | (x > 2.0**32))
        return torch.where(far, torch.exp2(torch.floor(torch.log2(x))), torch.ones_like(x))

    def absmax(x):  # max |x| over the last dim without a copy: abs() writes one (a page-faulting
        x = x.detach()  # pass as long as the GEMMs' at N = 4096), aminmax(dim=-1) runs 5x slower
        return torch.maximum(x.amax(-1), x.amin(-1).neg())

    sq = pow2(absmax(q)).unsqueeze(-1)  # (B, H, N, 1)
    ka = absmax(k)  # (B, H, M)
    if kmask is not None:  # padding's garbage does not set the scale of the real keys
        ka = torch.where(kmask[:, None, :], ka, torch.zeros_like(ka))
    seg = None
    if docs is None:
        sk = ka.amax(-1)  # (B, H): one scale per row
    else:  # one scale per packed document: (D, H)
        lengths = torch.tensor([e - s for s, e in docs], device=k.device)
        seg = torch.repeat_interleave(torch.arange(len(docs), device=k.device), lengths)  # (M,) its document
        H = ka.shape[1]
        sk = ka.new_zeros(H, len(docs)).scatter_reduce_(1, seg.expand(H, -1), ka[0], "amax").t()
    if state is not None:
        sk = torch.maximum(sk, state.z.detach().abs().to(sk.dtype).amax(-1))
    sk = pow2(sk)[..., None, None]  # (rows, H, 1, 1)
    skt = sk if seg is None else sk[:, :, 0, 0].t()[None, :, seg, None]  # (B, H, 1 or M, 1): each key's
    if state is not None:
        state = LinearAttentionState(state.S / sk.to(state.S.dtype), state.z / sk[..., 0].to(state.z.dtype))
    if sync and not is_static() and not bool(((sq != 1).any() | (sk != 1).any())):
        return q, k, state, sk  # every scale is 1 (the usual case): no pass over q and k, none in the backward
    return q / sq, k / skt, state, sk


def check_final_state(S: torch.Tensor, z: torch.Tensor, sk: torch.Tensor,
                      read_values: bool = True) -> LinearAttentionState:
    """The final state back in the caller's scale; a clear error where the key sums overflow it
    (under ``torch.compile`` the same message from ``torch._assert_async``, see ``checks.require``).
    ``read_values=False``: no check (it reads a value: a host sync)."""
    S, z = S * sk, z * sk[..., 0]
    if read_values and z.numel():
        require(torch.isfinite(z).all(),
                f"k: the final state's key sum z is not finite in {z.dtype} (features near the top of its range, "
                "or not finite): the output is scale invariant, the state is not; scale phi(k) down to chain calls")
    return LinearAttentionState(S, z)


def check_mask(mask, name: str, shape: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """A bool tensor of ``shape`` (True = real token), on ``device`` where one is given."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a bool tensor [B, N] (True = real token), got {got}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(mask.shape)}")
    if device is not None and mask.device != device:
        raise ValueError(f"{name} is on {mask.device}, the tokens on {device}")
    return mask


def check_cu_seqlens(cu, B: int, N: int) -> list[tuple[int, int]]:
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor [D+1] of cumulative document lengths")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed documents go in one row, [1, H, T, .]; got B={B}")
    if torch._C._functorch.is_batchedtensor(cu) or cu.device.type == "meta":
        raise ValueError("cu_seqlens: its values set the shapes of the call, so it cannot be vmapped or on meta")
    c = values(cu).tolist()
    if len(c) < 2 or c[0] != 0 or c[-1] != N or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={N}, got {c}")
    return list(zip(c[:-1], c[1:]))  # empty documents (equal neighbours) are allowed


def check_state(state, rows: int, H: int, m: int, e: int, name: str = "initial_state", read_values: bool = True,
                device: torch.device | None = None):
    """A ``LinearAttentionState`` (or an (S, z) pair) of shapes `[rows, H, m, e]`, `[rows, H, m]`;
    finite (``read_values``: that check reads values, a host sync)."""
    if state is None:
        return None
    if not (isinstance(state, tuple) and len(state) == 2 and all(isinstance(t, torch.Tensor) for t in state)):
        raise ValueError(f"{name} must be a LinearAttentionState (S, z), got {type(state).__name__}")
    S, z = state
    if tuple(S.shape) != (rows, H, m, e) or tuple(z.shape) != (rows, H, m):
        raise ValueError(
            f"{name}: S {list(S.shape)} / z {list(z.shape)} do not match this call: want "
            f"S [{rows}, {H}, {m}, {e}] and z [{rows}, {H}, {m}]"
        )
    if not (S.is_floating_point() and z.is_floating_point()):
        raise ValueError(f"{name} must be floating point, got {S.dtype} / {z.dtype}")
    if device is not None and not (S.device == z.device == device):
        raise ValueError(f"{name} is on {S.device} / {z.device}, q on {device}")
    if read_values and S.numel() + z.numel():  # a NaN z would make the denominator NaN, never "0": refuse it here
        require(torch.isfinite(S).all() & torch.isfinite(z).all(),
                f"{name}: S and z must be finite (a NaN or inf state has no meaning to continue from)")
    return LinearAttentionState(S, z)


class Options(NamedTuple):
    """The keywords the three paths share (their one signature), as ``check_args`` reads them."""

    causal: bool = True
    rotary: bool = True
    offset: int | torch.Tensor = 0
    base: float = 10000.0
    projection: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    initial_state: LinearAttentionState | None = None
    allow_negative: bool = False
    output_final_state: bool = False


BASE = Options().base  # the default RoPE base


def _check_tensors(q, k, v, projection) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, N, .], got {list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: q, k, v must share a device")
    if q.device.type == "meta":
        raise ValueError("q, k, v: meta tensors hold no values, and the op reads some (features >= 0, "
                         "positions, documents); run it on real tensors, or under torch.compile for shapes")
    if projection is not None and isinstance(projection, torch.Tensor) and projection.device != q.device:
        raise ValueError(f"projection is on {projection.device}, q on {q.device}")


def _check_ignored(o: Options) -> None:
    """A keyword that would have no effect in this call is refused, not dropped."""
    if not o.rotary:
        if not (isinstance(o.offset, int) and not isinstance(o.offset, bool) and o.offset == 0):
            raise ValueError("offset: positions enter through RoPE only, so offset has no effect with "
                             "rotary=False; leave it out")
        if o.base != BASE:
            raise ValueError(f"base={o.base!r}: the RoPE base has no effect with rotary=False; leave it out")
    if o.projection is not None and o.allow_negative:
        raise ValueError("allow_negative: FAVOR+ features (projection given) are positive, so it has no effect; "
                         "leave it out")


def check_args(q, k, v, opts: Options, state_name: str = "initial_state", read_values: bool = True) -> Args:
    """Every check of ``rotary_linear_attention``; ValueError naming the argument (the state's
    as ``state_name``). ``read_values=False`` (the chunk-parallel path, unless
    ``LINEAR_ROPE_CHECKS=1``) leaves out the checks that read tensor values, each a host sync:
    features >= 0, a finite projection and initial state, per-row offsets within
    [0, MAX_POSITION] (unread, a position past it gets NaN angles); shapes, dtypes and flags
    are checked all the same."""
    causal, rotary, offset, base, projection, mask, key_mask, cu_seqlens, initial_state, allow_negative, _ = opts
    for name in ("causal", "rotary", "allow_negative", "output_final_state"):
        check_flag(name, getattr(opts, name))
    _check_tensors(q, k, v, projection)
    B, H, N, x = q.shape
    M = k.shape[2]
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != x:
        raise ValueError(f"k must have shape [B={B}, H={H}, M, {x}], got {list(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have shape [B, H, M, e] matching k {list(k.shape)}, got {list(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if x == 0:
        raise ValueError("q, k: the last dim (features, or d with projection) is 0")
    cross = key_mask is not None or M != N
    if cross and (causal or rotary):
        raise ValueError(
            "key_mask / k of another length than q means cross-attention, which has no shared "
            "position axis: it needs causal=False and rotary=False"
        )
    qmask = None if mask is None else check_mask(mask, "mask", (B, N), q.device)
    kmask = None if cross else qmask  # cross-attention: key_mask alone masks the keys
    if key_mask is not None:
        if cu_seqlens is not None:
            raise ValueError("key_mask: cross-attention over packed documents is not supported")
        kmask = check_mask(key_mask, "key_mask", (B, M), q.device)
    if projection is not None:
        if not isinstance(projection, torch.Tensor) or projection.dim() != 2 or projection.shape[1] != x \
                or not projection.is_floating_point():
            got = (f"{projection.dtype} {list(projection.shape)}" if isinstance(projection, torch.Tensor)
                   else type(projection).__name__)
            raise ValueError(f"projection must be a floating-point tensor [m, d={x}] (FAVOR+ of q and k inside), "
                             f"got {got}")
        m = projection.shape[0]
        if m == 0:
            raise ValueError(f"projection has 0 rows: FAVOR+ needs m >= 1 features, got shape {list(projection.shape)}")
        if read_values:
            require(torch.isfinite(projection).all(),
                    "projection must be finite (a NaN or inf row makes every output NaN)")
    else:
        m = x
        if not allow_negative and read_values:  # padding (masked tokens) is not read: it may hold anything
            _check_non_negative("q", q, qmask)
            _check_non_negative("k", k, kmask)
    if rotary and m % 2:
        raise ValueError(f"{'projection' if projection is not None else 'q'}: rotary needs an even "
                         f"number of features m, got m={m}")
    check_base(base)
    _check_ignored(opts)
    docs = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, N)
    rows = B if docs is None else len(docs)
    offset = check_offset(offset, rows=rows, read=read_values)  # unread: NaN past MAX_POSITION (rope_turns)
    if rotary:
        check_last_position(offset, N if docs is None else max(e - s for s, e in docs), read=read_values)
    state = check_state(initial_state, rows, H, m, v.shape[-1], state_name, read_values, q.device)
    positions = None
    if rotary:  # the positions every path uses, packed documents included
        positions = token_positions(offset, N, qmask, device=q.device, docs=docs)
    return Args(positions, offset, qmask, kmask, docs, m, state)
