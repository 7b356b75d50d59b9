"""Whether runs of a plan repeat exactly, decided at compile time and written into the plan.

Three things make two runs of the same plan differ (measured on the cpu target; see README "Reproducible
runs"): unseeded sampling (vLLM's engine-wide generator, whose state depends on how requests were batched),
kernels whose reduction order varies (accelerators), and asynchronous admission (with max_staleness > 0
which policy version generates a sample depends on timing). The first is removed by per-request seeds
(`runtime/seeds.py`) unless `algorithm.deterministic` is false (the seeds cost engine CPU at every decode step:
vLLM draws each seeded sequence's noise from its own generator, one call per sequence); the second by the
target's deterministic switches when the plan turns them on; the third cannot be removed, so such runs log
their admission for `rlc run --replay`.
"""

from __future__ import annotations

from rlc.schemas.plan import Reproducibility
from rlc.schemas.spec import Spec
from rlc.schemas.target import TargetProfile

__all__ = ["kernels_on", "reproducibility"]


def kernels_on(spec: Spec, target: TargetProfile) -> bool:
    """Whether the plan turns the target's deterministic switches on (`auto`: where they are free)."""
    asked = spec.algorithm.deterministic
    return target.determinism.auto_on if asked == "auto" else bool(asked)


def reproducibility(
    spec: Spec, target: TargetProfile, mode: str, max_staleness: int, weight_update: str = "wait"
) -> Reproducibility:
    """The plan's reproducibility verdict and switches for the chosen mode, staleness bound and weight-update
    mode."""
    det = target.determinism
    on = kernels_on(spec, target)
    reasons: list[str] = []
    if mode == "disaggregated" and max_staleness > 0:
        replay = (
            "`rlc run PLAN --replay RUN` feeds them back"
            if weight_update == "wait"
            else "`rlc run PLAN --replay RUN` feeds them back where no weight update interrupted a sample (where one "
            "lands mid-sample is timing too: rollout.weight_update: wait makes every sample replayable)"
        )
        reasons.append(
            f"max_staleness {max_staleness}: rollout runs ahead of training, so which policy version generates each "
            f"sample, and which samples make each batch, depend on timing; the run records both in "
            f"RUN/rollouts.jsonl and {replay}"
        )
    if spec.rollout.agent is not None:
        reasons.append(
            "agent rollouts: the agent's own code and tools, their timing, and which engine serves each turn decide "
            "what is generated, so two runs are not expected to repeat"
        )
    seeded = spec.algorithm.deterministic is not False
    if not on:
        if not seeded:
            reasons.append(
                "algorithm.deterministic is false: sampling draws from each engine's own generator (no per-request "
                "seeds), so a sample depends on how requests were batched, and the target's kernels may reduce in "
                "a varying order"
            )
        elif det.env or det.torch_deterministic:
            reasons.append(
                f"deterministic kernels are off on {target.id} by default, since they cost step time; set "
                "algorithm.deterministic: true to turn on " + ", ".join(_switch_names(target))
            )
        else:
            reasons.append(f"target {target.id} names no deterministic switches; its kernels may vary run to run")
    return Reproducibility(
        deterministic=not reasons,
        reasons=reasons,
        seeded_sampling=seeded,
        deterministic_kernels=on,
        torch_deterministic=on and det.torch_deterministic,
        switches=dict(sorted(det.env.items())) if on else {},
        cost=det.cost if on else "",
        replay_log=True,
    )


def _switch_names(target: TargetProfile) -> list[str]:
    det = target.determinism
    names = [f"{k}={v}" for k, v in sorted(det.env.items())]
    return names + (["torch.use_deterministic_algorithms"] if det.torch_deterministic else [])
