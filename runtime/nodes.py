"""The nodes of a cluster run: checked before any role starts, and which actor ran where, recorded.

On one machine every path the driver sees, every actor sees. On several, each node resolves a path on its own
filesystem and binds collective sockets on its own interfaces, so `rlc run` asks every node (a Ray task pinned to
it) whether it has the plan's inputs, sees the run directory the driver writes, and whether gloo would bind an
address the other nodes can reach, and stops with one message naming the node and what to do. Once the roles run,
`RUN/nodes.json` says which node ran which actor, next to the node the plan gave it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from pathlib import Path
from typing import Any

from rlc.runtime.errors import RunError
from rlc.runtime.launch_request import LaunchRequest
from rlc.schemas.cluster_nodes import NODE_RESOURCE_PREFIX
from rlc.schemas.plan import Plan

__all__ = ["NODE_CHECK_TIMEOUT_S", "absolute_paths", "check_nodes", "input_paths", "record_nodes"]

#: Seconds every node has to answer the check (a Ray task on an idle node answers in about a second).
NODE_CHECK_TIMEOUT_S = 120.0


def absolute_paths(plan: Plan, base: Path | None = None) -> Plan:
    """The plan with its relative input paths (model, data file, teachers) taken from `base` (default: this
    process's working directory), so that every node reads the same path rather than its own relative one."""
    root = Path(base or os.getcwd())

    def absolute(path: str | None) -> str | None:
        return path if not path or os.path.isabs(path) else str(root / path)

    plan = plan.model_copy(deep=True)
    plan.model.path = absolute(plan.model.path)
    if not plan.data.builtin:
        plan.data.train = absolute(plan.data.train) or plan.data.train
    for teacher in plan.distill.teachers if plan.distill else []:
        teacher.model.path = absolute(teacher.model.path)
    plan.run_dir = absolute(plan.run_dir) or plan.run_dir
    return plan


def input_paths(plan: Plan) -> list[str]:
    """What every node's roles read: the model, the teachers, the data file."""
    paths = [plan.model.path, *(t.model.path for t in (plan.distill.teachers if plan.distill else []))]
    if not plan.data.builtin:
        paths.append(plan.data.train)
    return list(dict.fromkeys(p for p in paths if p))


def plan_node(resources: dict[str, float]) -> str:
    """`n1` for a node that declares `rlc_node_n1` (what launch.sh sets), else empty."""
    return next(
        (k.removeprefix(NODE_RESOURCE_PREFIX) for k in sorted(resources) if k.startswith(NODE_RESOURCE_PREFIX)), ""
    )


def _label(node: dict[str, Any]) -> str:
    name = plan_node(node.get("Resources", {}))
    ip = node.get("NodeManagerAddress", "?")
    return f"n{name} ({ip})" if name else ip


def node_problems(plan: Plan, run_dir: Path, label: str, found: dict[str, Any], several: bool) -> list[str]:
    """What keeps one node (as its probe found it) from taking part in the run."""
    problems = [
        f"node {label}: {path} does not exist there: copy it to that node (same path) or put it on a filesystem "
        "every node mounts"
        for path in found["missing"]
    ]
    if found["unshared"]:
        problems.append(
            f"node {label} does not see the run directory {run_dir} (a file written there on the driver's node is "
            "missing on it): every trainer rank writes its part of each checkpoint there, so it must be on a "
            "filesystem every node mounts at the same path"
        )
    address = found["gloo_address"]
    if several and plan.platform == "cpu" and not found["gloo_ifname"] and _unreachable(address):
        interface = found["interface"] or "<the interface of " + found["ip"] + ">"
        problems.append(
            f"node {label}: gloo would bind {address or 'no address'} (what its host name {found['hostname']!r} "
            f"resolves to), which the other nodes cannot reach: start every node with RLC_SOCKET_IFNAME set to the "
            f"interface towards the others (on this node {interface}), e.g. `RLC_SOCKET_IFNAME={interface} "
            "launch.sh worker`"
        )
    return problems


def _unreachable(address: str) -> bool:
    try:
        return not address or ipaddress.ip_address(address).is_loopback
    except ValueError:
        return True


def check_nodes(plan: Plan, run_dir: Path, log) -> None:  # type: ignore[no-untyped-def]
    """Ask every alive node of a cluster of several whether it can run its part (see the module's docstring);
    RunError naming each node and problem otherwise. A cluster of one node is not asked."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlc.runtime.node_probe import probe_node

    if not ray.is_initialized():
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    marker = run_dir / f".node-check-{secrets.token_hex(6)}"
    marker.write_text("written by the driver; each node must see it\n")
    try:
        probe = ray.remote(probe_node)
        refs = [
            probe.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(input_paths(plan), [str(marker)])
            for n in nodes
        ]
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=NODE_CHECK_TIMEOUT_S)
        if waiting:
            late = [_label(n) for n, ref in zip(nodes, refs, strict=True) if ref in waiting]
            raise RunError(f"node(s) {', '.join(late)} did not answer within {NODE_CHECK_TIMEOUT_S:g} s of being asked")
        answers = ray.get(refs)
    finally:
        marker.unlink(missing_ok=True)
    problems = [
        p for n, a in zip(nodes, answers, strict=True) for p in node_problems(plan, run_dir, _label(n), a, True)
    ]
    if problems:
        raise RunError("the cluster's nodes cannot run this plan as they are:\n  - " + "\n  - ".join(problems))
    log(f"every node ({', '.join(_label(n) for n in nodes)}) has the plan's inputs and sees the run directory")


def record_nodes(run_dir: Path, request: LaunchRequest, where: dict[str, str], log) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """RUN/nodes.json: each actor's Ray node (id, address, plan node) next to the node the plan gives it, and
    one log line per node; `where` maps an actor's name to its Ray node id."""
    import ray

    by_id = {n["NodeID"]: n for n in ray.nodes()}
    actors = []
    for actor in request.actors:
        if actor.name not in where:
            continue
        node = by_id.get(where[actor.name], {})
        ran = plan_node(node.get("Resources", {}))
        actors.append(
            {
                "actor": actor.name,
                "role": actor.role,
                "ray_node_id": where[actor.name],
                "address": node.get("NodeManagerAddress", ""),
                "node": f"n{ran}" if ran else "",
                "planned_node": f"n{actor.node}" if actor.node >= 0 else "",
            }
        )
    record = {"actors": actors}
    path = run_dir / "nodes.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    groups: dict[str, list[str]] = {}
    for entry in actors:
        label = f"{entry['node'] or 'node'} ({entry['address']})"
        groups.setdefault(label, []).append(entry["actor"])
    log("actors on nodes: " + "; ".join(f"{label}: {', '.join(names)}" for label, names in sorted(groups.items())))
    moved = [e for e in actors if e["node"] and e["planned_node"] and e["node"] != e["planned_node"]]
    for entry in moved:
        log(f"warning: {entry['actor']} runs on {entry['node']}, the plan gives it {entry['planned_node']}")
    return record
