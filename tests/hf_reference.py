"""The reference every engine and trainer log-prob is checked against: the transformers forward in float32."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    """The checkpoint in `model_dir` in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """log p(x_t | x_<t) for t ≥ 1 under softmax(logits / T)."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)
