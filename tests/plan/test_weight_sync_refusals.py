"""`rlc run --dry-run` refuses a weight sync the runtime does not execute (a plan edited by hand or compiled by
another rlc); the compiler's own picks always run."""

from __future__ import annotations

import pytest

from rlc.compiler.pipeline import compile_text
from rlc.runtime import launch_request as lr
from rlc.schemas.plan import Plan

SPEC = """name: w
target: cpu
model: {name: rlc-tiny}
mode: disaggregated
cluster: {devices_per_node: 4}
data: {train: arithmetic}
rollout: {max_prompt_len: 16, max_response_len: 8}
placement: {train: {devices: 2}}
"""


def _plan(text: str = SPEC) -> Plan:
    compiled = compile_text(text, "spec.yaml")
    assert compiled.plan is not None, [d.message for d in compiled.report.diagnostics]
    return compiled.plan


def test_compiled_plans_run_their_weight_sync() -> None:
    plan = _plan()
    assert lr.weight_sync_refusals(plan) == []
    assert not [r for r in lr.launch_request(plan).refusals if "weight sync" in r]


NARROW = frozenset({"broadcast", "disk", "inplace"})
EVERY = frozenset({"broadcast", "disk", "inplace", "shared_memory", "senders", "tp_slicing"})


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"weight_sync_senders": 2}, "senders"),
        ({"weight_sync_slicing": "tp"}, "slicing tp"),
        ({"weight_sync": "shared_memory"}, "shared_memory"),
    ],
)
def test_what_the_runtime_lacks_is_refused(edit: dict, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan()
    edited = plan.model_copy(update={"schedule": plan.schedule.model_copy(update=edit)})
    monkeypatch.setattr(lr, "WEIGHT_SYNC_EXECUTABLE", NARROW)
    refusals = lr.weight_sync_refusals(edited)
    assert refusals and words in refusals[0], refusals
    assert refusals[0] in lr.launch_request(edited).refusals
    # Where the runtime executes the path, the same plan runs, unless what it asks stays impossible.
    monkeypatch.setattr(lr, "WEIGHT_SYNC_EXECUTABLE", EVERY)
    left = lr.weight_sync_refusals(edited)
    if edit == {"weight_sync": "shared_memory"}:
        assert "colocated on cpu only" in left[0]
    else:
        assert left == []


def test_more_senders_than_trainer_ranks_are_refused() -> None:
    plan = _plan()
    edited = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"weight_sync_senders": 9})})
    refusals = lr.weight_sync_refusals(edited)
    assert refusals and "2 trainer ranks" in refusals[0]
