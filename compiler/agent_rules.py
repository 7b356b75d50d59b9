"""Semantic checks of `rollout.agent` (RLC220): settings that contradict each other or the rollout budget.

Registered into `rule_registry.RULES` like every other rule.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.rule_registry import RuleContext, rule

#: vLLM 0.x tool-call parser names (`--tool-call-parser`); an unknown name is a warning, since builds add parsers.
KNOWN_TOOL_PARSERS: tuple[str, ...] = (
    "deepseek_v3",
    "deepseek_v31",
    "glm45",
    "granite",
    "hermes",
    "hunyuan_a13b",
    "internlm",
    "jamba",
    "kimi_k2",
    "llama3_json",
    "llama4_pythonic",
    "longcat",
    "minimax",
    "mistral",
    "openai",
    "phi4_mini_json",
    "pythonic",
    "qwen3_coder",
    "qwen3_xml",
    "seed_oss",
    "step3",
    "xlam",
)


@rule("RLC220", "Agent rollouts need settings that fit each other and the rollout budget")
def check_agent(ctx: RuleContext) -> Iterator[Diagnostic]:
    spec = ctx.problem.spec
    agent = spec.rollout.agent
    if agent is None:
        return
    if spec.mode == "colocated":
        yield ctx.diag(
            "RLC220",
            "mode",
            "agent rollouts run disaggregated: tools keep running while the trainer steps, which colocated mode "
            "(engines asleep during training) cannot give",
            "use `mode: disaggregated` or `mode: auto`",
        )
    if agent.max_tokens_per_turn > spec.rollout.max_response_len:
        yield ctx.diag(
            "RLC220",
            "rollout.agent.max_tokens_per_turn",
            f"a turn of {agent.max_tokens_per_turn} tokens exceeds rollout.max_response_len "
            f"({spec.rollout.max_response_len}), the tokens a whole trajectory may add to its prompt",
            f"use max_tokens_per_turn <= {spec.rollout.max_response_len} or raise rollout.max_response_len",
        )
    if agent.expected_turns is not None and agent.expected_turns > agent.max_turns:
        yield ctx.diag(
            "RLC220",
            "rollout.agent.expected_turns",
            f"expected_turns {agent.expected_turns:g} is more than max_turns ({agent.max_turns}), the calls a "
            "trajectory may make",
            f"use expected_turns <= {agent.max_turns} (the mean the step-time estimate prices), or raise max_turns",
        )
    if agent.export == "trajectory" and agent.turn_discount != 1.0:
        yield ctx.diag(
            "RLC220",
            "rollout.agent.turn_discount",
            f"turn_discount {agent.turn_discount:g} is ignored with export: trajectory (one row per trajectory, "
            "one advantage)",
            "use `export: turns` to discount earlier turns, or drop turn_discount",
            "warning",
        )
    parser = agent.tool_call_parser
    if parser is not None and parser not in KNOWN_TOOL_PARSERS:
        close = difflib.get_close_matches(parser, KNOWN_TOOL_PARSERS, n=1)
        yield ctx.diag(
            "RLC220",
            "rollout.agent.tool_call_parser",
            f"`{parser}` is not a tool-call parser vLLM ships (as of 0.32); the engine refuses to start if its "
            "build lacks it",
            f"did you mean `{close[0]}`?" if close else f"one of: {', '.join(KNOWN_TOOL_PARSERS)}",
            "warning",
        )
    if "reward" in spec.model_fields_set:
        yield ctx.diag(
            "RLC220",
            "reward.fn",
            f"reward.fn `{spec.reward.fn}` is not called with an agent: the agent's run() returns the reward",
            "score inside the agent (it has the task's answer), and drop the reward block",
            "warning",
        )
    if spec.lora is not None and spec.lora.rollout == "adapter":
        yield ctx.diag(
            "RLC220",
            "lora.rollout",
            "the agent endpoint serves the policy's merged weights; serving a LoRA adapter to agents is not wired",
            "use `lora.rollout: merged` (or auto, which merges with an agent)",
        )
