"""A tiny Qwen3-MoE model: the quickstart model's sizes with every MLP replaced by 8 experts, top-2.

Mixture-of-experts models are what large RL runs train now. This is that shape small enough for two cores, with
the quickstart's character tokenizer and warm-up (`tiny_model.build_tiny_model(architecture="moe")`), so expert
parallelism, MoE rollout and the engines' expert-weight reloads are tested on the real transformers and vLLM
classes without a download.
"""

from __future__ import annotations

from transformers import Qwen3MoeConfig

from .tiny_model import SHARED_SIZES, tiny_config

__all__ = ["TINY_MOE_EXPERTS", "TINY_MOE_TOP_K", "tiny_moe_config"]

TINY_MOE_EXPERTS = 8
TINY_MOE_TOP_K = 2


def tiny_moe_config(max_positions: int = 512) -> Qwen3MoeConfig:
    """The quickstart model's sizes (`tiny_config`); each layer's MLP is 8 experts of width 64, 2 per token.

    The router's top-2 weights are renormalised (`norm_topk_prob`, as Qwen3-30B-A3B) and its load-balancing loss
    is left to the trainer (`output_router_logits` off: rlc adds it over the global batch when the plan asks).
    """
    base = tiny_config(max_positions)
    return Qwen3MoeConfig(
        **{name: getattr(base, name) for name in SHARED_SIZES},
        num_hidden_layers=base.num_hidden_layers,
        moe_intermediate_size=64,
        num_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        dtype="float32",
    )
