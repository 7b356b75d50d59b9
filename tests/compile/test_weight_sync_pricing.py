"""Weight sync per method: the pricing formulas on hand-checked cases, the published anchors they come from, the
pick (fastest executable, simplest on a tie), and what the plan, SUMMARY.md and `rlc explain` say about it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlc.compiler import candidates, cost, memory
from rlc.compiler.cost import weight_sync as ws
from rlc.compiler.emit import render_summary
from rlc.compiler.explain import explain_json
from rlc.compiler.memory import RolloutLayout, dtype_bytes
from rlc.compiler.pipeline import compile_text
from rlc.schemas.plan import Plan
from rlc.schemas.registry import load_arch, load_target

A2, A3, H100, CPU = (load_target(t) for t in ("a2", "a3", "h100", "cpu"))
QWEN8 = memory.model_sizes(load_arch("qwen3-8b"))
MOE30 = memory.model_sizes(load_arch("qwen3-30b-a3b"))
EVERYTHING = frozenset({"broadcast", "disk", "inplace", "shared_memory", "senders", "tp_slicing"})
GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def _shape(**kw):  # type: ignore[no-untyped-def]
    base = dict(
        mode="disaggregated",
        trainer_ranks=8,
        trainer_nodes=1,
        cross_node=True,
        devices_per_node=8,
        engine=RolloutLayout(8, tp=2),
    )
    base.update(kw)
    return cost.SyncShape(**base)


def test_broadcast_terms_by_hand() -> None:
    """Qwen3-8B on A2: 8 trainer ranks on node 0 send to four TP-2 engines on node 1."""
    shape = _shape()
    v = QWEN8.total * 2  # bf16
    share = 0.21  # WEIGHT_SYNC_LINK_SHARE["npu"]
    buckets = v / (256 << 20)
    gather = buckets * 30e-6 + v / (392e9 * 0.4)  # all-gather in the node, A2's collective efficiency 0.4
    shard = v * cost.engine_weight_share(QWEN8, shape.engine)
    tensors = (36 * 11 + 3) * 2.1e-3  # 36 layers of 11 tensors, embedding, norm, head; TENSOR_LOAD_S["npu"]
    assert ws.worker_tensors(QWEN8, shape.engine) == 36 * 11 + 3
    reload = shard / 20e9 + tensors
    one = v / (share * 25e9) + buckets * 30e-6  # one sender's scale-out link paces the move
    # The gather streams under the send (the runtime gathers the next bucket while sending the last).
    assert ws.sync_seconds(QWEN8, A2, shape, "broadcast") == pytest.approx(max(gather, one) + reload + 1.0)
    serial = replace(shape, streamed=False)  # LoRA merged or pipeline stages: gather first, then send
    assert ws.sync_seconds(QWEN8, A2, serial, "broadcast") == pytest.approx(gather + one + reload + 1.0)
    # Four senders: four links leave node 0 at once; the engines' node takes the bytes in through its 8 NICs.
    four = max(v / (4 * share * 25e9) + buckets / 4 * 30e-6, v / (share * 392e9), v / (share * 25e9 * 8))
    assert ws.sync_seconds(QWEN8, A2, serial, "broadcast", 4) == pytest.approx(gather + four + reload + 1.0)
    # TP slices: each worker takes in its half of the dense weights (all of Qwen3-8B but nothing routed).
    half = v - (QWEN8.dense + QWEN8.embedding + QWEN8.head) * 2 / 2
    assert ws.worker_bytes(QWEN8, A2, shape.engine, "tp") == pytest.approx(half)
    assert half == pytest.approx(v / 2, rel=0.01)


def test_one_sender_against_all_senders_is_verl_7167() -> None:
    """verl issue 7167: ~25 GB/s from one sender's NIC, ~90 GB/s with four senders on a node of four NICs."""
    gh200 = H100.model_copy(update={"inter_node_bandwidth_gbps": 25.0, "intra_node_bandwidth_gbps": 450.0})
    shape = _shape(engine=RolloutLayout(4, tp=4), devices_per_node=4, trainer_ranks=4)

    def rate(k: int) -> float:
        terms = dict(ws._terms(QWEN8, gh200, shape, "broadcast", k, "full"))
        return QWEN8.total * 2 / terms["send"] / 1e9

    assert rate(1) == pytest.approx(22.5, rel=0.05)  # 0.9 × 25 GB/s
    assert rate(4) == pytest.approx(90, rel=0.05)  # 0.9 × 4 × 25 GB/s


