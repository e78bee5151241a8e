"""PerformerLM: a byte-level language model of Pre-LN RotaryLinearAttention blocks."""
from __future__ import annotations

import functools
import math
import numbers
import typing
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .attention import RotaryLinearAttention
from .checks import ID_DTYPES, check_flag, is_static, value_checks
from .decode import Decoder, check_temperature, sample_next  # noqa: F401 (re-exported)
from .features import FEATURE_KINDS, FavorFeatures
from .generation import generate
from .ops import LinearAttentionState
from .ops.utils import check_mask
from .rotary import check_offset, token_positions
from .softmax_attention import SoftmaxAttention

__all__ = ["ModelConfig", "PerformerLM", "MODEL_PRESETS", "LM_POSITIONS", "INPUT_POSITIONS", "SinusoidalTable"]

# The ablation's variants: where position information enters the model. ``softmax`` is the
# anchor: exact causal softmax attention with RoPE on q and k (``SoftmaxAttention``).
LM_POSITIONS = ("rope", "rope_pre", "rope_norm", "absolute", "none", "softmax")
# ModelConfig.input_pos: a position table added to the token embeddings whatever ``position`` is.
# ``learned`` is the ``absolute`` variant's table; ``sinusoidal`` is performer-pytorch's fixed table
# of its rotary mode (a buffer: not trained).
INPUT_POSITIONS = ("none", "learned", "sinusoidal")


