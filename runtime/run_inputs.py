"""What a run reads before any actor starts: the model folder (the quickstart's built on first use), the prompts and
the reward function."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlc.runtime.errors import RunError
from rlc.runtime.model_family import check_model_family
from rlc.runtime.preflight import Weights, check_model_folder
from rlc.schemas.plan import Plan


def _model_path(plan: Plan) -> Path:
    if plan.model.path is None:
        raise RunError("the plan has no model path")
    return Path(plan.model.path)


def prepare_model(plan: Plan, log) -> tuple[Path, Weights]:  # type: ignore[no-untyped-def]
    """Build the quickstart model when the plan asks for it; check every model folder is complete and sound."""
    path = _model_path(plan)
    if plan.model.build_tiny and not (path / "config.json").is_file():
        from rlc.runtime.tasks.model_builder import build_tiny_model, tiny_architecture

        log(f"building the quickstart model in {path} (one-time, under a minute)")
        try:
            build_tiny_model(
                path,
                seed=plan.algorithm.seed,
                max_positions=plan.model.tiny_max_positions or 512,
                task="calculator" if plan.model.id == "rlc-tiny-agent" else "addition",
                architecture=tiny_architecture(plan.model.id),
            )
        except (OSError, ValueError) as exc:
            raise RunError(f"cannot build the quickstart model in {path}: {exc}") from None
    weights = check_model_folder(path, "model.path")
    check_model_family(path, plan.model)
    for teacher in plan.distill.teachers if plan.distill else []:
        if not teacher.model.path:
            raise RunError(f"teacher {teacher.name}: the plan has no model path (distill.teachers[].model.path)")
        check_model_folder(Path(teacher.model.path), f"teacher {teacher.name}: distill.teachers[].model.path")
    return path, weights


def load_inputs(plan: Plan, model_path: Path) -> tuple[Any, Any]:
    """The tokenizer and reward function; raises RunError for a bad dataset or reward path."""
    from transformers import AutoTokenizer

    from rlc.runtime.prompts import PromptStream
    from rlc.runtime.tasks.datasets import DatasetError
    from rlc.runtime.tasks.rewards import RewardLoadError, load_reward

    try:
        # Local files only: a folder missing a file must fail here, not wait on the Hugging Face Hub.
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RunError(f"cannot load the tokenizer from {model_path}: {exc}") from None
    try:
        reward_fn = load_reward(plan.data.reward)
    except RewardLoadError as exc:
        raise RunError(str(exc)) from None
    try:
        PromptStream(plan.data, tokenizer, plan.algorithm.seed, plan.sampling.max_prompt_len).check()
    except (DatasetError, ValueError, StopIteration) as exc:
        raise RunError(f"cannot read the training data: {exc}") from None
    return tokenizer, reward_fn
