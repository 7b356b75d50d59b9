"""Trainer choices nothing in rlc executes are refused when the spec is checked, with the layout that does run:
the Megatron backend (RLC223), LoRA adapters on a mixture-of-experts model's router or routed experts (RLC224),
selective recompute (RLC215), and experts split over TP (ETP > 1), which only Megatron would plan.
`backend: auto` searches FSDP2 alone, and when no FSDP2 layout fits it says why (memory per device, the degrees
tried) instead of falling back to Megatron."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler import search
from rlc.compiler.planner import build_plan
from rlc.compiler.validate import check_text

MOE = """\
name: moe
target: a2
cluster: {nodes: 4}
model: {name: qwen3-30b-a3b, path: /models/Qwen3-30B-A3B}
data: {train: /data/math.jsonl}
"""

runner = CliRunner()


def _diagnostics(text: str, folder: Path) -> list[dict]:
    """`rlc validate --format json` of `text`, as a user's CI reads it."""
    spec = folder / "spec.yaml"
    spec.write_text(text)
    result = runner.invoke(app, ["validate", str(spec), "--format", "json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.output)["files"][0]["diagnostics"]


def _problem(text: str):  # type: ignore[no-untyped-def]
    checked = check_text(textwrap.dedent(text), "spec.yaml")
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    return checked


def test_megatron_pin_is_refused_at_validate_naming_the_fsdp2_layout(tmp_path: Path) -> None:
    text = MOE + "placement:\n  train: {devices: 16, backend: megatron, tp: 4, pp: 2, ep: 4}\n"
    (refusal,) = [d for d in _diagnostics(text, tmp_path) if d["code"] == "RLC223"]
    assert refusal["severity"] == "error" and refusal["path"] == "placement.train.backend" and refusal["line"] == 7
    assert "nothing in rlc executes Megatron" in refusal["message"]
    assert refusal["hint"].endswith("placement.train: {backend: fsdp2, devices: 16, tp: 4, pp: 2, ep: 4} (DP 2)")
    compiled = runner.invoke(app, ["compile", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "plan")])
    assert compiled.exit_code == 1 and "error[RLC223]" in compiled.output and not (tmp_path / "plan").exists()


def test_megatron_in_the_train_section_is_refused_too(tmp_path: Path) -> None:
    (refusal,) = [d for d in _diagnostics(MOE + "train: {backend: megatron}\n", tmp_path) if d["code"] == "RLC223"]
    assert refusal["path"] == "train.backend" and refusal["hint"].endswith("placement.train: {backend: fsdp2}")
    assert not [d for d in _diagnostics(MOE + "train: {backend: fsdp2}\n", tmp_path) if d["severity"] == "error"]


def test_the_search_itself_never_plans_megatron() -> None:
    """A problem that skipped the checks still gets no Megatron layout, but the reason."""
    checked = _problem(MOE)
    spec = checked.problem.spec
    pinned = spec.model_copy(update={"train": spec.train.model_copy(update={"backend": "megatron"})})
    result = search.search(type(checked.problem)(**{**vars(checked.problem), "spec": pinned}))
    assert result.best is None and "nothing in rlc executes Megatron" in result.failures["train"].reason


def test_auto_refuses_with_memory_and_degrees_tried_when_no_fsdp2_layout_fits() -> None:
    """Qwen3-235B-A22B on one A2 node: no FSDP2 layout fits, and the refusal says how far off and what was tried
    (before, the search fell back to a Megatron layout that `rlc run` then refused)."""
    checked = _problem(MOE.replace("qwen3-30b-a3b", "qwen3-235b-a22b").replace("nodes: 4", "nodes: 1"))
    plan, diags = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is None
    (train,) = [d for d in diags if d.code == "RLC301" and d.message.startswith("train needs")]
    assert "GiB per device" in train.message and "a2 devices have" in train.message
    assert "fsdp2 degree tuples on" in train.message and "EP 1/2/4/8" in train.message
    assert "megatron" not in train.message + train.hint


def test_auto_plans_moe_on_fsdp2_only() -> None:
    result = search.search(_problem(MOE).problem, exhaustive=True)
    assert result.best is not None and {c.train.layout.backend for c in result.ranked} == {"fsdp2"}


def test_selective_recompute_is_refused_whatever_the_backend(tmp_path: Path) -> None:
    (refusal,) = [d for d in _diagnostics(MOE + "train: {recompute: selective}\n", tmp_path) if d["code"] == "RLC215"]
    assert refusal["path"] == "train.recompute" and "megatron" not in refusal["hint"]


def test_lora_on_a_moe_model_refuses_only_the_router_and_experts_at_validate(tmp_path: Path) -> None:
    """all-linear on an MoE model adapts the attention (and any dense or shared-expert) linears and compiles; a
    target list naming the router or the routed experts is refused, and so is a served adapter on the cpu target."""
    assert not [d for d in _diagnostics(MOE + "lora: {rank: 8}\n", tmp_path) if d["code"] == "RLC224"]
    named = MOE + "lora: {rank: 8, target_modules: [q_proj, mlp.gate, experts, down_proj]}\n"
    (refusal,) = [d for d in _diagnostics(named, tmp_path) if d["code"] == "RLC224"]
    assert refusal["severity"] == "error" and refusal["path"] == "lora.target_modules"
    assert "mlp.gate, experts, down_proj on qwen3-30b-a3b" in refusal["message"]
    assert "adapters on routed experts or the router are not built" in refusal["message"]
    assert "target attention/dense linears" in refusal["hint"]
    # DeepSeek-V3's dense first layers and shared expert are ordinary linears: down_proj names them
    deepseek = MOE.replace("qwen3-30b-a3b", "deepseek-v3").replace("nodes: 4", "nodes: 64")
    listed = deepseek + "lora: {rank: 8, target_modules: [q_a_proj, down_proj]}\n"
    assert not [d for d in _diagnostics(listed, tmp_path) if d["code"] == "RLC224"]
    cpu = (
        "name: m\ntarget: cpu\nmodel: {name: rlc-tiny-moe}\ndata: {train: arithmetic, digits: 1}\n"
        "rollout: {max_prompt_len: 8, max_response_len: 4}\n"
    )
    (served,) = [
        d for d in _diagnostics(cpu + "lora: {rank: 4, rollout: adapter}\n", tmp_path) if d["code"] == "RLC224"
    ]
    assert served["path"] == "lora.rollout" and "Triton" in served["message"] and "merged" in served["hint"]
    assert not [d for d in _diagnostics(cpu + "lora: {rank: 4}\n", tmp_path) if d["severity"] == "error"]


def test_experts_are_never_split_over_tp() -> None:
    """ETP > 1 is Megatron's (each expert split over the TP ranks); FSDP2 plans keep experts whole beside TP,
    and the plan's engine-facing layout says ETP 1."""
    checked = _problem(MOE + "placement:\n  train: {devices: 16, tp: 2, ep: 4}\n")
    plan, diags = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is not None, [d.message for d in diags]
    actor = plan.role("actor")
    assert (actor.layout.backend, actor.layout.tp, actor.layout.ep, actor.layout.etp) == ("fsdp2", 2, 4, 1)
    assert not plan.runtime_gaps