def test_hccl_anchor_verl_checkpoint_engine() -> None:
    """verl's checkpoint-engine benchmark: Qwen3-30B-A3B from a 4-rank FSDP trainer to 30 receivers on 2 × 16
    A3 dies in ~11 s (5.3 GB/s), the engines' own load not included."""
    shape = _shape(trainer_ranks=4, devices_per_node=16, engine=RolloutLayout(30, tp=1))
    terms = dict(ws._terms(MOE30, A3, shape, "broadcast", 1, "full"))
    assert terms["gather"] + terms["send"] == pytest.approx(11.0, rel=0.15)


def test_vime_anchors() -> None:
    """vime (vLLM + vllm-ascend): full updates from disk on 8 trainer + 4 rollout NPUs at vLLM TP 4, 56.6 s for
    Qwen3-30B-A3B and 5.4 s for Qwen3-4B; a full HCCL update of Qwen3-30B-A3B on 4 + 4 NPUs of one host, 43.5 s."""
    shape = _shape(trainer_ranks=8, devices_per_node=16, cross_node=False, engine=RolloutLayout(4, tp=4))
    assert ws.sync_seconds(MOE30, A3, shape, "disk") == pytest.approx(56.6, rel=0.1)
    qwen4 = memory.model_sizes(load_arch("qwen3-4b"))
    assert ws.sync_seconds(qwen4, A3, shape, "disk") == pytest.approx(5.4, rel=0.2)
    one_host = _shape(trainer_ranks=4, devices_per_node=16, cross_node=False, engine=RolloutLayout(4, tp=4))
    assert ws.sync_seconds(MOE30, A3, one_host, "broadcast") == pytest.approx(43.5, rel=0.1)
    # Its ~19,000 tensors, not its bytes, make it slow: a dense model of as many bytes syncs in a few seconds.
    dense = memory.model_sizes(load_arch("qwen3-32b"))
    assert ws.sync_seconds(dense, A3, one_host, "broadcast") < 10


def test_colocated_host_paths() -> None:
    """inplace: each node's writer stages the whole model in /dev/shm and each worker copies its shard back;
    shared_memory: the same write, no file to read back; on accelerators at WEIGHT_SYNC_HOST_SHARE of the
    host copy rate."""
    shape = _shape(mode="colocated", cross_node=False, engine=RolloutLayout(8, tp=4))
    v = QWEN8.total * 2
    shard = v * cost.engine_weight_share(QWEN8, shape.engine)
    host = 0.28 * 25e9
    inplace = dict(ws._terms(QWEN8, A2, shape, "inplace", 1, "full"))
    assert inplace["host write"] == pytest.approx(v / host)
    assert inplace["host read"] == pytest.approx(shard / host)
    cpu = _shape(mode="colocated", cross_node=False, devices_per_node=2, trainer_ranks=2, engine=RolloutLayout(2))
    tiny = memory.model_sizes(load_arch("rlc-tiny"))
    a = ws.sync_seconds(tiny, CPU, cpu, "inplace")
    b = ws.sync_seconds(tiny, CPU, cpu, "shared_memory")
    tshard = tiny.total * dtype_bytes(CPU) * cost.engine_weight_share(tiny, cpu.engine)
    assert a - b == pytest.approx(tshard / (CPU.host_to_device_bandwidth_gbps * 1e9))


def test_slicing_only_what_the_runtime_cuts() -> None:
    """TP slices cut the parts the runtime cuts for the model's class; routed experts stay whole on an engine
    with EP or attention DP, and a class the runtime does not cut is not offered TP slices at all."""
    tp4 = RolloutLayout(8, tp=4)
    full = MOE30.total * 2
    dense = (MOE30.dense + MOE30.embedding + MOE30.head) * 2
    experts = MOE30.expert * 2
    assert ws.worker_bytes(MOE30, A3, tp4, "tp", frozenset({"dense"})) == pytest.approx(full - dense * 3 / 4)
    both = frozenset({"dense", "experts"})
    assert ws.worker_bytes(MOE30, A3, tp4, "tp", both) == pytest.approx(full - (dense + experts) * 3 / 4)
    ep = RolloutLayout(8, tp=2, ep=8)  # attention DP 4: experts arrive whole
    assert ws.worker_bytes(MOE30, A3, ep, "tp", both) == pytest.approx(full - dense / 2)
    shape = _shape(devices_per_node=16, engine=tp4)
    options = ws.priced_options(MOE30, A3, shape, requested="auto", executable=EVERYTHING, sliced=frozenset())
    assert {o.slicing for o in options} == {"full"}


