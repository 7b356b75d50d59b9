"""MoE routing replay in the spec, the plan and `rlc explain`: `train.routing_replay` resolves to rollout (R3)
where the target's engines record their experts, the rollout role names who records them (and turns the engine
arguments that capture needs on), the routing's bytes per step are stated, and a target that cannot record is
refused for an explicit rollout and falls back, saying why, under auto."""

from __future__ import annotations

import json
import textwrap

import pytest
from paths import EXAMPLES
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.pipeline import compile_file, compile_text
from rlc.compiler.routing import NPU_HYBRID_CAPTURE_GAP, REPLAY_NOTE, plan_routing, routing_id_bytes
from rlc.schemas.plan import ExpertLayers, Plan

runner = CliRunner()


def _spec(target: str, model: str, extra: str = "") -> str:
    return textwrap.dedent(
        f"""\
        name: moe
        target: {target}
        cluster: {{nodes: 2}}
        model: {{name: {model}, path: /models/m}}
        data: {{train: /data/math.jsonl}}
        """
    ) + textwrap.dedent(extra)


def _plan(text: str) -> Plan:
    compiled = compile_text(text, "spec.yaml")
    assert compiled.plan is not None, [(d.code, d.message) for d in compiled.report.diagnostics]
    return compiled.plan


def _roles(plan: Plan):  # type: ignore[no-untyped-def]
    return plan.roles_of("train")[0], plan.roles_of("rollout")[0]


def _diagnostics(text: str, code: str) -> list:
    return [d for d in compile_text(text, "spec.yaml", plan=False).report.diagnostics if d.code == code]


@pytest.mark.parametrize(
    ("written", "meant"), [("true", "proximal"), ("false", "off"), ("off", "off"), ("rollout", "rollout")]
)
def test_older_specs_boolean_keeps_its_meaning_without_a_finding(written: str, meant: str) -> None:
    """(YAML reads a bare off as false, which means off too.)"""
    compiled = compile_text(_spec("a2", "qwen3-30b-a3b", f"train: {{routing_replay: {written}}}\n"), plan=False)
    assert compiled.ok and not compiled.report.diagnostics, compiled.report.diagnostics
    assert compiled.problem is not None and compiled.problem.spec.train.routing_replay == meant


@pytest.mark.parametrize("written", ["rolout", "1", "none", "[rollout]"])
def test_a_bad_value_is_a_value_error_naming_the_choices(written: str) -> None:
    compiled = compile_text(_spec("a2", "qwen3-30b-a3b", f"train: {{routing_replay: {written}}}\n"), plan=False)
    (d,) = [d for d in compiled.report.errors if d.path == "train.routing_replay"]
    assert d.code in ("RLC102", "RLC104") and d.line == 6
    assert "rollout" in d.hint or "rollout" in d.message
    if written == "rolout":
        assert d.hint == "did you mean `rollout`?"


def test_rollout_where_the_engines_cannot_record_is_refused_naming_the_target_and_why() -> None:
    text = _spec("a3", "qwen3.5-35b-a3b", "train: {routing_replay: rollout}\n")
    (d,) = _diagnostics(text, "RLC225")
    assert d.severity == "error" and d.path == "train.routing_replay" and d.line == 6
    assert "on the a3 target the engines cannot record them for qwen3.5-35b-a3b" in d.message
    assert NPU_HYBRID_CAPTURE_GAP in d.message and "auto" in d.hint
    assert compile_text(text, "spec.yaml").plan is None


def test_a_replay_on_a_dense_model_is_a_warning_that_it_does_nothing() -> None:
    (d,) = _diagnostics(_spec("a2", "qwen3-8b", "train: {routing_replay: proximal}\n"), "RLC225")
    assert d.severity == "warning" and "has no routed experts" in d.message
    assert not _diagnostics(_spec("a2", "qwen3-8b", "train: {routing_replay: off}\n"), "RLC225")
    assert not _diagnostics(_spec("a2", "qwen3-8b"), "RLC225")


def test_cpu_moe_example_replays_the_engines_experts_captured_by_rlc_without_prefix_caching() -> None:
    plan = compile_file(EXAMPLES / "cpu-moe.yaml").plan
    assert plan is not None
    actor, rollout = _roles(plan)
    assert actor.engine["routing_replay"] == "rollout"
    assert rollout.routing_capture == "rlc" and actor.routing_capture is None
    assert rollout.engine["enable_prefix_caching"] is False
    assert "enable_return_routed_experts" not in rollout.engine
    (note,) = [n for n in actor.notes if n.startswith(REPLAY_NOTE)]
    assert note.startswith(f"{REPLAY_NOTE}rollout, because auto picks R3") and "the cpu target's" in note
    assert any("prefix caching is off" in n for n in rollout.notes)
    # 16 prompts x 8 samples, mean 4 + 2 tokens (at most 8 + 4), 2 layers x top-2 one-byte ids
    assert plan.model.experts is not None and plan.model.experts.routing_id_bytes == 1
    assert rollout.estimates["routing_bytes_per_step"] == 128 * 6 * 4
    assert rollout.estimates["routing_bytes_per_step_max"] == 128 * 12 * 4


