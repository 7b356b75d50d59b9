"""A tiny Qwen3.5-architecture hybrid model: three Gated-DeltaNet layers to one full-attention layer.

The seeds' models (Qwen3.5/3.6) interleave linear attention with gated full attention. This is that shape at
the quickstart's size, with the quickstart's character tokenizer and warm-up, so the trainer's hybrid paths
(model-owned packing, Ulysses over linear heads) are tested on the real transformers classes without a
download. Random weights plus the one-second supervised warm-up: a normal Hugging Face folder.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from .tiny_model import _warmup
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer, save_char_tokenizer

__all__ = ["build_tiny_hybrid_model", "tiny_hybrid_config"]


def tiny_hybrid_config(max_positions: int = 512) -> Qwen3_5TextConfig:
    """4 layers (linear, linear, linear, full), hidden 128; attention 4 heads / 2 KV of dim 32; Gated DeltaNet
    2 key / 4 value heads of dim 32 (grouped like Qwen3.6's 16/48), conv kernel 4; vocab 32, tied."""
    return Qwen3_5TextConfig(
        vocab_size=32,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def build_tiny_hybrid_model(out_dir: str | Path, seed: int = 0, warmup_steps: int = 40) -> Path:
    """Create the tiny hybrid checkpoint in `out_dir` (a new or empty folder) and return its path."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(tiny_hybrid_config()).to(torch.float32)
        tokenizer = build_char_tokenizer(512)
        _warmup(model, tokenizer, warmup_steps, seed)
        model.generation_config.bos_token_id = BOS_ID
        model.generation_config.eos_token_id = EOS_ID
        model.generation_config.pad_token_id = PAD_ID
        model.save_pretrained(str(tmp))
        save_char_tokenizer(tmp, 512)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        torch.set_num_threads(threads)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
