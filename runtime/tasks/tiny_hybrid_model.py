"""A tiny Qwen3.5-architecture hybrid model: three Gated-DeltaNet layers to one full-attention layer.

The seeds' models (Qwen3.5/3.6) interleave linear attention with gated full attention. This is that shape at
the quickstart's size, with the quickstart's character tokenizer and warm-up, so the trainer's hybrid paths
(model-owned packing, Ulysses over linear heads) are tested on the real transformers classes without a
download. Random weights plus the one-second supervised warm-up: a normal Hugging Face folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from .tiny_model import SHARED_SIZES, save_model_folder, tiny_config, warmup, write_atomically
from .tokenizer import build_char_tokenizer

__all__ = ["build_tiny_hybrid_model", "tiny_hybrid_config"]


def tiny_hybrid_config(max_positions: int = 512) -> Qwen3_5TextConfig:
    """The quickstart model's sizes (`tiny_config`) in 4 layers (linear, linear, linear, full), plus Gated DeltaNet
    2 key / 4 value heads of dim 32 (grouped like Qwen3.6's 16/48) and a conv kernel of 4."""
    base = tiny_config(max_positions)
    return Qwen3_5TextConfig(
        **{name: getattr(base, name) for name in SHARED_SIZES},
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        dtype="float32",
    )


def build_tiny_hybrid_model(out_dir: str | Path, seed: int = 0, warmup_steps: int = 40) -> Path:
    """Create the tiny hybrid checkpoint in `out_dir` (a new or empty folder) and return its path."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose another directory")

    def write(tmp: Path) -> None:
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(tiny_hybrid_config()).to(torch.float32)
        warmup(model, build_char_tokenizer(512), warmup_steps, seed)
        save_model_folder(model, tmp, 512)

    write_atomically(out, write)
    return out