def test_a_dense_example_has_no_replay_and_no_capture() -> None:
    plan = compile_file(EXAMPLES / "quickstart.yaml").plan
    assert plan is not None
    actor, rollout = _roles(plan)
    assert "routing_replay" not in actor.engine and rollout.routing_capture is None
    assert not [k for k in rollout.estimates if k.startswith("routing")]
    assert plan_routing(plan) is None


def test_a_gpu_moe_plan_turns_on_vllms_capture_with_prefix_caching_and_model_runner_v2() -> None:
    actor, rollout = _roles(_plan(_spec("h100", "qwen3-30b-a3b", "rollout: {max_prompt_len: 64}\n")))
    assert actor.engine["routing_replay"] == "rollout" and rollout.routing_capture == "vllm"
    assert rollout.engine["enable_return_routed_experts"] is True
    assert rollout.engine["enable_prefix_caching"] is True  # a 64-token prompt fills no KV block: on for vLLM
    assert rollout.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_an_npu_moe_plan_uses_vllm_ascends_capture() -> None:
    plan = _plan(_spec("a3", "qwen3-30b-a3b"))
    actor, rollout = _roles(plan)
    assert actor.engine["routing_replay"] == "rollout" and rollout.routing_capture == "vllm"
    assert rollout.engine["enable_return_routed_experts"] is True and "VLLM_USE_V2_MODEL_RUNNER" not in rollout.env
    assert any("needs vllm-ascend 0.18.0 or later" in n for n in rollout.notes)
    # 48 layers x top-8 one-byte ids per token
    assert plan_routing(plan)["bytes_per_token"] == 48 * 8  # type: ignore[index]


@pytest.mark.parametrize(("minibatches", "replay"), [(1, "off"), (2, "proximal")])
def test_a_hybrid_moe_on_npu_falls_back_and_says_why(minibatches: int, replay: str) -> None:
    plan = _plan(_spec("a3", "qwen3.5-35b-a3b", f"algorithm: {{minibatches: {minibatches}}}\n"))
    actor, rollout = _roles(plan)
    assert actor.engine["routing_replay"] == replay and rollout.routing_capture is None
    assert "enable_return_routed_experts" not in rollout.engine
    (note,) = [n for n in actor.notes if n.startswith(REPLAY_NOTE)]
    assert note.startswith(f"{REPLAY_NOTE}{replay}, because the a3 target's engines cannot record their experts")
    assert NPU_HYBRID_CAPTURE_GAP in note
    assert not [k for k in rollout.estimates if k.startswith("routing")]


def test_an_explicit_choice_is_the_plans_and_proximal_with_one_minibatch_says_it_replays_nothing() -> None:
    actor, rollout = _roles(_plan(_spec("a3", "qwen3-30b-a3b", "train: {routing_replay: proximal}\n")))
    assert actor.engine["routing_replay"] == "proximal" and rollout.routing_capture is None
    assert any("no separate proximal pass, so nothing is replayed" in n for n in actor.notes)


def test_uint16_ids_from_255_experts_on() -> None:
    assert (routing_id_bytes(8), routing_id_bytes(254), routing_id_bytes(255), routing_id_bytes(256)) == (1, 1, 2, 2)
    assert ExpertLayers(layers=58, num_experts=256, experts_per_token=8).routing_id_bytes == 2  # an older plan


def test_explain_and_summary_say_which_replay_runs_who_records_and_the_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = EXAMPLES / "cpu-moe.yaml"
    text = runner.invoke(app, ["explain", str(spec)], env={"COLUMNS": "400"})
    assert text.exit_code == 0, text.output
    assert "MoE routing replay: rollout (R3), the trainer replays the experts the engines chose, recorded by " in (
        text.output
    )
    assert "Routing: 4 bytes per token, 3 KiB per step at mean lengths, at most 6 KiB" in text.output
    as_json = json.loads(runner.invoke(app, ["explain", str(spec), "--format", "json"]).output)["routing"]
    assert {k: as_json[k] for k in ("replay", "capture", "bytes_per_token")} == {
        "replay": "rollout",
        "capture": "rlc",
        "bytes_per_token": 4,
    }
    assert as_json["reason"].startswith("auto picks R3")
    assert runner.invoke(app, ["compile", str(spec), "-o", str(tmp_path / "plan")]).exit_code == 0
    summary = (tmp_path / "plan" / "SUMMARY.md").read_text()
    assert "MoE routing replay: rollout (R3)" in summary and "Routing: 4 bytes per token" in summary
    dense = runner.invoke(app, ["explain", str(EXAMPLES / "quickstart.yaml"), "--format", "json"])
    assert json.loads(dense.output)["routing"] is None


def test_an_older_plans_boolean_reads_as_proximal_or_off() -> None:
    plan = compile_file(EXAMPLES / "cpu-moe.yaml").plan
    assert plan is not None
    data = json.loads(plan.model_dump_json())
    data["roles"][0]["engine"]["routing_replay"] = True
    for role in data["roles"]:
        role.pop("routing_capture")
    data["model"]["experts"].pop("routing_id_bytes")
    older = Plan.model_validate(data)
    info = plan_routing(older)
    assert info is not None and (info["replay"], info["capture"]) == ("proximal", None)
    assert older.model.experts is not None and older.model.experts.routing_id_bytes == 1
