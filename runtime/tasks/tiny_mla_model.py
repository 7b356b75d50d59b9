"""A tiny DeepSeek-V3: multi-head latent attention (MLA) and DeepSeek's mixture of experts, small enough for tests.

DeepSeek-V3/R1 differ from the Qwen MoE models in both token mixers: attention reads keys and values from a
compressed latent (low-rank q and kv projections, a rotary part of the key shared by every head, value heads
narrower than query/key heads), and the router scores experts with a sigmoid, picks them within the best groups
after a per-expert bias, and scales their weights. This model keeps every one of those traits at the quickstart's
width and character tokenizer, so packing, the layouts and the router are tested on transformers' own classes
without a download. It is randomly initialised: the numerics tests compare forwards, which need no warm-up.
"""

from __future__ import annotations

from transformers import DeepseekV3Config

from .tiny_model import tiny_config

__all__ = ["TINY_MLA_EXPERTS", "TINY_MLA_TOP_K", "new_tiny_mla_model", "tiny_mla_config"]

TINY_MLA_EXPERTS = 8
TINY_MLA_TOP_K = 2


def tiny_mla_config(max_positions: int = 512) -> DeepseekV3Config:
    """3 layers (the first dense, as `first_k_dense_replace`), hidden 128, 4 MLA heads with query/key heads of 48
    (32 without position + 16 rotary, interleaved as DeepSeek stores them) and value heads of 32; q and kv latents
    of 64 and 32. MoE layers: 8 routed experts of width 64 in 4 groups, top-2 within the best 2 groups, one shared
    expert, weights renormalised and scaled by 2.5 as DeepSeek-V3's."""
    base = tiny_config(max_positions)
    return DeepseekV3Config(
        vocab_size=base.vocab_size,
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=TINY_MLA_EXPERTS,
        num_experts_per_tok=TINY_MLA_TOP_K,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_interleave=True,
        # DeepSeek-V3's config.json names its router so; vLLM reads them to load the experts' bias
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        dtype="float32",
    )


def new_tiny_mla_model(max_positions: int = 512):  # type: ignore[no-untyped-def]
    """A randomly initialised `tiny_mla_config` model (`model_builder.build_tiny_model(architecture="mla")`).

    The routers' expert biases (`e_score_correction_bias`, zero at initialisation) are drawn too, so the tests see
    a router whose choice differs from its weights' order, as a trained DeepSeek's does.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_mla_config(max_positions))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    return model
