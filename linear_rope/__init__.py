"""linear_rope: RoPE for linear attention, as RoFormer (Su et al., arXiv 2104.09864) proposes
for Performer (Eq. 19), with a byte-level Performer LM and an Enwik8 ablation."""
from .attention import RotaryLinearAttention
from .features import FavorFeatures
from .model import ModelConfig, PerformerLM
from .ops import (
    LinearAttentionState,
    chunk_rotary_linear_attn,
    naive_rotary_linear_attention,
    rotary_linear_attention,
    rotary_linear_attention_step,
)
from .rotary import apply_rotary

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
]
__version__ = "0.2.0"
