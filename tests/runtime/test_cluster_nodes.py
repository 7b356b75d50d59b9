"""A cluster run puts each role on the node the plan gives it, checks every node before any role starts, and
records which node ran which actor; relative paths mean one thing on every node."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from plan_fixtures import CPU_SPEC, a2_plan, cpu_plan, spec_from

from rlc.compiler.emit import emit_plan_dir
from rlc.runtime import nodes
from rlc.runtime.errors import RunError, resume_command
from rlc.runtime.launch_request import launch_request


def test_bundles_ask_for_the_node_the_plan_gives_them() -> None:
    request = launch_request(a2_plan(nodes=2))
    planned = {a.name: a.node for a in request.actors}
    for group in request.placement_groups:
        for bundle in group.bundles:
            assert sum(1 for k in bundle if k.startswith("rlc_node_n")) == 1, bundle
    plan = a2_plan(nodes=2)
    for role in plan.roles:
        on = {p.node for p in role.placement}
        actors = [a for a in request.actors if a.role == role.name]
        assert {planned[a.name] for a in actors} <= on
        group = next(g for g in request.placement_groups if g.name == role.ray.placement_group)  # type: ignore[union-attr]
        for actor in actors:
            assert group.bundles[actor.bundle_index][f"rlc_node_n{actor.node}"] == 1.0


def test_colocated_roles_share_their_group_s_nodes() -> None:
    from rlc.schemas.plan import NodeDevices

    plan = cpu_plan()
    plan.cluster.nodes = 2
    train, rollout = plan.roles_of("train")[0], plan.roles_of("rollout")[0]
    train.placement = [NodeDevices(node=0, local_ids=[0]), NodeDevices(node=1, local_ids=[0])]
    rollout.placement = [NodeDevices(node=0, local_ids=[0]), NodeDevices(node=1, local_ids=[0])]
    assert train.ray is not None and rollout.ray is not None
    two = {"bundles": [{"rlc_device": 1.0}] * 2, "bundle_indices": [0], "actor_resources": {"rlc_device": 0.5}}
    shared = train.ray.model_copy(update=two)
    train.ray = shared
    rollout.ray = shared.model_copy(update={"bundle_indices": [0, 1]})
    request = launch_request(plan)
    (group,) = request.placement_groups
    assert [next(k for k in b if k.startswith("rlc_node_n")) for b in group.bundles] == ["rlc_node_n0", "rlc_node_n1"]
    assert [(a.kind, a.node) for a in request.actors] == [("trainer", 0), ("rollout", 0), ("rollout", 1)]


def test_a_single_node_plan_asks_for_no_node() -> None:
    request = launch_request(cpu_plan())
    assert all(not any(k.startswith("rlc_node_n") for k in b) for g in request.placement_groups for b in g.bundles)


def test_relative_paths_are_taken_from_the_driver_s_directory(tmp_path: Path) -> None:
    plan = cpu_plan(model_path="runs/q/model", run_dir="runs/q", build_tiny=False)
    plan.data.builtin, plan.data.train = False, "data/train.jsonl"
    fixed = nodes.absolute_paths(plan, tmp_path)
    assert fixed.model.path == str(tmp_path / "runs/q/model") and fixed.run_dir == str(tmp_path / "runs/q")
    assert fixed.data.train == str(tmp_path / "data/train.jsonl")
    assert plan.model.path == "runs/q/model"  # the caller's plan is left as it was
    assert nodes.absolute_paths(fixed, Path("/elsewhere")).model.path == fixed.model.path
    builtin = cpu_plan()
    assert nodes.absolute_paths(builtin, tmp_path).data.train == builtin.data.train


def _found(**changes: object) -> dict:
    found = {
        "ip": "10.200.0.2",
        "hostname": "n1",
        "missing": [],
        "unshared": [],
        "gloo_ifname": "",
        "gloo_address": "10.200.0.2",
        "interface": "veth1",
    }
    return {**found, **changes}


def test_a_node_missing_an_input_or_the_run_directory_is_named(tmp_path: Path) -> None:
    plan = cpu_plan()
    problems = nodes.node_problems(plan, tmp_path, "n1 (10.200.0.2)", _found(missing=["/m/model"]), True)
    assert problems == [
        "node n1 (10.200.0.2): /m/model does not exist there: copy it to that node (same path) or put it on a "
        "filesystem every node mounts"
    ]
    unshared = nodes.node_problems(plan, tmp_path, "n1 (10.200.0.2)", _found(unshared=["x"]), True)
    assert f"does not see the run directory {tmp_path}" in unshared[0]
    assert nodes.node_problems(plan, tmp_path, "n1", _found(), True) == []


@pytest.mark.parametrize("address", ["127.0.1.1", "127.0.0.1", ""])
def test_a_gloo_group_on_a_loopback_address_is_refused_with_the_interface_to_set(tmp_path: Path, address: str) -> None:
    plan = cpu_plan()
    (problem,) = nodes.node_problems(plan, tmp_path, "n1 (10.200.0.2)", _found(gloo_address=address), True)
    assert "the other nodes cannot reach" in problem and "RLC_SOCKET_IFNAME=veth1" in problem
    chosen = _found(gloo_address=address, gloo_ifname="veth1")
    assert nodes.node_problems(plan, tmp_path, "n1", chosen, True) == []  # an interface is set: gloo binds it


def test_the_probe_reports_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from rlc.runtime import node_probe

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    here = tmp_path / "here"
    here.write_text("")
    found = node_probe.probe_node([str(here), str(tmp_path / "absent")], [str(tmp_path / "unseen")])
    assert found["missing"] == [str(tmp_path / "absent")] and found["unshared"] == [str(tmp_path / "unseen")]
    assert found["gloo_ifname"] == "lo" and found["interface"] == "lo"


def test_check_nodes_stops_before_any_role_with_every_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    cluster = [
        {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.200.0.1", "Resources": {"rlc_node_n0": 1000.0}},
        {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.200.0.2", "Resources": {"rlc_node_n1": 1000.0}},
    ]
    answers = [_found(ip="10.200.0.1"), _found(missing=["/m/model"], gloo_address="127.0.1.1")]

    class Probe:
        def options(self, **kwargs):  # type: ignore[no-untyped-def]
            return self

        def remote(self, paths, shared):  # type: ignore[no-untyped-def]
            assert all(Path(p).exists() for p in shared)  # the driver wrote the marker before asking
            calls.append(1)
            return answers[len(calls) - 1]

    calls: list[int] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: cluster)
    monkeypatch.setattr(ray, "remote", lambda fn: Probe())
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    with pytest.raises(RunError) as caught:
        nodes.check_nodes(cpu_plan(), tmp_path, print)
    text = str(caught.value)
    assert "node n1 (10.200.0.2): /m/model does not exist there" in text
    assert "node n1 (10.200.0.2): gloo would bind 127.0.1.1" in text and "RLC_SOCKET_IFNAME=veth1" in text
    assert "n0 (10.200.0.1)" not in text
    assert list(tmp_path.iterdir()) == []  # the marker is removed


def test_the_run_directory_records_which_node_ran_which_actor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import ray

    plan = cpu_plan()
    plan.cluster.nodes = 2
    plan.roles_of("rollout")[0].placement[0].node = 1
    cluster = [
        {"NodeID": "a", "NodeManagerAddress": "10.200.0.1", "Resources": {"rlc_node_n0": 1000.0}},
        {"NodeID": "b", "NodeManagerAddress": "10.200.0.2", "Resources": {"rlc_node_n1": 1000.0}},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: cluster)
    request = launch_request(plan)
    where = {a.name: ("a" if a.kind == "trainer" else "b") for a in request.actors}
    where[next(a.name for a in request.actors if a.kind == "rollout")] = "a"  # Ray put one elsewhere
    lines: list[str] = []
    nodes.record_nodes(tmp_path, request, where, lines.append)
    record = json.loads((tmp_path / "nodes.json").read_text())
    by_actor = {e["actor"]: e for e in record["actors"]}
    trainer = by_actor["rlc-actor-rank0"]
    assert (trainer["node"], trainer["planned_node"], trainer["address"]) == ("n0", "n0", "10.200.0.1")
    assert lines[0].startswith("actors on nodes: n0 (10.200.0.1): rlc-actor-rank0")
    assert any("runs on n0, the plan gives it n1" in line for line in lines)


def test_the_resume_hint_names_the_launcher_that_submitted_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLC_RESUME_COMMAND", raising=False)
    assert resume_command() == "rlc run PLANDIR --resume"
    monkeypatch.setenv("RLC_RESUME_COMMAND", "/p/plan/launch.sh head --resume")
    assert resume_command() == "/p/plan/launch.sh head --resume"


def test_a_stopped_launch_run_says_how_launch_sh_resumes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from rlc.runtime.launch import RunStopped

    found = (tmp_path / "checkpoints" / "step-000050", types.SimpleNamespace(step=50))
    monkeypatch.setattr("rlc.runtime.checkpoint.latest_checkpoint", lambda run_dir: found)
    monkeypatch.delenv("RLC_RESUME_COMMAND", raising=False)
    assert "continue with `rlc run PLANDIR --resume`" in str(RunStopped(50, 80, "", tmp_path))
    monkeypatch.setenv("RLC_RESUME_COMMAND", "/p/plan/launch.sh head --resume")
    text = str(RunStopped(50, 80, "SIGTERM", tmp_path))
    assert "continue with `/p/plan/launch.sh head --resume`" in text and "rlc run" not in text


def test_a_cluster_without_a_plan_node_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from rlc.runtime import ray_start

    plan = cpu_plan()
    plan.cluster.nodes, plan.cluster.total_devices = 2, 4
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"rlc_device": 4.0, "rlc_node_n0": 1000.0})
    with pytest.raises(RunError, match=r"plan's node n1.*RLC_NODE_RANK=1 launch\.sh worker"):
        ray_start._check_resources(plan)


def test_launch_sh_and_the_runtime_name_node_resources_alike(tmp_path: Path) -> None:
    plan = cpu_plan()
    plan.cluster.nodes, plan.cluster.total_devices = 2, 4
    emit_plan_dir(plan, spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    text = (tmp_path / "plan" / "launch.sh").read_text()
    assert "NODE_RESOURCE_PREFIX=rlc_node_n" in text
    assert os.path.basename(nodes.__file__) == "nodes.py"
