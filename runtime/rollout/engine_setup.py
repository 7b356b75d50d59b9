"""What every process that starts vLLM engine cores does first (the engine's front end, and its core hosts on
other nodes): apply the env, pick the CPU GEMM path, and check the plan's engine args state the RL ones."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rlc.schemas.engine_args import PROCESSED_LOGPROBS

from ..platform import Platform, get_platform

__all__ = ["engine_setup"]


def engine_setup(
    engine_args: Mapping[str, Any], platform: str | Platform, env: Mapping[str, str] | None
) -> tuple[Platform, dict[str, Any]]:
    """Apply ``env`` (before vLLM reads its settings); the plan's engine args are vLLM's, as they are, and must
    state the RL ones (`schemas.engine_args`): a behaviour log-prob of another distribution than the sampled one
    would bias every importance weight, silently."""
    for k, v in (env or {}).items():
        os.environ[k] = str(v)
    from rlc.runtime.rollout.cpu_gemm import apply_cpu_gemm_choice

    apply_cpu_gemm_choice()
    resolved = get_platform(platform)
    if engine_args.get("logprobs_mode") != PROCESSED_LOGPROBS:
        raise ValueError(
            f"engine args state logprobs_mode {engine_args.get('logprobs_mode')!r}, not {PROCESSED_LOGPROBS!r}: "
            "the behaviour log-probs must be those of the distribution sampled from (recompile the plan)"
        )
    if engine_args.get("dtype") in (None, "auto"):
        raise ValueError(
            "engine args state no dtype: vLLM's 'auto' casts a float32 checkpoint to half precision, which the "
            "trainer's log-probs would not match (recompile the plan)"
        )
    return resolved, dict(engine_args)
