"""LoRA on the FSDP2 trainer: PEFT config from the plan, adapter files, merging, and sync-key filters.

PEFT injects ``LoraLayer`` wrappers into the Hugging Face model in place, so the trainer keeps driving the
plain ``*ForCausalLM`` (and its FSDP2 units) while the ``PeftModel`` wrapper is used only for what PEFT owns:
``disable_adapter()`` (the KL reference is the base model, no second copy) and the adapter config.

Names come in three spellings, converted here so the rest of the runtime never guesses:
* model names (what ``model.state_dict()`` says after injection):
  ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` and ``...q_proj.base_layer.weight``;
* PEFT file names (``adapter_model.safetensors``, what vLLM and ``PeftModel.from_pretrained`` read):
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``;
* HF names of the merged model: ``model.layers.0.self_attn.q_proj.weight``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTER_NAME",
    "PEFT_PREFIX",
    "is_draft_key",
    "is_lora_key",
    "lora_config",
    "merged_meta",
    "merged_state_dict",
    "read_adapter",
    "to_model_names",
    "to_peft_names",
    "write_adapter",
]

ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."
_DRAFT_MARKERS = ("mtp", "draft")


def is_lora_key(name: str) -> bool:
    """A LoRA factor (``lora_A`` / ``lora_B``) in model names: what an adapter file holds and what trains."""
    return ".lora_" in name


def is_draft_key(name: str) -> bool:
    """A speculative-decoding head's weight (MTP layers, a draft model): frozen, never synced to engines."""
    return any(marker in part for part in name.lower().split(".") for marker in _DRAFT_MARKERS)


def lora_config(settings: Mapping[str, Any]) -> Any:
    """``peft.LoraConfig`` from the plan's ``lora`` block (rank, alpha, dropout, target_modules)."""
    from peft import LoraConfig

    targets = settings.get("target_modules", "all-linear")
    return LoraConfig(
        r=int(settings["rank"]),
        lora_alpha=float(settings["alpha"]),
        lora_dropout=float(settings.get("dropout", 0.0)),
        target_modules=targets if isinstance(targets, str) else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def to_peft_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model names of LoRA tensors → PEFT file names (prefix added, adapter name dropped)."""
    marker = f".{ADAPTER_NAME}."
    return {PEFT_PREFIX + k.replace(marker, "."): v for k, v in tensors.items()}


def to_model_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT file names → model names (the inverse of ``to_peft_names``)."""
    out = {}
    for k, v in tensors.items():
        name = k.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
        out[name] = v
    return out


def write_adapter(tensors: Mapping[str, torch.Tensor], config: Any, out_dir: str | Path, base_model: str) -> Path:
    """A PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``) from model-named tensors."""
    from ..rollout.weight_sync import write_safetensors

    out = Path(out_dir)
    write_safetensors(to_peft_names(tensors), out, "adapter_model.safetensors")
    data = config.to_dict()
    data["base_model_name_or_path"] = str(base_model)
    (out / "adapter_config.json").write_text(json.dumps(data, indent=2, sort_keys=True, default=_jsonable) + "\n")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, set):
        return sorted(value)
    if hasattr(value, "value"):  # enums such as TaskType
        return value.value
    return str(value)


def read_adapter(adapter_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Model-named LoRA tensors and the adapter config dict from a PEFT folder."""
    from ..rollout.weight_sync import iter_safetensors

    root = Path(adapter_dir)
    tensors = to_model_names(dict(iter_safetensors(root / "adapter_model.safetensors")))
    return tensors, json.loads((root / "adapter_config.json").read_text())


def _merged_name(name: str) -> str | None:
    """HF name of a model-named key in the merged model; None for LoRA factors (folded into the base)."""
    if is_lora_key(name):
        return None
    return name.replace(".base_layer.", ".")


def merged_meta(meta: list[tuple[str, tuple[int, ...], str]]) -> list[tuple[str, tuple[int, ...], str]]:
    """Sync announcement of the merged model from the injected model's (name, shape, dtype) list."""
    out = []
    for name, shape, dtype in meta:
        merged = _merged_name(name)
        if merged is not None:
            out.append((merged, shape, dtype))
    return out


def merged_state_dict(state_dict: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Fold every ``W + scaling · B @ A`` into plain HF-named weights (LoRA factors dropped).

    ``scaling`` is ``alpha / rank`` (PEFT's default, non-rsLoRA). Runs on CPU copies; the trainer's own
    parameters are untouched, so base weights never change.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        merged = _merged_name(name)
        if merged is None:
            continue
        if ".base_layer." in name:
            prefix = name.split(".base_layer.")[0]
            a = state_dict.get(f"{prefix}.lora_A.{ADAPTER_NAME}.weight")
            b = state_dict.get(f"{prefix}.lora_B.{ADAPTER_NAME}.weight")
            if a is not None and b is not None and name.endswith(".weight"):
                delta = (b.to(torch.float32) @ a.to(torch.float32)) * scaling
                tensor = (tensor.to(torch.float32) + delta).to(tensor.dtype)
        out[merged] = tensor
    return out
