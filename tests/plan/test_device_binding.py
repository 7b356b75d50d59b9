"""Each actor of an accelerator plan is bound to the devices the plan gives it, never to whatever a node shows.

On NPUs the node-wide mask lists every device and Ray is told not to rewrite it, so without a per-actor mask
every trainer rank would bind device 0 and every engine the node's first devices. These tests read the launch
request (what `rlc run` starts) off the golden plans; no device is needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import GOLDEN

from rlc.runtime.launch_request import launch_request
from rlc.schemas.plan import NodeDevices, Plan


def _plan(name: str) -> Plan:
    return Plan.model_validate_json((GOLDEN / name / "plan" / "plan.json").read_text())


def _planned(plan: Plan, role: str) -> list[tuple[int, int]]:
    return [(p.node, i) for p in plan.role(role).placement for i in p.local_ids]


@pytest.mark.parametrize("name", ["a2-disaggregated", "a3-colocated-mopd-lora-mtp"])
def test_every_actor_binds_its_own_slice_of_its_roles_devices(name: str) -> None:
    plan = _plan(name)
    request = launch_request(plan)
    assert not request.refusals
    for role in plan.roles:
        if role.kind == "environments":
            continue
        kinds = ("trainer",) if role.kind == "train" else ("rollout", "teacher")
        actors = [a for a in request.actors if a.role == role.name and a.kind in kinds]
        bound = [i for a in actors for i in a.devices]
        assert bound == [i for _, i in _planned(plan, role.name)], role.name  # each device once, in plan order
        assert len({len(a.devices) for a in actors}) == 1
        for a in actors:
            env = a.device_env(plan.platform)
            assert env["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, a.devices))
            assert env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    references = [a for a in request.actors if a.kind == "reference"]
    for ref in references:  # a reference rank shares its trainer rank's device
        (rank,) = [a for a in request.actors if a.kind == "trainer" and a.detail["rank"] == ref.detail["rank"]]
        assert ref.devices == rank.devices


def test_engines_of_one_node_get_disjoint_devices() -> None:
    """The A3 golden runs several engines on each of two 16-device nodes: each on its own consecutive slice, in
    order, and every engine's first bundle is its first device's (node 0's bundles 0-15, node 1's 16-31)."""
    plan = _plan("a3-colocated-mopd-lora-mtp")
    engines = [a for a in launch_request(plan).actors if a.kind == "rollout"]
    width = len(engines[0].devices)
    assert 16 % width == 0 and len(engines) == 2 * 16 // width
    slices = [tuple(range(k * width, (k + 1) * width)) for k in range(16 // width)]
    assert [a.devices for a in engines] == slices * 2
    assert [a.bundle_index for a in engines] == [k * width for k in range(len(engines))]


def test_an_actor_whose_devices_span_nodes_is_refused() -> None:
    plan = _plan("a2-disaggregated")
    rollout = plan.role("rollout")
    devices = sum(len(p.local_ids) for p in rollout.placement)
    # The same devices split 1 + the rest across two nodes: the first engine would reach onto the second node.
    rollout.placement = [NodeDevices(node=1, local_ids=[0]), NodeDevices(node=2, local_ids=list(range(devices - 1)))]
    refusals = launch_request(plan).refusals
    assert any("role rollout: actor 0 drives devices on several nodes" in r for r in refusals), refusals


def test_cpu_plans_bind_nothing(tmp_path: Path) -> None:
    from plan_fixtures import cpu_plan

    plan = cpu_plan(model_path=str(tmp_path / "m"), run_dir=str(tmp_path / "run"), build_tiny=False)
    assert all(not a.devices and not a.device_env(plan.platform) for a in launch_request(plan).actors)


def test_the_runtime_platforms_are_the_one_platform_table() -> None:
    """The launch request (dry run) and the runtime's devices read the same facts: Ascend's mask is
    ASCEND_RT_VISIBLE_DEVICES, CUDA's CUDA_VISIBLE_DEVICES, and cpu workers are processes with none."""
    from rlc.runtime.platform import PLATFORMS
    from rlc.schemas.platforms import PLATFORM_FACTS

    assert {k: vars(p) for k, p in PLATFORMS.items()} == {k: vars(f) for k, f in PLATFORM_FACTS.items()}
    masks = {k: f.visible_devices_env for k, f in PLATFORM_FACTS.items()}
    assert masks == {"cpu": None, "cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
