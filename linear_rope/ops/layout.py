"""Where every token goes in the chunked causal path, resolved once per call.

``rotary_linear_attention`` resolves ``offset`` / ``mask`` / ``cu_seqlens`` into positions and
masks (``utils.check_args``); the custom op (``chunk_op``) gets them as tensors plus a few ints
(``OpConfig``), and ``chunk_layout`` turns those into one ``ChunkLayout``: packed documents
chunk-aligned, the sequence padded to whole chunks, rows flattened, the key mask and the RoPE
table in that layout. The forward, the backward and the fake (shape-only) implementation all
read the same object, so the three agree on every size.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..rotary import rotary_tables

__all__ = ["OpConfig", "ChunkLayout", "chunk_layout", "padded_length", "block_size", "flat", "unflat"]


class OpConfig(NamedTuple):
    """The ints of one call, as the custom op passes them (``to_list`` / ``from_list``)."""

    C: int  # chunk size asked for
    T: int  # block size asked for
    offset: int  # position of token 0 (when no per-token positions are given)
    rotary: bool
    cu: tuple[int, ...]  # cumulative lengths of packed documents; () when nothing is packed
    base: float  # RoPE base

    def to_list(self) -> list[int]:
        """The ints (the op takes ``base`` as a float of its own)."""
        return [self.C, self.T, self.offset, int(self.rotary), *self.cu]

    @staticmethod
    def from_list(cfg, base: float) -> "OpConfig":
        return OpConfig(cfg[0], cfg[1], cfg[2], bool(cfg[3]), tuple(cfg[4:]), base)

    def docs(self):
        """[start, end) of every packed document (None when nothing is packed)."""
        return list(zip(self.cu[:-1], self.cu[1:])) if len(self.cu) > 2 else None


def block_size(cfg: OpConfig, N) -> tuple[int, int]:
    """(C, T): the chunk (at most N) and the block, a whole number of chunks."""
    C = min(cfg.C, N)
    return C, max(C, cfg.T // C * C)


def padded_length(cfg: OpConfig, N) -> int:
    """The length the walk runs over: every packed document, or the row, padded to whole chunks."""
    C, _ = block_size(cfg, N)
    docs = cfg.docs()
    if docs is None:
        return -(-N // C) * C
    return sum(-(-(e - s) // C) * C for s, e in docs)


class ChunkLayout(NamedTuple):
    """One call laid out for the block walk."""

    C: int
    T: int
    Np: int  # padded length, a multiple of C
    src: torch.Tensor | None  # [Np] the token each slot reads (packed documents), or None
    dst: torch.Tensor | None  # [N] each token's slot (packed documents), or None
    pad: int  # slots filled at the end (masked)
    km: torch.Tensor | None  # [BH, Np] 0/1 real keys, or None: all real
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None  # [Np, m/2] or [B, Np, m/2] each, or None
    starts: tuple[int, ...]  # the chunk each document starts at


def _packing(docs, C, device):
    """Packed documents chunk-aligned: each padded to a multiple of C tokens. Returns (src, valid,
    dst, starts): the token each slot reads, which slots are real, each token's slot, and the
    chunk each document starts at."""
    src, valid, dst, starts, at = [], [], [], [], 0
    for s, e in docs:
        n = e - s
        p = -(-n // C) * C
        starts.append(at // C)
        src += list(range(s, e)) + [s] * (p - n)
        valid += [True] * n + [False] * (p - n)
        dst += list(range(at, at + n))
        at += p
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return t(src, torch.long), t(valid, torch.bool), t(dst, torch.long), tuple(starts)


def chunk_layout(cfg: OpConfig, shape, mask, positions, m, like) -> ChunkLayout:
    """shape (B, H, N); mask `[B, N]` bool or None; positions `[B, N]` long or None (then
    ``cfg.offset`` .. + N - 1); m features; ``like`` gives the dtype and device."""
    B, H, N = shape
    C, T = block_size(cfg, N)
    docs = cfg.docs()
    src = dst = None
    starts = (0,)
    km = None if mask is None else mask.to(like.dtype)
    tables = None
    if cfg.rotary:
        tables = rotary_tables(N, m, offset=cfg.offset if positions is None else 0, base=cfg.base, dtype=like.dtype,
                               device=like.device, positions=positions)
    if docs is not None:
        src, valid, dst, starts = _packing(docs, C, like.device)
        km = valid.to(like.dtype)[None] if km is None else km.index_select(1, src) * valid
        if tables is not None:
            tables = tuple(t.index_select(-2, src) for t in tables)
    Np = padded_length(cfg, N)
    pad = Np - (N if src is None else src.shape[0])
    if pad:  # trailing slots to fill the last chunk: masked, so they change no output or state
        km = F.pad(torch.ones(B, Np - pad, dtype=like.dtype, device=like.device) if km is None else km, (0, pad))
        if tables is not None:
            tables = (F.pad(tables[0], (0, 0, 0, pad), value=1.0), F.pad(tables[1], (0, 0, 0, pad)))
    if tables is not None and tables[0].dim() == 3 and tables[0].shape[0] == 1:  # one row: one shared table
        tables = (tables[0][0], tables[1][0])
    if km is not None:
        km = km[:, None].expand(B, H, Np).reshape(B * H, Np)
    return ChunkLayout(C, T, Np, src, dst, pad, km, tables, starts)


def flat(t, lay: ChunkLayout):
    """`[B, H, N, x]` -> `[B*H, Np, x]` in the walk's layout (packed, padded), contiguous."""
    if lay.src is not None:
        t = t.index_select(2, lay.src)
    if lay.pad:
        t = F.pad(t, (0, 0, 0, lay.pad))
    B, H = t.shape[:2]
    return t.reshape(B * H, lay.Np, -1).contiguous()


def unflat(out, lay: ChunkLayout, shape):
    """`[B*H, Np, e]` -> `[B, H, N, e]`, contiguous (as the fake implementation says): the
    inverse of ``flat`` on the real tokens."""
    B, H, N = shape
    out = out.view(B, H, lay.Np, -1)
    return out[:, :, :N].contiguous() if lay.dst is None else out.index_select(2, lay.dst)
