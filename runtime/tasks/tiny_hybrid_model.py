"""A tiny Qwen3.5-architecture hybrid model: three Gated-DeltaNet layers to one full-attention layer.

The seeds' models (Qwen3.5/3.6) interleave linear attention with gated full attention. This is that shape at
the quickstart's size, with the quickstart's character tokenizer and warm-up, so the trainer's hybrid paths
(model-owned packing, Ulysses over linear heads) are tested on the real transformers classes without a
download. Random weights plus the one-second supervised warm-up: a normal Hugging Face folder
(`model_builder.build_tiny_model(architecture="hybrid")`).
"""

from __future__ import annotations

from transformers import Qwen3_5TextConfig

from .tiny_model import SHARED_SIZES, tiny_config

__all__ = ["tiny_hybrid_config"]


def tiny_hybrid_config(
    max_positions: int = 512, key_heads: int = 2, value_heads: int = 4, head_dim: int = 32
) -> Qwen3_5TextConfig:
    """The quickstart model's sizes (`tiny_config`) in 4 layers (linear, linear, linear, full), plus Gated DeltaNet
    2 key / 4 value heads of dim 32 (grouped like Qwen3.6's 16/48; other counts for `tiny_mtp_model`) and a conv
    kernel of 4."""
    base = tiny_config(max_positions)
    return Qwen3_5TextConfig(
        **{name: getattr(base, name) for name in SHARED_SIZES},
        num_hidden_layers=4,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        dtype="float32",
    )
