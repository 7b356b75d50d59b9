"""Ray placement of the plan's roles: which devices of which node each bundle holds."""

from __future__ import annotations

from rlc.compiler import search
from rlc.compiler.memory import RolloutLayout
from rlc.compiler.resolve import Problem
from rlc.compiler.rounding import r4
from rlc.schemas.plan import NodeDevices, RayPlacement


def placement_ids(start: int, count: int, dpn: int) -> list[NodeDevices]:
    """Global device range [start, start+count) as local ids per node."""
    by_node: dict[int, list[int]] = {}
    for g in range(start, start + count):
        by_node.setdefault(g // dpn, []).append(g % dpn)
    return [NodeDevices(node=n, local_ids=ids) for n, ids in sorted(by_node.items())]


def ray_placements(problem: Problem, best: search.Candidate) -> dict[str, RayPlacement]:
    """Each role's placement group, bundles and per-actor resource shares, by role name.

    Disaggregated: one group per role; a trainer device is one bundle, an engine (or teacher engine) one bundle
    of its TP/EP devices. Colocated: one group of device bundles shared by every role; each role's actor takes
    an equal share of a device (the trainer's share is halved again when a separate KL reference rank sits
    beside it), and engine i is anchored on the bundle of its first device.

    An engine wider than a node cannot be one bundle (a bundle lives on one node), nor one process binding its
    devices: it runs vLLM's Ray executor, one worker per device bundle (`_across_nodes`), or, with attention data
    parallelism over whole nodes, an actor per node driving that node's engine cores (`_cores_across_nodes`).
    """
    res = problem.target.ray_resource
    colocated = best.mode == "colocated"
    tl, rl = best.train.layout, best.rollout.layout
    reference = problem.spec.algorithm.needs_reference and problem.spec.lora is None
    engines = [("rollout", rl)] + [(f"teacher-{t.name}", t.layout) for t in best.teachers]
    out: dict[str, RayPlacement] = {}
    if colocated:
        bundles = [{res: 1.0}] * tl.world_size
        share = r4(1.0 / len(["actor", *engines]))
        trainer = r4(share / 2) if reference else share
        out["actor"] = RayPlacement(
            placement_group="rlc-colocated",
            bundles=bundles,
            bundle_indices=list(range(tl.world_size)),
            actor_resources={res: trainer},
            reference_resources={res: trainer} if reference else None,
        )
        for name, lay in engines:
            firsts = [i * lay.engine_devices for i in range(lay.replicas)]
            if lay.cores_per_node(problem.devices_per_node):
                out[name] = _cores_across_nodes(
                    "rlc-colocated", bundles, 1, lay, problem.devices_per_node, {res: share}
                )
            elif lay.engine_devices > problem.devices_per_node:
                out[name] = _across_nodes("rlc-colocated", bundles, lay, {res: share})
            else:
                out[name] = RayPlacement(
                    placement_group="rlc-colocated",
                    bundles=bundles,
                    bundle_indices=firsts,
                    actor_resources={res: share},
                )
        return out
    out["actor"] = RayPlacement(
        placement_group="rlc-actor",
        bundles=[{res: 1.0}] * tl.world_size,
        bundle_indices=list(range(tl.world_size)),
        actor_resources={res: 0.5 if reference else 1.0},
        reference_resources={res: 0.5} if reference else None,
    )
    for name, lay in engines:
        dpn = problem.devices_per_node
        if lay.cores_per_node(dpn):
            # A bundle per node of each engine: the node's cores' devices, all taken by the actor there.
            node_bundles = [{res: float(dpn)}] * (lay.devices // dpn)
            out[name] = _cores_across_nodes(f"rlc-{name}", node_bundles, dpn, lay, dpn, {res: float(dpn)})
            continue
        if lay.engine_devices > problem.devices_per_node:
            out[name] = _across_nodes(f"rlc-{name}", [{res: 1.0}] * lay.devices, lay, {res: 1.0})
            continue
        width = float(lay.engine_devices)
        out[name] = RayPlacement(
            placement_group=f"rlc-{name}",
            bundles=[{res: width}] * lay.replicas,
            bundle_indices=list(range(lay.replicas)),
            actor_resources={res: width},
        )
    return out


def _across_nodes(
    group: str, bundles: list[dict[str, float]], lay: RolloutLayout, worker: dict[str, float]
) -> RayPlacement:
    """Engines wider than a node: device bundles, engine i's workers on bundles [i*w, (i+1)*w) (w its devices),
    each taking `worker` of its bundle; the engine's actor sits on its first bundle holding nothing (it drives no
    device: vLLM's Ray executor starts the workers, the way verl and OpenRLHF start a multi-node engine)."""
    width = lay.engine_devices
    return RayPlacement(
        placement_group=group,
        bundles=bundles,
        bundle_indices=[i * width for i in range(lay.replicas)],
        actor_resources={},
        engine_workers=[list(range(i * width, (i + 1) * width)) for i in range(lay.replicas)],
        worker_resources=worker,
    )


def _cores_across_nodes(
    group: str, bundles: list[dict[str, float]], per_bundle: int, lay: RolloutLayout, dpn: int, taken: dict[str, float]
) -> RayPlacement:
    """Engines whose attention data parallelism spans whole nodes, as vLLM runs them: the engine's actor on its first
    node is the front end and drives that node's engine cores; on each further node a core host (`engine_hosts`)
    drives that node's cores, which join the front end over vLLM's data-parallel RPC. Every one of these actors
    takes `taken` of the first bundle of its node's devices, and binds the node's devices like any engine actor.
    `bundles` holds a bundle of `per_bundle` devices: one (colocated) or a node's (disaggregated)."""
    nodes = lay.engine_devices // dpn
    first = [(i * lay.engine_devices + k * dpn) // per_bundle for i in range(lay.replicas) for k in range(nodes)]
    return RayPlacement(
        placement_group=group,
        bundles=bundles,
        bundle_indices=first[::nodes],
        actor_resources=taken,
        engine_hosts=[first[i * nodes + 1 : (i + 1) * nodes] for i in range(lay.replicas)],
    )
