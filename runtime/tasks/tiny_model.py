"""The quickstart model's parts: a tiny Qwen3 config, its supervised warm-up on one-digit addition, atomic folders.

The embedded default downloads nothing, so the policy is created here. From a random start GRPO
barely earns reward (measured ~0.1 on one-digit addition), so a seeded ~40-step supervised warm-up
gives a weak but non-trivial base policy that RL then visibly improves. The folder is a normal
Hugging Face checkpoint (config, float32 safetensors, tokenizer) that transformers and vLLM load.
It is written to a temporary sibling and renamed into place, so a crash never leaves a half-built
model behind, and a complete folder built by the same recipe is reused.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from .arithmetic import all_one_digit_additions
from .datasets import Example
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, save_char_tokenizer

__all__ = [
    "MARKER",
    "SHARED_SIZES",
    "greedy_accuracy",
    "is_complete",
    "save_model_folder",
    "tiny_config",
    "warmup",
    "write_atomically",
]

MARKER = "rlc_tiny_model.json"
RECIPE_VERSION = 1
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", MARKER)


#: What the quickstart model's siblings (`tiny_hybrid_model`, `tiny_moe_model`) take from its config: sizes,
#: tokenizer ids and tying, so every tiny model reads the same character tokenizer at the same width.
SHARED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def tiny_config(max_positions: int = 512) -> Qwen3Config:
    """2 layers, hidden 128, 4 heads / 2 KV heads of dim 32 (vLLM-CPU needs ≥ 32), vocab 32, tied.

    `max_positions`: 512 for the quickstart (rlc-tiny), 8192 for rlc-tiny-long.
    """
    return Qwen3Config(
        vocab_size=32,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def _warmup_batch(
    examples: list[Example], tokenizer: PreTrainedTokenizerFast
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<bos>prompt answer<eos>`` rows; labels only on answer and eos tokens."""
    rows, label_rows = [], []
    for ex in examples:
        prompt = tokenizer(ex.prompt).input_ids  # starts with <bos>
        answer = [*tokenizer(ex.answer, add_special_tokens=False).input_ids, EOS_ID]
        rows.append(prompt + answer)
        label_rows.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, label_rows, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(lab)] = torch.tensor(lab)
        attn[i, : len(r)] = 1
    return ids, labels, attn


def supervised_steps(
    model: Qwen3ForCausalLM, ids: torch.Tensor, labels: torch.Tensor, attn: torch.Tensor, steps: int, seed: int
) -> None:
    """`steps` seeded AdamW steps (lr 3e-3) on random 64-row batches of the given rows: every warm-up's loop."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        idx = torch.randperm(len(ids), generator=gen)[:64]
        out = model(input_ids=ids[idx], attention_mask=attn[idx], labels=labels[idx])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
    model.eval()


def warmup(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int) -> None:
    ids, labels, attn = _warmup_batch(all_one_digit_additions(), tokenizer)
    supervised_steps(model, ids, labels, attn, steps, seed)


@torch.no_grad()
def greedy_accuracy(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[Example], max_new_tokens: int = 4
) -> float:
    """Fraction of ``examples`` whose greedy completion (up to eos) equals the answer exactly."""
    enc = tokenizer([ex.prompt for ex in examples], return_tensors="pt", padding=True)
    ids, attn = enc["input_ids"], enc["attention_mask"]
    outs: list[list[int]] = [[] for _ in examples]
    done = torch.zeros(len(examples), dtype=torch.bool)
    for _ in range(max_new_tokens):  # full recompute: the sequences are a handful of tokens
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1]
        nxt = logits.argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                if t == EOS_ID:
                    done[i] = True
                else:
                    outs[i].append(t)
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt.unsqueeze(-1)], dim=-1)
        attn = torch.cat([attn, torch.ones_like(nxt).unsqueeze(-1)], dim=-1)
    texts = tokenizer.batch_decode(outs, skip_special_tokens=True)
    return sum(t == ex.answer for t, ex in zip(texts, examples, strict=True)) / len(examples)


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED)


def save_model_folder(model: Any, folder: Path, max_positions: int, *tokenizer_args: Any) -> None:
    """The model (its generation ids the tokenizer's specials) and the character tokenizer into `folder`."""
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(str(folder))
    save_char_tokenizer(folder, max_positions, *tokenizer_args)


def write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """Run ``write`` on a temporary sibling of `out` (an empty or missing folder) and rename it into place.

    One torch thread while writing: these ops are tiny, so threads only add contention on a shared machine, and a
    fixed thread count keeps the weights identical whatever the caller's setting. A crash never leaves a
    half-built folder behind; losing a rename race to a complete model of the same recipe is fine.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        write(tmp)
        if out.exists():
            out.rmdir()  # empty (the callers check); rename cannot replace a directory portably
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_complete(out):  # lost a race to something that is not our model
                raise
    finally:
        torch.set_num_threads(threads)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
