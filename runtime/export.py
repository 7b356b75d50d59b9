"""`rlc export RUNDIR --merged`: a plain Hugging Face model folder from a run's newest checkpoint.

A full fine-tune's checkpoint already holds the weights as an HF folder (``hf/``), so export copies it. A
LoRA run's checkpoint holds only the adapter in PEFT format (the base never changes), so export loads the
base model named in the run's plan, folds ``W + (alpha / r) · B @ A`` into it with PEFT's
``merge_and_unload`` and saves the result with the base's tokenizer: the folder loads in transformers and
vLLM with no PEFT at all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rlc.runtime.checkpoint import latest_checkpoint


class ExportError(RuntimeError):
    """A run directory that cannot be exported, with the reason in words."""


def export_merged(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the newest complete checkpoint of ``run_dir`` as a merged HF model; returns the folder.

    Default output: ``RUNDIR/export/step-<N>-merged``. An existing output folder is replaced.
    """
    run = Path(run_dir)
    found = latest_checkpoint(run)
    if found is None:
        raise ExportError(f"no complete checkpoint under {run / 'checkpoints'}")
    checkpoint, state = found
    target = Path(out) if out is not None else run / "export" / f"step-{state.step:06d}-merged"
    staging = target.parent / f".{target.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    if (checkpoint / "adapter").is_dir():
        _merge_adapter(run, checkpoint / "adapter", staging)
    elif (checkpoint / "hf").is_dir():
        shutil.copytree(checkpoint / "hf", staging)
    else:
        raise ExportError(f"{checkpoint} holds neither hf/ weights nor a LoRA adapter/")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _base_model_path(run: Path) -> Path:
    from rlc.schemas.plan import Plan

    plan_file = run / "plan.json"
    if not plan_file.is_file():
        raise ExportError(f"{plan_file} is missing: cannot tell which base model the adapter belongs to")
    plan = Plan.model_validate_json(plan_file.read_text())
    base = Path(plan.model.path or "")
    if not (base / "config.json").is_file():
        raise ExportError(f"the base model {plan.model.path} (model.path in the run's plan) is not an HF folder here")
    return base


def _merge_adapter(run: Path, adapter: Path, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlc.runtime.train.weights_out import copy_tokenizer_files

    base_path = _base_model_path(run)
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(out))
    copy_tokenizer_files(str(base_path), out)
