"""From performer-pytorch: its keywords build our model, and its trained ``PerformerLM`` converts.

* ``from_performer_kwargs(**kw)``: performer-pytorch's ``PerformerLM`` keywords, as they are ->
  our ``PerformerLM``; ``attention_from_performer_kwargs(**kw)``: its ``SelfAttention``'s -> our
  ``RotaryLinearAttention``. A keyword ours cannot honour is a one-line ValueError naming it.
* ``from_performer_pytorch(model_or_state_dict, position=...)``: its weights (embeddings, norms,
  q/k/v/out, feed-forward, head, the FAVOR+ projections) in our model. With the position it was
  trained with (``rope_pre`` for its ``rotary_position_emb``, else ``none``) the logits are its
  logits, up to its ``eps`` (docs/performer-pytorch.md); ``position="rope"`` keeps every weight
  and puts RoPE where RoFormer's Eq. 19 does.
* ``save_converted(model, folder)`` / ``python -m linear_rope.from_performer``: the converted
  model as a checkpoint of ours, for ``load_run`` and ``train_enwik8.py --init-from``.

``LM_KEYWORDS`` and ``ATTENTION_KEYWORDS`` are the mapping: the table in docs/performer-pytorch.md
is checked against them (tests/test_performer_pytorch.py). performer-pytorch is imported only here,
and only when a function needs it.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from .attention import POSITIONS, RotaryLinearAttention
from .model import ModelConfig, PerformerLM

__all__ = ["from_performer_kwargs", "attention_from_performer_kwargs", "from_performer_pytorch", "save_converted",
           "performer_keywords_of", "keyword_tables", "LM_KEYWORDS", "ATTENTION_KEYWORDS", "FAST_ATTENTION_KEYWORDS",
           "main"]

# Their keyword -> (ours, or None where ours has no such thing; a note). A keyword with None is
# refused unless it has performer-pytorch's default value.
LM_KEYWORDS: dict[str, tuple[str | None, str]] = {
    "num_tokens": ("vocab_size", "at most 256: the model is byte-level"),
    "max_seq_len": ("seq_len", "also the size of the input position table"),
    "dim": ("dim", ""),
    "depth": ("depth", ""),
    "heads": ("heads", ""),
    "dim_head": ("dim_head", ""),
    "causal": ("causal", "its default is False (bidirectional); next-byte training and decoding need True"),
    "nb_features": ("nb_features", "None: int(dim_head ln dim_head), as there"),
    "feature_redraw_interval": ("feature_redraw_interval", "ours counts optimizer steps, its forward calls "
                                "in training; None: 0 (never)"),
    "auto_check_redraw": ("feature_redraw_interval", "False: 0 (never)"),
    "ff_mult": ("ff_mult", ""),
    "ff_chunks": ("(none needed)", "chunking does not change the result; any value"),
    "emb_dropout": ("dropout", "the three dropouts must be equal; ours drops the feed-forward's output, "
                    "its the hidden layer"),
    "ff_dropout": ("dropout", "see emb_dropout"),
    "attn_dropout": ("dropout", "see emb_dropout"),
    "rotary_position_emb": ("position, input_pos", "True: position='rope_pre' with input_pos='sinusoidal' (its fixed "
                            "table); False: position='none' with input_pos='learned'. Eq. 19 is position='rope'"),
    "attn_out_bias": ("to_out.bias", "ours always has one; False: it starts at 0 (and trains)"),
    "tie_embed": (None, "ours has its own head; from_performer_pytorch copies a tied embedding into it"),
    "qkv_bias": (None, "ours projects q, k, v without a bias"),
    "local_attn_heads": (None, "no local attention heads"),
    "local_window_size": (None, "no local attention heads"),
    "reversible": (None, "no reversible layers"),
    "ff_glu": (None, "the feed-forward is GELU, without a gate"),
    "generalized_attention": (None, "FAVOR+ of the softmax kernel only (feature_map elu / relu act on q, k "
                              "directly, without its projection)"),
    "kernel_fn": (None, "used by generalized_attention only"),
    "use_scalenorm": (None, "LayerNorm only"),
    "use_rezero": (None, "LayerNorm only"),
    "cross_attend": (None, "a decoder-only LM (RotaryLinearAttention takes context= for cross-attention)"),
    "no_projection": (None, "FAVOR+ features only"),
    "axial_position_emb": (None, "no axial position table"),
    "axial_position_shape": (None, "no axial position table"),
    "shift_tokens": (None, "no token shifting"),
}

ATTENTION_KEYWORDS: dict[str, tuple[str | None, str]] = {
    "dim": ("dim", ""),
    "causal": ("causal", "its default is False, ours True"),
    "heads": ("heads", ""),
    "dim_head": ("dim_head", ""),
    "nb_features": ("nb_features", "None: int(dim_head ln dim_head), as there"),
    "feature_redraw_interval": ("(none needed)", "its layer never reads it; ours redraws with layer.features.redraw()"),
    "dropout": ("dropout", ""),
    "attn_out_bias": ("to_out.bias", "ours always has one; False: it starts at 0 (and trains)"),
    "qkv_bias": (None, "ours projects q, k, v without a bias"),
    "local_heads": (None, "no local attention heads"),
    "local_window_size": (None, "no local attention heads"),
    "generalized_attention": (None, "FAVOR+ of the softmax kernel only"),
    "kernel_fn": (None, "used by generalized_attention only"),
    "no_projection": (None, "FAVOR+ features only"),
}

# FastAttention (q, k, v `[B, H, N, d]` -> `[B, H, N, d]`) has no layer of ours: FavorFeatures and
# the op ``rotary_linear_attention(q, k, v, causal=..., rotary=False, projection=features.projection)``
# stand in. Documented in the table, not built.
FAST_ATTENTION_KEYWORDS: dict[str, tuple[str | None, str]] = {
    "dim_heads": ("FavorFeatures(dim_head)", ""),
    "nb_features": ("FavorFeatures(nb_features)", "None: ours rounds int(d ln d) up to even"),
    "ortho_scaling": ("(none needed)", "0 only: ours draws its rows, then flips their signs at random"),
    "causal": ("rotary_linear_attention(causal=)", ""),
    "generalized_attention": (None, "FAVOR+ of the softmax kernel only"),
    "kernel_fn": (None, "used by generalized_attention only"),
    "no_projection": (None, "FAVOR+ features only"),
}


# The tables of docs/performer-pytorch.md, in its order.
KEYWORD_TABLES = {"PerformerLM": LM_KEYWORDS, "SelfAttention": ATTENTION_KEYWORDS, "FastAttention": FAST_ATTENTION_KEYWORDS}


def keyword_tables() -> str:
    """The markdown tables of docs/performer-pytorch.md: its keyword, ours or "not supported", why."""
    parts = []
    for cls, table in KEYWORD_TABLES.items():
        rows = [f"| `{name}` | {f'`{ours}`' if ours and not ours.startswith('(') else ours or 'not supported'} | {why} |"
                for name, (ours, why) in table.items()]
        parts.append(f"`{cls}`:\n\n| performer-pytorch | linear_rope | |\n|---|---|---|\n" + "\n".join(rows))
    return "\n\n".join(parts) + "\n"


def _their(cls_name: str):
    import performer_pytorch.performer_pytorch as pp  # imported only when asked for

    return getattr(pp, cls_name)


def _defaults(cls_name: str) -> dict:
    sig = inspect.signature(_their(cls_name).__init__)
    return {n: p.default for n, p in sig.parameters.items() if n != "self"}


def _is_default(name: str, value, default) -> bool:
    if name == "kernel_fn":
        return type(value) is torch.nn.ReLU
    if name in ("local_attn_heads", "local_heads"):
        return all(v == 0 for v in (value if isinstance(value, tuple) else (value,)))
    return value is default or (type(value) is type(default) and value == default)


def _checked(kw: dict, table: dict, cls_name: str, allow: tuple[str, ...] = ()) -> dict:
    """Every keyword known and honoured: the keywords with performer-pytorch's defaults filled in,
    or a one-line ValueError naming the first one ours cannot honour."""
    defaults = _defaults(cls_name)
    for name in kw:
        if name not in defaults:
            raise ValueError(f"{name}: not a keyword of performer-pytorch's {cls_name}")
    missing = [n for n, d in defaults.items() if d is inspect.Parameter.empty and n not in kw]
    if missing:
        raise ValueError(f"{missing[0]}: performer-pytorch's {cls_name} needs it (no default)")
    for name, value in kw.items():
        ours, why = table[name]
        if ours is None and name not in allow and not _is_default(name, value, defaults[name]):
            raise ValueError(f"{name}={value!r}: not supported by linear_rope ({why})")
    return {**defaults, **kw}


def _nb_features(nb_features, dim_head: int) -> int:
    return int(dim_head * math.log(dim_head)) if nb_features is None else nb_features


def _config(kw: dict, position: str | None, tied: bool = False) -> ModelConfig:
    """ModelConfig from checked ``PerformerLM`` keywords (``kw``, defaults filled in)."""
    if not isinstance(kw["num_tokens"], int) or kw["num_tokens"] > 256:
        raise ValueError(f"num_tokens={kw['num_tokens']!r}: not supported by linear_rope (at most 256: the model "
                         f"is byte-level)")
    drops = {n: kw[n] for n in ("emb_dropout", "ff_dropout", "attn_dropout")}
    if len(set(drops.values())) > 1:
        raise ValueError(f"emb_dropout, ff_dropout, attn_dropout: ours has one dropout, so they must be equal, "
                         f"got {drops}")
    rotary = bool(kw["rotary_position_emb"])
    position = ("rope_pre" if rotary else "none") if position is None else position
    if position not in POSITIONS:
        raise ValueError(f"position must be one of {POSITIONS} (where RoPE goes in the attention; its position "
                         f"table is kept as input_pos), got {position!r}")
    redraw = kw["feature_redraw_interval"] if kw["auto_check_redraw"] else None
    dim_head = kw["dim_head"] if kw["dim_head"] is not None else kw["dim"] // kw["heads"]  # as its layers do
    return ModelConfig(
        vocab_size=kw["num_tokens"], dim=kw["dim"], depth=kw["depth"], heads=kw["heads"], dim_head=dim_head,
        nb_features=_nb_features(kw["nb_features"], dim_head), seq_len=kw["max_seq_len"], position=position,
        ff_mult=kw["ff_mult"], dropout=float(kw["emb_dropout"]), feature_redraw_interval=redraw or 0,
        causal=bool(kw["causal"]), input_pos="sinusoidal" if rotary else "learned", head_bias=not tied,
    )


def from_performer_kwargs(*, position: str | None = None, **kw) -> PerformerLM:
    """Our ``PerformerLM`` from performer-pytorch's ``PerformerLM`` keywords, as they are.

    ``position`` (ours, not theirs): where RoPE goes in the attention; None gives what its
    ``rotary_position_emb`` gives (``rope_pre``, or ``none`` with its learned table when False);
    ``"rope"`` is RoFormer's Eq. 19. ``LM_KEYWORDS`` says what each keyword becomes; one ours
    cannot honour (``reversible=True``, ``local_attn_heads``, ``tie_embed=True``, ...) is a
    one-line ValueError naming it, before anything is built."""
    return PerformerLM(_config(_checked(kw, LM_KEYWORDS, "PerformerLM"), position))


def attention_from_performer_kwargs(*, position: str = "none", **kw) -> RotaryLinearAttention:
    """Our ``RotaryLinearAttention`` from performer-pytorch's ``SelfAttention`` keywords.

    ``position`` (ours): its layer has a position only when its model passes ``pos_emb`` (rotary:
    ``"rope_pre"``); Eq. 19 is ``"rope"``. ``ATTENTION_KEYWORDS`` says what each keyword becomes."""
    kw = _checked(kw, ATTENTION_KEYWORDS, "SelfAttention")
    dim_head = kw["dim_head"] if kw["dim_head"] is not None else kw["dim"] // kw["heads"]
    return RotaryLinearAttention(kw["dim"], heads=kw["heads"], dim_head=dim_head,
                                 nb_features=_nb_features(kw["nb_features"], dim_head), causal=bool(kw["causal"]),
                                 position=position, dropout=float(kw["dropout"]))


def performer_keywords_of(model) -> dict:
    """The ``PerformerLM`` keywords a performer-pytorch model was built with, read from its modules
    (those a model does not record, such as ``axial_position_shape``, as their defaults). Reads
    structure only; a reversible model is reported at once, as its layers are laid out otherwise."""
    import performer_pytorch.performer_pytorch as pp

    if not isinstance(model, pp.PerformerLM):
        raise ValueError(f"model must be performer-pytorch's PerformerLM or its state dict, got {type(model).__name__}")
    emb, perf = model.token_emb, model.performer
    kw = dict(num_tokens=emb.num_embeddings, dim=emb.embedding_dim, max_seq_len=model.max_seq_len,
              rotary_position_emb=isinstance(model.pos_emb, pp.FixedPositionalEmbedding),
              axial_position_emb=isinstance(model.pos_emb, pp.AxialPositionalEmbedding),
              emb_dropout=model.dropout.p, tie_embed=model.to_out is None,
              reversible=not isinstance(perf.net, pp.SequentialSequence),
              feature_redraw_interval=perf.proj_updater.feature_redraw_interval,
              auto_check_redraw=perf.auto_check_redraw)
    if kw["reversible"]:
        return {**kw, "depth": len(perf.net.blocks), "heads": 1}
    layers = perf.net.layers
    wrap, ffw = layers[0][0], layers[0][1]
    attn = wrap.fn.fn if isinstance(wrap.fn, pp.PreShiftTokens) else wrap.fn
    fast, ff = attn.fast_attention, ffw.fn.fn if isinstance(ffw.fn, pp.PreShiftTokens) else ffw.fn
    kw.update(depth=len(layers), heads=attn.heads, dim_head=fast.dim_heads, nb_features=fast.nb_features,
              causal=fast.causal, generalized_attention=fast.generalized_attention, kernel_fn=fast.kernel_fn,
              no_projection=fast.no_projection, local_attn_heads=attn.heads - attn.global_heads,
              qkv_bias=attn.to_q.bias is not None, attn_out_bias=attn.to_out.bias is not None,
              attn_dropout=attn.dropout.p, shift_tokens=isinstance(wrap.fn, pp.PreShiftTokens),
              use_scalenorm=isinstance(wrap, pp.PreScaleNorm), use_rezero=isinstance(wrap, pp.ReZero),
              cross_attend=any(isinstance(m, pp.CrossAttention) for m in perf.modules()),
              ff_chunks=ffw.fn.chunks if isinstance(ffw.fn, pp.Chunk) else 1)
    if isinstance(ff, pp.Chunk):
        ff = ff.fn
    kw.update(ff_glu=ff.glu, ff_mult=ff.w2.in_features // kw["dim"], ff_dropout=ff.dropout.p)
    return kw


def from_performer_pytorch(source, *, position: str | None = None, **performer_kwargs) -> PerformerLM:
    """performer-pytorch's ``PerformerLM`` (a model, or its state dict with the keywords it was
    built with) as our ``PerformerLM``, every weight moved, in eval mode, float32.

    ``position``: None (what it was trained with: ``rope_pre`` for ``rotary_position_emb=True``,
    else ``none``; its position table goes to ``input_pos``), or ``"rope"`` (Eq. 19),
    ``"rope_norm"``, ``"rope_pre"``, ``"none"``: every variant keeps every weight. What cannot
    cross (reversible layers, local heads, axial positions, q/k/v biases, ...) is a one-line
    ValueError naming it, raised before anything is built; a tied head is copied into our head."""
    if isinstance(source, Mapping):
        if not performer_kwargs:
            raise ValueError("a state dict holds no keywords: pass the ones its PerformerLM was built with "
                             "(num_tokens=..., max_seq_len=..., dim=..., depth=..., heads=..., causal=..., ...)")
        kw = _checked(performer_kwargs, LM_KEYWORDS, "PerformerLM", allow=("tie_embed",))
        cfg = _config(kw, position, tied=bool(kw["tie_embed"]))
        model = _their("PerformerLM")(**performer_kwargs)
        try:
            model.load_state_dict(source)
        except RuntimeError as e:
            raise ValueError(f"the state dict is not of a PerformerLM built with these keywords "
                             f"({' '.join(str(e).split())[:200]})") from None
    else:
        if performer_kwargs:
            raise ValueError(f"{sorted(performer_kwargs)[0]}: keywords go with a state dict; a model has its own")
        kw = _checked(performer_keywords_of(source), LM_KEYWORDS, "PerformerLM", allow=("tie_embed",))
        cfg = _config(kw, position, tied=bool(kw["tie_embed"]))
        model = source
    ours = PerformerLM(cfg)
    ours.load_state_dict(_moved(model, ours))
    return ours.eval()


def _moved(model, ours: PerformerLM) -> dict:
    """Our state dict, filled with ``model``'s weights (float32)."""
    def f(t):
        return t.detach().to(torch.float32).clone()

    sd = {"tok_emb.weight": f(model.token_emb.weight), "ln_f.weight": f(model.norm.weight),
          "ln_f.bias": f(model.norm.bias)}
    table = model.pos_emb.emb
    sd["pos_emb.weight"] = f(table if isinstance(table, torch.Tensor) else table.weight)
    for i, (attn_w, ff_w) in enumerate(model.performer.net.layers):
        a, ff, p = attn_w.fn, ff_w.fn.fn, f"blocks.{i}."
        sd[p + "ln1.weight"], sd[p + "ln1.bias"] = f(attn_w.norm.weight), f(attn_w.norm.bias)
        sd[p + "attn.to_qkv.weight"] = f(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]))
        sd[p + "attn.to_out.weight"] = f(a.to_out.weight)
        sd[p + "attn.to_out.bias"] = f(a.to_out.bias) if a.to_out.bias is not None else \
            torch.zeros(a.to_out.out_features)
        sd[p + "attn.features.projection"] = f(a.fast_attention.projection_matrix)
        sd[p + "ln2.weight"], sd[p + "ln2.bias"] = f(ff_w.norm.weight), f(ff_w.norm.bias)
        sd[p + "ff.0.weight"], sd[p + "ff.0.bias"] = f(ff.w1.weight), f(ff.w1.bias)
        sd[p + "ff.2.weight"], sd[p + "ff.2.bias"] = f(ff.w2.weight), f(ff.w2.bias)
    if model.to_out is None:  # tied: its head is the token embedding
        sd["head.weight"] = f(model.token_emb.weight)
    else:
        sd["head.weight"], sd["head.bias"] = f(model.to_out.weight), f(model.to_out.bias)
    return sd


