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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTER_NAME",
    "PEFT_PREFIX",
    "inject",
    "is_draft_key",
    "is_lora_key",
    "lora_config",
    "merged_meta",
    "merged_state_dict",
    "moe_targets",
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


def _routed(model: torch.nn.Module) -> list[str]:
    """Names of an MoE model's routers and fused expert containers (none for a dense model), as before PEFT wraps
    any of them."""
    from .expert_parallel import expert_modules
    from .router import router_modules

    routed = {id(m) for m in router_modules(model) + expert_modules(model)}
    return sorted({name.replace(".base_layer", "") for name, m in model.named_modules() if id(m) in routed})


def moe_targets(model: torch.nn.Module, targets: str | list[str]) -> list[str] | None:
    """The full names of the ``nn.Linear`` modules an MoE model's adapters go on; None for a dense model.

    PEFT cannot wrap the fused 3-D experts as linears, and its all-linear (and short names such as ``down_proj``)
    would wrap the experts as parameters and the top-k router: the trainer builds adapters on the attention, dense
    and shared-expert linears only, the routers, experts and output head frozen and adapter-free. ``targets`` is
    all-linear or a list of names matched as PEFT does (the whole name or its dotted tail).
    """
    routed = _routed(model)
    if not routed:
        return None
    if targets != "all-linear":
        named = [t for t in targets for r in routed if r == t or r.endswith("." + t)]
        if named:
            raise ValueError(
                f"target_modules {named[0]!r} names a router or routed experts: adapters on them are not built; "
                "target attention or dense linears"
            )
    head = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if any(name == r or name.startswith(r + ".") for r in routed):
            continue
        if targets == "all-linear" or any(name == t or name.endswith("." + t) for t in targets):
            names.append(name)
    return names


def _check_not_routed(model: torch.nn.Module) -> None:
    """Refuse adapters on a router or inside an expert container (what `moe_targets` leaves out)."""
    routed = _routed(model)
    wrapped = [
        k for k in model.state_dict(keep_vars=True) if is_lora_key(k) and any(k.startswith(r + ".") for r in routed)
    ]
    if wrapped:
        raise ValueError(
            f"LoRA adapters on {wrapped[0].split('.lora_')[0]} (a router or routed experts) are not built; "
            "target attention or dense linears"
        )


def inject(model: torch.nn.Module, settings: Mapping[str, Any]) -> Any:
    """PEFT's adapters injected into `model` in place; the ``PeftModel`` wrapper returned.

    On an MoE model the adapters go on `moe_targets` only. PEFT (on transformers 5) would rename targets ending
    in ``gate``, ``gate_proj``, ``up_proj`` or ``down_proj`` to the fused experts and the router, as if they were
    transformers-4 expert names; the names here are already modules of this model, so that renaming is skipped.
    """
    from peft import get_peft_model

    config = lora_config(settings)
    targets = moe_targets(model, settings.get("target_modules", "all-linear"))
    if targets is None:
        return get_peft_model(model, config)
    if not targets:
        raise ValueError(f"target_modules {settings.get('target_modules')!r} match no linear layer of this MoE model")
    config.target_modules = targets
    with _no_expert_renaming():
        peft = get_peft_model(model, config)
    _check_not_routed(model)
    return peft


@contextmanager
def _no_expert_renaming() -> Iterator[None]:
    """PEFT's transformers-4 → 5 target conversion switched off while the adapters are injected."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a PEFT without the conversion
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


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