def test_pick_fastest_executable_simplest_on_a_tie() -> None:
    shape = _shape()
    now = ws.priced_options(QWEN8, A2, shape, requested="auto", executable=frozenset({"broadcast", "disk"}))
    chosen = ws.pick(now)
    assert (chosen.method, chosen.senders, chosen.slicing) == ("broadcast", 1, "full")
    faster = [o for o in now if o.seconds < chosen.seconds and not o.eligible]
    assert faster and all("senders" in o.why_not or "disk" in o.why_not for o in faster)
    wide = ws.pick(ws.priced_options(QWEN8, A2, shape, requested="auto", executable=EVERYTHING))
    assert wide.senders > 1 and wide.seconds < chosen.seconds / 1.5
    # Options within SYNC_TIE of the fastest: the fewest senders, whole tensors.
    near = [o for o in ws.priced_options(QWEN8, A2, shape, requested="auto", executable=EVERYTHING) if o.eligible]
    best = min(o.seconds for o in near)
    assert wide.complexity() == min(o.complexity() for o in near if o.seconds <= best * (1 + ws.SYNC_TIE))
    disk = ws.pick(ws.priced_options(QWEN8, A2, shape, requested="disk", executable=EVERYTHING))
    assert disk.method == "disk"


def test_senders_bounded_by_engine_memory() -> None:
    """Each sender's group costs every engine worker sync_group_gib; they must fit beside vLLM's share."""
    room = A3.usable_hbm_gib * (1 - 0.9) - A3.reserve_gib
    shape = _shape(trainer_ranks=64, engine=RolloutLayout(16, tp=2, memory_fraction=0.9))
    assert ws.max_senders(A3, shape) == 1 + int(room / A3.sync_group_gib)
    assert ws.max_senders(A3, _shape(trainer_ranks=2, engine=RolloutLayout(16, tp=2))) == 2


def _plan(text: str, target: str | None = None) -> Plan:
    compiled = compile_text(text, "spec.yaml", target=target)
    assert compiled.plan is not None, [d.message for d in compiled.report.diagnostics]
    return compiled.plan


A2_SPEC = (
    "name: s\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\nmode: disaggregated\n"
    "data: {train: arithmetic}\n"
)
CPU_COLOCATED = (
    "name: c\ntarget: cpu\nmodel: {name: rlc-tiny}\nmode: colocated\ndata: {train: arithmetic}\n"
    "rollout: {max_prompt_len: 16, max_response_len: 8}\n"
)