def save_converted(model: PerformerLM, folder, source: str = "performer-pytorch") -> Path:
    """Write ``model`` as step 0 of a run folder of ours (``folder/ckpt-00000000.pt``, read by
    ``load_run``, ``python -m linear_rope.sample`` and ``train_enwik8.py --init-from``).
    Refuses a folder that already holds checkpoints."""
    from .enwik8.checkpoint import list_checkpoints, save_checkpoint  # the app's format
    from .enwik8.runtime import param_digest

    if list_checkpoints(folder):
        raise ValueError(f"{folder} already holds checkpoints; choose an empty folder")
    payload = {"model": model.state_dict(), "step": 0, "config": {"model": asdict(model.cfg), "source": source},
               "metrics": {}, "param_sha256": [param_digest(model)]}
    return save_checkpoint(folder, 0, payload, keep=1)


def main(argv: list[str] | None = None) -> int:
    """``python -m linear_rope.from_performer STATE_DICT.pt --kwargs JSON --out FOLDER [--position P]``."""
    from .enwik8.cli import OneLineParser

    p = OneLineParser(prog="python -m linear_rope.from_performer",
                      description="performer-pytorch's PerformerLM (a torch.save'd state dict) as a checkpoint "
                                  "of linear_rope, for train_enwik8.py --init-from and load_run")
    p.add_argument("state_dict", help="its model.state_dict(), saved with torch.save")
    p.add_argument("--kwargs", required=True, help="the keywords its PerformerLM was built with, as JSON")
    p.add_argument("--out", required=True, help="an empty folder: ckpt-00000000.pt is written there")
    p.add_argument("--position", default=None, choices=POSITIONS,
                   help="where RoPE goes (default: what it was trained with; rope is Eq. 19)")
    args = p.parse_args(argv)
    try:
        kw = json.loads(args.kwargs)
        if not isinstance(kw, dict):
            raise ValueError(f"--kwargs must be a JSON object, got {args.kwargs!r}")
        sd = torch.load(args.state_dict, map_location="cpu", weights_only=True)
        path = save_converted(from_performer_pytorch(sd, position=args.position, **kw), args.out)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        p.exit(2, f"{p.prog}: error: {' '.join(str(e).split())}\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
