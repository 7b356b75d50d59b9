"""`rlc export RUNDIR`: a plain Hugging Face model folder from a run's newest checkpoint (merged: the only kind).

A full fine-tune's checkpoint already holds the weights as an HF folder (``hf/``), so export copies it. A
LoRA run's checkpoint holds only the adapter in PEFT format (the base never changes), so export loads the
base model named in the run's plan, folds ``W + (alpha / r) · B @ A`` into it with PEFT's
``merge_and_unload`` and saves the result with the base's tokenizer: the folder loads in transformers and
vLLM with no PEFT at all.

Weights that hold NaN or inf are refused, naming the tensor: a checkpoint written after the policy went bad would
otherwise leave as a model that loads without a word and generates nonsense.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from rlc.runtime.checkpoint import CheckpointError, checkpoints_dir, complete_checkpoints, latest_checkpoint

#: Written into every export folder: the only folders `--force` may replace.
EXPORT_MARKER = "rlc-export.json"


class ExportError(RuntimeError):
    """A run directory that cannot be exported, or an output folder it may not write, with the reason in words."""


def export_merged(run_dir: str | Path, out: str | Path | None = None, *, force: bool = False) -> Path:
    """Write the newest complete checkpoint of ``run_dir`` as a merged HF model; returns the folder.

    Default output: ``RUNDIR/export/step-<N>-merged``. An output folder that exists and is not empty is
    refused; with ``force`` it is replaced only if an earlier export wrote it (it holds EXPORT_MARKER), so
    no folder of the user's is ever deleted. The model is assembled in a new hidden folder beside the output
    and renamed into place, so a failed export leaves nothing half-written.
    """
    run = Path(run_dir)
    try:
        found = latest_checkpoint(run)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    if found is None:
        raise ExportError(f"no complete checkpoint under {checkpoints_dir(run)}")
    checkpoint, state = found
    target = (Path(out) if out is not None else run / "export" / f"step-{state.step:06d}-merged").resolve()
    _check_target(target, run, force)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    except OSError as exc:
        raise ExportError(f"cannot write beside {target}: {exc.strerror or exc}") from None
    try:
        _write_model(run, checkpoint, staging)
        _refuse_non_finite(staging, checkpoint, run)
        (staging / EXPORT_MARKER).write_text(
            json.dumps({"run": str(run.resolve()), "checkpoint": checkpoint.name, "step": state.step}, indent=1) + "\n"
        )
        if target.is_dir() and any(target.iterdir()):
            shutil.rmtree(target)  # an earlier export (checked above), replaced under --force
        elif target.is_dir():
            target.rmdir()
        staging.rename(target)
    except OSError as exc:
        raise ExportError(f"cannot write {target}: {exc.strerror or exc}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)  # the hidden folder made above, never the user's
    return target


def _check_target(target: Path, run: Path, force: bool) -> None:
    """Refuse an output that would put the export over the user's files or inside the run's checkpoints."""
    checkpoints = checkpoints_dir(run).resolve()
    if target == checkpoints or checkpoints in target.parents:
        raise ExportError(f"{target} is inside the run's checkpoints folder: choose another output folder")
    if target in checkpoints.parents:
        raise ExportError(f"{target} holds the run's checkpoints: choose another output folder")
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} is a file: choose a folder name")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not force:
        raise ExportError(f"{target} exists and is not empty: choose another folder, or --force to replace an export")
    if not (target / EXPORT_MARKER).is_file():
        raise ExportError(
            f"{target} holds files that no export wrote (no {EXPORT_MARKER}): --force replaces only an earlier "
            "export; choose another folder"
        )


def _write_model(run: Path, checkpoint: Path, staging: Path) -> None:
    if (checkpoint / "adapter").is_dir():
        _merge_adapter(run, checkpoint / "adapter", staging)
    elif (checkpoint / "hf").is_dir():
        shutil.copytree(checkpoint / "hf", staging, dirs_exist_ok=True)
    else:
        raise ExportError(f"{checkpoint} holds neither hf/ weights nor a LoRA adapter/")


def non_finite_tensors(folder: Path) -> list[str]:
    """Each floating-point tensor of the folder's safetensors files that holds NaN or inf, as
    ``name (file: N NaN, M inf)``; read one tensor at a time."""
    import torch
    from safetensors import SafetensorError, safe_open

    found = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                    tensor = handle.get_tensor(name)
                    if not tensor.is_floating_point():
                        continue
                    bad = int((~torch.isfinite(tensor)).sum())
                    if bad:
                        nan = int(torch.isnan(tensor).sum())
                        found.append(f"{name} ({path.name}: {nan} NaN, {bad - nan} inf)")
        except SafetensorError as exc:
            raise ExportError(f"{path.name} is not a readable safetensors file ({exc})") from None
    return found


def _refuse_non_finite(model: Path, checkpoint: Path, run: Path) -> None:
    """ExportError naming the first non-finite tensor of the model about to be exported, and the way out."""
    bad = non_finite_tensors(model)
    if not bad:
        return
    earlier = [p.name for p in complete_checkpoints(run) if p != checkpoint]
    way_out = (
        f"to export the earlier {earlier[-1]}, move {checkpoint.name} out of the checkpoints folder"
        if earlier
        else "no earlier checkpoint is kept"
    )
    more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
    raise ExportError(f"{checkpoint.name} holds non-finite weights: {bad[0]}{more}; nothing was exported ({way_out})")


def _base_model_path(run: Path) -> Path:
    from pydantic import ValidationError

    from rlc.messages import first_line
    from rlc.schemas.plan import Plan

    plan_file = run / "plan.json"
    if not plan_file.is_file():
        raise ExportError(f"{plan_file} is missing: cannot tell which base model the adapter belongs to")
    try:
        plan = Plan.model_validate_json(plan_file.read_text())
    except (OSError, ValueError, ValidationError) as exc:
        raise ExportError(f"{plan_file} is not a readable plan ({first_line(exc)})") from None
    base = Path(plan.model.path or "")
    if not (base / "config.json").is_file():
        raise ExportError(f"the base model {plan.model.path} (model.path in the run's plan) is not an HF folder here")
    return base


def _merge_adapter(run: Path, adapter: Path, out: Path) -> None:
    base_path = _base_model_path(run)
    try:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ExportError(f"merging a LoRA adapter needs torch, transformers and peft ({exc})") from None

    from rlc.runtime.train.weights_out import copy_tokenizer_files

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(out))
    copy_tokenizer_files(str(base_path), out)