def test_plans_state_method_estimate_and_runner_up(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(A2_SPEC)
    s = plan.schedule
    assert (s.weight_sync, s.weight_sync_slicing) == ("broadcast", "full") and s.weight_sync_senders > 1
    assert plan.estimates.weight_sync_bytes_per_worker == round(QWEN8.total * 2)
    chosen = [o for o in s.weight_sync_options if o.verdict == "chosen"]
    assert len(chosen) == 1 and chosen[0].seconds == pytest.approx(plan.estimates.weight_sync_s, abs=1e-3)
    assert f"broadcast from {s.weight_sync_senders} trainer ranks" in s.weight_sync_note
    assert "runner-up" in s.weight_sync_note
    # A runtime without several senders: the same spec sends from rank 0, and the plan says what it misses.
    monkeypatch.setattr(candidates, "WEIGHT_SYNC_EXECUTABLE", frozenset({"broadcast", "disk", "inplace"}))
    narrow = _plan(A2_SPEC)
    assert narrow.schedule.weight_sync_senders == 1
    assert "does not execute senders" in narrow.schedule.weight_sync_note
    assert narrow.estimates.weight_sync_s > plan.estimates.weight_sync_s


def test_cpu_colocated_picks_shared_memory_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _plan(CPU_COLOCATED).schedule.weight_sync == "shared_memory"
    monkeypatch.setattr(candidates, "WEIGHT_SYNC_EXECUTABLE", frozenset({"broadcast", "disk", "inplace"}))
    plan = _plan(CPU_COLOCATED)
    assert plan.schedule.weight_sync == "inplace"
    assert any(o.method == "shared_memory" and not o.runs for o in plan.schedule.weight_sync_options)


def test_colocated_accelerator_note_names_the_host_path() -> None:
    plan = _plan("name: c\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\nmode: colocated\ndata: {train: arithmetic}\n")
    assert plan.schedule.weight_sync == "inplace"
    assert "host memory until rlc maps" in plan.schedule.weight_sync_note
    assert "shared_memory" not in {o.method for o in plan.schedule.weight_sync_options}


def test_summary_and_explain_state_the_method() -> None:
    plan = _plan(A2_SPEC)
    text = render_summary(plan, plan_hash="0" * 64)
    k = plan.schedule.weight_sync_senders
    assert "## Weight sync" in text and f"broadcast ({k} senders)" in text and "| chosen |" in text
    assert f"weight sync: broadcast ({k} sender(s), whole tensors)" in text
    payload = json.loads(explain_json(plan))
    assert payload["weight_sync"]["method"] == "broadcast" and payload["weight_sync"]["options"]


def test_plans_before_the_weight_sync_fields_load() -> None:
    """Plans written before senders, slicing, the note and the options existed read their old meaning."""
    data = json.loads((GOLDEN / "a2-disaggregated" / "plan" / "plan.json").read_text())
    for key in ("weight_sync_senders", "weight_sync_slicing", "weight_sync_note", "weight_sync_options"):
        data["schedule"].pop(key, None)
    data["estimates"].pop("weight_sync_bytes_per_worker", None)
    plan = Plan.model_validate(data)
    assert (plan.schedule.weight_sync_senders, plan.schedule.weight_sync_slicing) == (1, "full")
    assert plan.estimates.weight_sync_bytes_per_worker == 0
    assert "## Weight sync" not in render_summary(plan, plan_hash="0" * 64)


def test_search_bounds_stay_below_the_priced_sync() -> None:
    """The allocation's lower bounds (no engines yet, every trainer rank sending) never exceed a layout's sync."""
    for target, sizes in ((A2, QWEN8), (A3, MOE30), (CPU, memory.model_sizes(load_arch("rlc-tiny")))):
        for mode in ("disaggregated", "colocated"):
            shape = _shape(mode=mode, devices_per_node=target.devices_per_node, cross_node=mode == "colocated")
            bound = min(
                o.seconds
                for o in ws.priced_options(
                    sizes, target, replace(shape, engine=None), requested="auto", executable=EVERYTHING
                )
                if o.eligible
            )
            real = ws.pick(ws.priced_options(sizes, target, shape, requested="auto", executable=EVERYTHING))
            assert bound <= real.seconds + 1e-12


def test_calibrate_fits_the_link_figure_of_the_method_that_ran(tmp_path: Path) -> None:
    """Broadcast runs' measured time/weight_sync_s fit the broadcast's link share (two models of different sizes
    tell it from the fixed cost per sync) and leave the host path's and disk's figures to the kind's defaults."""
    from run_dir_fixtures import write_run_dir

    from rlc.compiler import calibrate

    truth = CPU.model_copy(update={"efficiency": CPU.efficiency.model_copy(update={"weight_sync_link_share": 0.02})})
    runs, plans = [], []
    for model in ("rlc-tiny", "rlc-tiny-moe"):
        plan = _plan(
            f"name: {model}\ntarget: cpu\nmodel: {{name: {model}}}\nmode: disaggregated\ndata: {{train: arithmetic}}\n"
            "algorithm: {max_staleness: 0, steps: 20}\nrollout: {max_prompt_len: 16, max_response_len: 8}\n"
        )
        assert plan.schedule.weight_sync == "broadcast"
        work = calibrate.run_workload(plan, 6.0, 4.0)
        times = calibrate.predict(plan, truth, work)
        tokens = 10.0 * plan.schedule.batch_samples
        run = write_run_dir(tmp_path / model, plan, times, tokens, 30, **{"response_len/mean": 4.0})
        runs.append(calibrate.load_run(run))
        plans.append((plan, work, times["sync"]))
    fitted = calibrate.calibrate(CPU, runs)
    share = fitted.efficiency.weight_sync_link_share
    assert share is not None and share < ws.WEIGHT_SYNC_LINK_SHARE["cpu"] * 0.8
    assert fitted.efficiency.weight_sync_host_share is None and fitted.efficiency.weight_sync_disk_gbps is None
    for plan, work, measured in plans:
        assert calibrate.predict(plan, fitted, work)["sync"] == pytest.approx(measured, rel=0.1)
