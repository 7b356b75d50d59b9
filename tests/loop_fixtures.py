"""A stand-in for the loop a workflow runs under (`workflows.Loop`): its attributes as plain data and the loop's
own per-engine count, so a workflow is tested whole without a Controller, engines or a trainer."""

from __future__ import annotations

__all__ = ["fake_loop"]


def fake_loop(**extra):  # type: ignore[no-untyped-def]
    """The loop attributes the generate workflow reads, as plain data (and the loop's own per-engine count)."""
    import functools
    import types

    from rlc.runtime.controller import Controller

    schedule = types.SimpleNamespace(
        group_size=2, batch_prompts=20, rollout_chunk_prompts=8, rollout_chunks_per_engine=3
    )
    base = {
        "plan": types.SimpleNamespace(
            schedule=schedule,
            algorithm=types.SimpleNamespace(name="grpo", normalize_std=True, dynamic_sampling=None, overlong=None),
            sampling=types.SimpleNamespace(max_response_len=64),
        ),
        "tokenizer": types.SimpleNamespace(eos_token_id=1),
        "version": 0,
        "warming": set(),
        "rollout": types.SimpleNamespace(replicas=1),
        "may_admit": lambda: True,
        "training": None,
    }
    loop = types.SimpleNamespace(**{**base, **extra})
    loop.engine_load = functools.partial(Controller.engine_load, loop)
    return loop
