"""linear_rope: RoPE for linear attention, as RoFormer (Su et al., arXiv 2104.09864) proposes
for Performer (Eq. 19), with a byte-level Performer LM and an Enwik8 ablation."""
import torch

from .attention import RotaryLinearAttention
from .features import FavorFeatures
from .from_performer import from_performer_kwargs, from_performer_pytorch
from .model import ModelConfig, PerformerLM
from .ops import (
    LinearAttentionState,
    chunk_rotary_linear_attn,
    naive_rotary_linear_attention,
    rotary_linear_attention,
    rotary_linear_attention_step,
)
from .rotary import apply_rotary


def load_run(path, device: str | torch.device = "cpu") -> PerformerLM:
    """A trained run as a ``PerformerLM``: ``path`` is a run folder written by ``python -m
    linear_rope.train`` (its newest checkpoint is read) or one of its ``ckpt-<step>.pt`` files.

    The checkpoint is read as ``python -m linear_rope.sample`` reads it: with
    ``torch.load(weights_only=True)`` only, its content digest and its weights' ``param_sha256``
    checked, its config checked against the weights' shapes before anything is built, and its
    weights finite. Returns the model on ``device`` in eval mode; ``model.cfg`` is its
    ``ModelConfig`` (the variant is ``model.cfg.position``). The run's training config and
    history are in the run folder's ``config.json``. A missing, corrupt, unsafe or foreign file
    raises a one-line ``ValueError`` (``linear_rope.enwik8.checkpoint.CheckpointError``) that
    names the run's previous checkpoint where there is one.
    """
    from .enwik8.sample import load_model  # the app's loader; importing the package does not load the app

    return load_model(path, device)


__all__ = [
    "apply_rotary",
    "rotary_linear_attention",
    "chunk_rotary_linear_attn",
    "rotary_linear_attention_step",
    "naive_rotary_linear_attention",
    "LinearAttentionState",
    "FavorFeatures",
    "RotaryLinearAttention",
    "PerformerLM",
    "ModelConfig",
    "load_run",
    "from_performer_kwargs",
    "from_performer_pytorch",
]
__version__ = "0.2.0"
