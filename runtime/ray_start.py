"""Ray for a run: the embedded local cluster on one machine, or the cluster launch.sh started, checked for the
resources the plan asks for."""

from __future__ import annotations

import os

from rlc.messages import first_line
from rlc.runtime.errors import RunError, RunUsageError
from rlc.runtime.ray_resources import ray_options
from rlc.schemas.cluster_nodes import NODE_RESOURCE_UNITS, node_resource
from rlc.schemas.plan import Plan


def _check_resources(plan: Plan) -> None:
    """A Ray that cannot hold the plan would leave placement waiting forever: say what is missing instead."""
    import ray

    resource = plan.cluster.ray_resource
    offered = ray.cluster_resources()
    have = offered.get(resource, 0)
    need = plan.cluster.total_devices
    if have < need:
        raise RunError(
            f"the Ray cluster offers {have:g} `{resource}` but the plan needs {need}: start every node with "
            f"`launch.sh` (or `ray start --resources='{{\"{resource}\": N}}'`), or run in a fresh process"
        )
    if plan.cluster.nodes > 1:  # the placement bundles ask for them (`launch_request`)
        missing = [k for k in range(plan.cluster.nodes) if offered.get(node_resource(k), 0) < 1]
        if missing:
            raise RunError(
                f"no node of the Ray cluster is the plan's node {', '.join(f'n{k}' for k in missing)} (it declares "
                f"`{node_resource(missing[0])}`): start each worker with the plan's launch.sh, "
                f"`RLC_NODE_RANK={missing[0]} launch.sh worker` for n{missing[0]}"
            )


#: The embedded local Ray keeps no idle worker processes: the run's actors have workers of their own and its only
#: plain task (the trainer's address probe) runs once, while each idle worker polls its raylet (measured on the
#: quickstart: three idle workers, ~2 ms of CPU each per 0.24 s step, on the same two cores as the actors). Nor does
#: it prestart workers for the driver: two of those started, imported Ray and sat idle for the whole run (~0.8
#: CPU-seconds each at start-up, measured per process on the quickstart); actors start their own on demand. It
#: neither records task events (the state API's task list, which rlc's own trace and metrics replace) nor collects
#: Ray's internal metrics: with both on, its GCS, raylet and dashboard agent took about 3.1 CPU-ms per quickstart
#: step together, without them 1.8-2.0 (measured per process over 240 steps, `max_staleness` 1). A cluster
#: started by `launch.sh` keeps Ray's defaults.
EMBEDDED_RAY_CONFIG = {
    "num_workers_soft_limit": 0,
    "prestart_worker_first_driver": False,
    "enable_worker_prestart": False,
    "task_events_report_interval_ms": 0,
    "enable_metrics_collection": False,
}


def start_ray(plan: Plan, log) -> bool:  # type: ignore[no-untyped-def]
    """Join the cluster when launched as a Ray job; otherwise start an embedded local Ray sized by the plan.

    Returns whether this call started Ray (and so must shut it down).
    """
    import ray

    resource = plan.cluster.ray_resource
    if ray.is_initialized():
        _check_resources(plan)
        return False
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        address = os.environ.get("RAY_ADDRESS", "auto")
        hint = "start it (launch.sh), or unset RAY_ADDRESS to run on a Ray of this machine"
        unreachable = ray_address_unreachable(address)
        if unreachable:  # ray.init would retry for minutes, printing only its own warnings
            raise RunError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {unreachable}; {hint}")
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RunError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {first_line(exc)}; {hint}") from None
        _check_resources(plan)
        return False
    # One machine's Ray would claim every node's accelerators and run on this one. On cpu the nodes and devices
    # are logical (the embedded default), so a multi-node cpu plan runs here as its placement groups say.
    if plan.cluster.nodes > 1 and plan.platform != "cpu":
        raise RunUsageError(
            f"plan {plan.name} spans {plan.cluster.nodes} nodes, and no Ray cluster was given (RAY_ADDRESS): start "
            "the nodes with the plan's launch.sh (`launch.sh head` here, `launch.sh worker` on the others), which "
            "submits the run"
        )
    devices = plan.cluster.total_devices
    cpus = max(os.cpu_count() or 1, devices + 2)
    # A cpu plan of several logical nodes runs here: this one Ray stands for all of them.
    nodes = {node_resource(k): NODE_RESOURCE_UNITS for k in range(plan.cluster.nodes)} if plan.cluster.nodes > 1 else {}
    log(f"starting a local Ray with {devices} logical `{resource}` device(s)")
    # "local": a new instance even where `ray start` left a cluster on this machine (Ray would otherwise join
    # the one named in its temp dir's ray_current_cluster and then refuse the sizes given here).
    ray.init(
        **ray_options(
            {
                "address": "local",
                "num_cpus": cpus,
                "resources": {resource: devices, **nodes},
                "include_dashboard": False,
                "log_to_driver": False,
                "runtime_env": {"env_vars": dict(plan.env)},
                "_system_config": EMBEDDED_RAY_CONFIG,
            }
        )
    )
    return True


#: How long a cluster's GCS port may take to accept a connection before the run says it is unreachable.
RAY_CONNECT_TIMEOUT_S = 10.0


def ray_address_unreachable(address: str) -> str:
    """Why a `host:port` Ray address does not accept connections (empty when it does, or is not host:port)."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return ""
    try:
        with socket.create_connection((host, int(port)), timeout=RAY_CONNECT_TIMEOUT_S):
            return ""
    except OSError as exc:
        return f"nothing answers on {host}:{port} within {RAY_CONNECT_TIMEOUT_S:g} s ({exc.strerror or exc})"
