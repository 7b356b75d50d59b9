"""Which errors from an engine actor mean the engine is gone and should be replaced.

An engine can die two ways: its Ray actor process exits (``RayActorError``, e.g. killed or OOM-killed),
or vLLM's engine-core subprocess dies under a live actor, after which every call fails with a task
error whose cause is vLLM's ``EngineDeadError``. Both are recoverable by a fresh actor; anything else
(a bad request, a bug) is not, and is re-raised by the callers.
"""

from __future__ import annotations

__all__ = ["engine_is_dead"]


def engine_is_dead(exc: BaseException) -> bool:
    """True for an exited actor or a task error caused by vLLM's ``EngineDeadError``."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        return True
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        return type(cause).__name__ == "EngineDeadError" or "EngineDeadError" in str(exc)
    return False
