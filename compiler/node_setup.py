"""What every node of a plan's cluster must look like before `rlc run`: environment, Ray resources, ports.

`launch.sh` (bare-metal `ray start`) and `rayjob.yaml` (KubeRay) describe the same cluster, so both are
rendered from this one description instead of each deriving its own. Values come from the plan; the target
profile only supplies how devices are addressed (Ray resource name, visible-devices variable).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from rlc.schemas.plan import Plan
from rlc.schemas.registry import load_target
from rlc.schemas.target import TargetProfile

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Explicit Ray ports: Ascend clusters are often firewalled, so nothing is left to Ray's random choice.
RAY_PORTS: dict[str, int] = {
    "port": 6379,
    "dashboard-port": 8265,
    "ray-client-server-port": 10001,
    "node-manager-port": 6380,
    "object-manager-port": 6381,
    "runtime-env-agent-port": 6382,
    "dashboard-agent-grpc-port": 6383,
    "dashboard-agent-listen-port": 52365,
    "metrics-export-port": 6384,
    "min-worker-port": 10002,
    "max-worker-port": 19999,
}

#: On a cluster of several nodes, node k declares `rlc_node_n<k>` (NODE_RESOURCE_UNITS of it) and every placement
#: bundle of the plan's node k asks for one unit, so Ray puts each role on the node the plan gives it.
NODE_RESOURCE_PREFIX = "rlc_node_n"
NODE_RESOURCE_UNITS = 1000


def node_resource(node: int) -> str:
    """The custom Ray resource that marks plan node `node` (`rlc_node_n1`)."""
    return f"{NODE_RESOURCE_PREFIX}{node}"


#: Each role gets its own block of ports for its process groups (torch.distributed rendezvous, weight sync).
ROLE_PORT_BASE = 29500
ROLE_PORT_SPAN = 100

#: Kubernetes extended resource a device is requested by, per target kind.
K8S_DEVICE_RESOURCE = {"npu": "huawei.com/Ascend910", "gpu": "nvidia.com/gpu"}


class PlanEmitError(ValueError):
    """The plan cannot be rendered safely (an environment name that is not a shell identifier, ...)."""


@dataclass
class NodeSetup:
    """The per-node facts both launchers need."""

    kind: str
    nodes: int
    devices_per_node: int
    total_devices: int
    ray_resource: str
    env: dict[str, str]
    role_ports: dict[str, tuple[int, int]]
    role_env_conflicts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def uses_num_gpus(self) -> bool:
        """Ray refuses `GPU` inside --resources; GPUs are declared with --num-gpus."""
        return self.ray_resource == "GPU"

    @property
    def resources_json(self) -> str:
        """The `--resources` value for one node, e.g. {"NPU": 16}."""
        return json.dumps({self.ray_resource: self.devices_per_node}, sort_keys=True)


def role_env_var(role: str) -> str:
    """`teacher-math` → `RLC_PORT_RANGE_TEACHER_MATH`."""
    return "RLC_PORT_RANGE_" + re.sub(r"[^A-Za-z0-9]", "_", role).upper()


def role_port_ranges(plan: Plan) -> dict[str, tuple[int, int]]:
    """Disjoint inclusive port ranges per role, in plan order, so no two roles race for a rendezvous port."""
    return {
        role.name: (ROLE_PORT_BASE + i * ROLE_PORT_SPAN, ROLE_PORT_BASE + (i + 1) * ROLE_PORT_SPAN - 1)
        for i, role in enumerate(plan.roles)
    }


def _check_env(env: dict[str, str], where: str) -> None:
    bad = sorted(k for k in env if not ENV_NAME.match(k))
    if bad:
        raise PlanEmitError(f"{where}: environment names must be shell identifiers, got {', '.join(map(repr, bad))}")


def node_setup(plan: Plan, target: TargetProfile | None = None) -> NodeSetup:
    """Merge the environment every process sees and size the Ray resources of each node.

    plan.env is authoritative (the planner starts it from the target's defaults and may drop or change
    entries), so the target's own env is not consulted. Added: the visible-devices mask covering every device
    of a node (plan device ids are physical ids) and, on NPUs, Ray's opt-out from rewriting that mask: each
    actor binds the devices the plan gives it (`runtime/launch_request.py`, `ActorRequest.device_env`). Role
    env entries on which every role that sets them agrees are exported too; entries that differ between roles
    are left to the runtime, which sets them per actor, and are listed in `role_env_conflicts`.
    """
    target = target or load_target(plan.target)
    env: dict[str, str] = {}
    if plan.target_kind == "npu":
        env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] = "1"
    if target.visible_devices_env:
        env[target.visible_devices_env] = ",".join(str(i) for i in range(plan.cluster.devices_per_node))
    _check_env(plan.env, "plan.env")
    env.update(plan.env)
    by_key: dict[str, dict[str, list[str]]] = {}
    for role in plan.roles:
        _check_env(role.env, f"roles.{role.name}.env")
        for key, value in role.env.items():
            by_key.setdefault(key, {}).setdefault(value, []).append(role.name)
    conflicts: dict[str, list[str]] = {}
    for key, values in sorted(by_key.items()):
        if len(values) == 1:
            env[key] = next(iter(values))
        else:
            conflicts[key] = sorted(name for names in values.values() for name in names)
    ports = role_port_ranges(plan)
    for name, (low, high) in ports.items():
        env[role_env_var(name)] = f"{low}-{high}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return NodeSetup(
        kind=plan.target_kind,
        nodes=plan.cluster.nodes,
        devices_per_node=plan.cluster.devices_per_node,
        total_devices=plan.cluster.total_devices,
        ray_resource=target.ray_resource,
        env=dict(sorted(env.items())),
        role_ports=ports,
        role_env_conflicts=conflicts,
    )