@dataclass
class ModelConfig:
    vocab_size: int = 256  # bytes
    dim: int = 768  # model width
    depth: int = 12  # number of blocks
    heads: int = 12  # attention heads
    dim_head: int = 64  # per-head dim d
    nb_features: int | None = 266  # FAVOR+ features m (None: int(d ln d), even)
    seq_len: int = 1024  # training context; also the size of the position tables (`absolute`, input_pos)
    position: str = "rope"  # rope (Eq. 19) | rope_pre | rope_norm | absolute | none | softmax
    feature_map: str = "favor"  # favor | elu | relu
    ff_mult: int = 4  # feed-forward hidden = ff_mult * dim
    dropout: float = 0.0  # on residual branches and embeddings
    rope_base: float = 10000.0  # RoPE base
    feature_redraw_interval: int = 1000  # training steps between FAVOR+ redraws (0: never)
    qk_norm: bool = False  # q and k at unit norm times a learned per-head scale (see qk_norm.py)
    causal: bool = True  # autoregressive; False: bidirectional (performer-pytorch's default), no next-byte training or decoding
    input_pos: str = "none"  # a table added to the token embeddings as well: none | learned | sinusoidal (fixed)
    head_bias: bool = False  # a bias on the output head (performer-pytorch's head has one)

    def __post_init__(self):
        check_field_types(self)
        if not self.rope_base > 0:  # finite already (check_field_types): nan and 0 stop here
            raise ValueError(f"rope_base must be a positive number, got {self.rope_base}")
        if self.position not in LM_POSITIONS:
            raise ValueError(f"position must be one of {LM_POSITIONS}, got {self.position!r}")
        if self.feature_map not in FEATURE_KINDS:
            raise ValueError(f"feature_map must be one of {FEATURE_KINDS}, got {self.feature_map!r}")
        if self.input_pos not in INPUT_POSITIONS:
            raise ValueError(f"input_pos must be one of {INPUT_POSITIONS}, got {self.input_pos!r}")
        if self.input_pos != "none" and self.position == "absolute":
            raise ValueError(f"input_pos: position 'absolute' adds its own learned table, so input_pos must be "
                             f"'none', got {self.input_pos!r} (position 'none' with input_pos 'learned' is the same)")
        if self.input_pos == "sinusoidal" and self.dim % 2:
            raise ValueError(f"dim: the sinusoidal table holds sin and cos pairs, so dim must be even, got {self.dim}")
        if not self.causal and self.position == "softmax":
            raise ValueError("causal: the softmax anchor is causal only, got causal=False")
        for f in ("vocab_size", "dim", "depth", "heads", "dim_head", "seq_len", "ff_mult"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.vocab_size > 256:  # generate() returns bytes: an id past 255 has no byte to be
            raise ValueError(f"vocab_size must be <= 256 (the model is byte-level), got {self.vocab_size}")
        if self.feature_redraw_interval < 0:
            raise ValueError(f"feature_redraw_interval must be >= 0, got {self.feature_redraw_interval}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.nb_features is not None and self.nb_features < 1:
            raise ValueError(f"nb_features must be >= 1 or None, got {self.nb_features}")
        if self.position in ("rope", "rope_norm") and self.nb_features is not None and self.nb_features % 2:
            raise ValueError(f"nb_features: {self.position} rotates the features, so m must be even, "
                             f"got {self.nb_features}")
        if self.position in ("rope_pre", "softmax") and self.dim_head % 2:
            raise ValueError(f"dim_head: {self.position} rotates q and k, so it must be even, "
                             f"got {self.dim_head}")


@functools.cache
def _field_kinds(cls) -> dict[str, tuple[type, bool]]:
    """``{field: (int | float | bool | str, None allowed)}`` from a config dataclass's hints."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        kinds[name] = ((args or [hint])[0], bool(args))
    return kinds


def check_field_types(cfg) -> None:
    """TypeError unless every field of the config dataclass ``cfg`` has its declared type (a
    bool is not a number, an int is a float); ValueError for a float field that is NaN or inf."""
    for name, (kind, optional) in _field_kinds(type(cfg)).items():
        v = getattr(cfg, name)
        if v is None and optional:
            continue
        if kind is float:
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
        elif kind is int:
            ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
        else:
            ok = isinstance(v, kind)
        if not ok:
            raise TypeError(f"{name} must be {'an' if kind is int else 'a'} {kind.__name__}"
                            f"{' or None' if optional else ''}, got {v!r}")
        if kind is float and not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")


MODEL_PRESETS: dict[str, dict] = {
    # RoFormer section 4.4: 12 layers, 768 dim, 12 heads x 64, m = 266, sequence 1024.
    "paper": dict(dim=768, depth=12, heads=12, dim_head=64, nb_features=266, seq_len=1024),
    # 12 layers at reduced width and length: 0.56 s per training step on 2 idle CPU cores
    # (batch 8 x 256 tokens, train preset "cpu"), so 1,000 steps take about 10 minutes.
    "cpu": dict(dim=128, depth=12, heads=4, dim_head=32, nb_features=64, seq_len=256),
    # 12 layers, narrow enough that a 20M-byte run fits in about an hour on one CPU core: the
    # preset of the first ablation (width, batch and lr from a sweep on `none`, results/sweep).
    "cpu20m": dict(dim=64, depth=12, heads=2, dim_head=32, nb_features=32, seq_len=256),
    # cpu20m's model with the headline ablation's recipe, chosen on `none` alone (results/recipe_sweep): q and k
    # normalised with a learned per-head scale before the feature map, no FAVOR+ redraws (and
    # lr 4e-3 in TRAIN_PRESETS).
    "cpu40m": dict(dim=64, depth=12, heads=2, dim_head=32, nb_features=32, seq_len=256, qk_norm=True,
                   feature_redraw_interval=0),
    # For tests.
    "tiny": dict(dim=32, depth=2, heads=2, dim_head=8, nb_features=16, seq_len=32),
}


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, mult: int, dropout: float):
        super().__init__(nn.Linear(dim, mult * dim), nn.GELU(), nn.Linear(mult * dim, dim), nn.Dropout(dropout))


class SinusoidalTable(nn.Module):
    """A fixed position table `[n, dim]`, read as an ``nn.Embedding`` is: row p is
    ``(sin(p theta_0), .., sin(p theta_(dim/2-1)), cos(p theta_0), .., cos(p theta_(dim/2-1)))`` with
    ``theta_i = 10000 ** (-2i / dim)``, computed in float32 as performer-pytorch's
    ``FixedPositionalEmbedding`` computes it. A buffer, so it is saved but never trained."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.einsum("i,j->ij", torch.arange(0, n, dtype=torch.float), inv_freq)
        self.register_buffer("weight", torch.cat((angles.sin(), angles.cos()), dim=-1))
        self.num_embeddings = n

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight)


class Block(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + ff(ln(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        attn_position = cfg.position if cfg.position in ("rope", "rope_pre", "rope_norm") else "none"
        self.ln1 = nn.LayerNorm(cfg.dim)
        if cfg.position == "softmax":
            # Draw (and drop) the FAVOR+ projection a linear layer draws here, so the global RNG
            # is where it is for the other variants and the same seed gives the same weights.
            FavorFeatures(cfg.dim_head, cfg.nb_features, kind=cfg.feature_map)
            self.attn = SoftmaxAttention(cfg.dim, heads=cfg.heads, dim_head=cfg.dim_head, dropout=cfg.dropout,
                                         base=cfg.rope_base, qk_norm=cfg.qk_norm)
        else:
            self.attn = RotaryLinearAttention(
                cfg.dim, heads=cfg.heads, dim_head=cfg.dim_head, nb_features=cfg.nb_features,
                causal=cfg.causal, position=attn_position, feature_map=cfg.feature_map, dropout=cfg.dropout,
                base=cfg.rope_base, qk_norm=cfg.qk_norm,
            )
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult, cfg.dropout)

    def forward(self, x, *, mask=None, output_final_state=False):
        a = self.attn(self.ln1(x), mask=mask, output_final_state=output_final_state)
        a, state = a if output_final_state else (a, None)
        x = x + a
        return x + self.ff(self.ln2(x)), state

    def step(self, x_t, state, position):
        a, state = self.attn.step(self.ln1(x_t), state, position)
        x_t = x_t + a
        return x_t + self.ff(self.ln2(x_t)), state


class PerformerLM(nn.Module):
    """Byte-level causal LM: ids `[B, N]` (long, 0..255) -> logits `[B, N, 256]`.

    Variants differ *only* in ``cfg.position``: every other weight is created and initialised
    in the same order, so the same seed gives the same initial weights (the ``absolute``
    table is created last).
    """

    def __init__(self, cfg: ModelConfig | None = None, **overrides):
        super().__init__()
        if cfg is not None and not isinstance(cfg, ModelConfig):
            hint = f" (PerformerLM.from_preset({cfg!r}) builds a preset)" if isinstance(cfg, str) else ""
            raise TypeError(f"cfg must be a ModelConfig or None, got {type(cfg).__name__}{hint}")
        cfg = ModelConfig(**{**asdict(cfg or ModelConfig()), **overrides})
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=cfg.head_bias)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith(("attn.to_out.weight", "ff.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * cfg.depth) ** 0.5)
        self.pos_emb = None
        if cfg.position == "absolute" or cfg.input_pos == "learned":
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
            nn.init.normal_(self.pos_emb.weight, mean=0.0, std=0.02)
        elif cfg.input_pos == "sinusoidal":
            self.pos_emb = SinusoidalTable(cfg.seq_len, cfg.dim)

    @staticmethod
    def _init(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "PerformerLM":
        """Build a named preset (``paper``, ``cpu``, ``tiny``) with field overrides."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(MODEL_PRESETS)}")
        known = {f.name for f in fields(ModelConfig)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ValueError(f"unknown model config field(s) {bad}; known: {sorted(known)}")
        return cls(ModelConfig(**{**MODEL_PRESETS[name], **overrides}))

    @property
    def feature_modules(self):
        """Every layer's FavorFeatures (none for ``softmax``)."""
        return [b.attn.features for b in self.blocks if hasattr(b.attn, "features")]

    @torch.no_grad()
    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """New FAVOR+ projections for every layer, drawn in layer order from ``generator``."""
        for f in self.feature_modules:
            f.redraw(generator)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _check_ids(self, ids, name: str, dims: int) -> None:
        """ids an integer tensor of ``dims`` dims (`[B, N]` with N >= 1, or `[B]`) on the model's
        device; where ``checks.value_checks`` says (CPU tensors, or ``LINEAR_ROPE_CHECKS=1``),
        ValueError naming the ids outside [0, vocab_size). Elsewhere nothing is read (on a GPU
        that is a host sync): ``_lookup`` gives such an id NaN logits instead, and the trainer's
        data are bytes, checked against the vocabulary before a run starts."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != dims or ids.dtype not in ID_DTYPES \
                or (dims == 2 and ids.shape[1] == 0):
            want = "[B, N] with N >= 1" if dims == 2 else "[B]"
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"{name} must be an integer tensor {want} (long, int32 or uint8), got {got}")
        device = self.head.weight.device
        if ids.device != device:
            raise ValueError(f"{name} is on {ids.device}, the model on {device}")
        V = self.cfg.vocab_size
        if ids.numel() == 0 or not value_checks(ids):
            return
        ids = ids.long()  # uint8 would wrap: ids >= 256 is ids >= 0 there
        out = (ids < 0) | (ids >= V)
        if bool(out.any()):
            bad = ids[out]
            vals = sorted(set(bad.tolist()))
            shown = ", ".join(map(str, vals[:8])) + (", ..." if len(vals) > 8 else "")
            raise ValueError(f"{name}: {bad.numel()} id(s) outside [0, vocab_size={V}): {shown}")

    @staticmethod
    def _lookup(table: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        """``table(idx)``, where an index outside the table gives a row of NaN (so NaN logits, which
        a training step refuses to apply) instead of an out-of-bounds read: no host sync, and no
        device-side assert, which would end the process's CUDA context."""
        n = table.num_embeddings
        bad = (idx < 0) | (idx >= n)
        x = table(idx.clamp(0, n - 1))
        return x.masked_fill(bad.unsqueeze(-1), float("nan"))

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings, plus the ``absolute`` table at ``positions`` `[B, N]` (None: 0..N-1).

        Positions 0..N-1, and those a mask gives (below N), fit the table when N <= seq_len, which
        is checked on the host; other positions are read where ``checks.value_checks`` says, or
        (a host sync on a GPU) when N > seq_len, else a position past the table gives NaN
        (``_lookup``)."""
        x = self._lookup(self.tok_emb, ids)
        if self.pos_emb is not None:
            L = self.cfg.seq_len
            if positions is None:
                if ids.shape[1] > L:
                    raise ValueError(f"ids: position {ids.shape[1] - 1} is past the absolute table of seq_len={L}")
                positions = torch.arange(ids.shape[1], device=ids.device)[None]
            elif positions.numel() and (value_checks(ids) or (ids.shape[1] > L and not is_static())) \
                    and int(positions.max()) >= L:
                raise ValueError(f"ids: position {int(positions.max())} is past the absolute table of seq_len={L}")
            x = x + self._lookup(self.pos_emb, positions)
        return self.drop(x)

    def forward(self, ids: torch.Tensor, *, mask: torch.Tensor | None = None, output_final_state: bool = False):
        """ids `[B, N]` long -> logits `[B, N, vocab]`.

        ``mask`` `[B, N]` bool (True = real token) lets rows of different lengths share a batch,
        padded on the left or the right: each row's real tokens get the logits they get alone.
        With ``output_final_state`` also the per-layer recurrent states after the last token
        (for ``step``; with a mask, the next position of row b is ``mask[b].sum()``). B = 0 gives
        empty logits. An id outside [0, vocab_size) is a ValueError where the value checks run
        (CPU tensors: ``checks.value_checks``), NaN logits elsewhere (no device sync).
        """
        self._check_ids(ids, "ids", 2)
        check_flag("output_final_state", output_final_state)
        if mask is not None:
            mask = check_mask(mask, "mask", tuple(ids.shape), ids.device)
        x = self._embed(ids.long(), None if mask is None else token_positions(0, ids.shape[1], mask))
        states = []
        for block in self.blocks:
            x, state = block(x, mask=mask, output_final_state=output_final_state)
            states.append(state)
        logits = self.head(self.ln_f(x))
        return (logits, states) if output_final_state else logits

    def step(self, token: torch.Tensor, states: list[LinearAttentionState], position: int | torch.Tensor):
        """One token `[B]` at ``position`` (an int, or a LongTensor `[B]` per row) -> (logits
        `[B, vocab]`, new states); O(1) in the context. ``states`` holds one state per layer
        (as ``forward(..., output_final_state=True)`` returns them)."""
        self._check_ids(token, "token", 1)
        listed = isinstance(states, (list, tuple)) and not isinstance(states, LinearAttentionState)
        if not listed or len(states) != len(self.blocks) or not all(s is None or isinstance(s, tuple) for s in states):
            got = f"{len(states)} states" if listed else type(states).__name__
            raise ValueError(f"states: one state per layer is needed ({len(self.blocks)}), got {got}")
        position = check_offset(position, "position", rows=token.shape[0])
        pos = None
        if self.pos_emb is not None:  # only an input table (absolute, input_pos) reads positions here
            pos = position.view(-1, 1) if isinstance(position, torch.Tensor) else torch.full((1, 1), position)
            pos = pos.to(token.device)
        x = self._embed(token.long()[:, None], pos)[:, 0]
        new = []
        for block, state in zip(self.blocks, states):
            x, state = block.step(x, state, position)
            new.append(state)
        return self.head(self.ln_f(x)), new

    @torch.no_grad()
    def generate(
        self,
        prompt: bytes | list[bytes],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        compile: bool | None = None,
    ) -> bytes | list[bytes]:
        """Sample ``max_new_tokens`` bytes after ``prompt``; returns the new bytes only.

        ``prompt`` is bytes, or a list of prompts of any lengths (then a list comes back): they
        are left-padded into one batch, read once in parallel under a mask, and each row then
        decodes at its own positions, so every row gets what it gets alone. Every new token
        costs one recurrent step per layer, O(1) in the context length, on a ``Decoder``: the state
        is updated in place and nothing waits for the device until the last token. ``top_k=1``
        (or ``temperature=0``) is greedy decoding. ``compile``: compile the step (default: on
        CUDA, as a CUDA graph; the first call then pays for the compile).
        """
        return generate(self, prompt, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator,
                        compile=compile)
