"""The calculator agent of `examples/cpu-agent.yaml`: an ordinary OpenAI-client program with one tool.

The model is asked ``47+38=``; when its turn holds a call such as ``[47+38]`` the tool's answer ``(85)`` is
sent back as a tool message and the model answers; a turn without a call is the final answer. Reward 1 when
that answer is the task's. A call the server refuses (turn or context budget) ends the trajectory unanswered.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["calculate", "parse_tool_call", "run"]

_CALL = re.compile(r"\[(\d{1,6})([+\-*])(\d{1,6})\]")


def calculate(a: int, op: str, b: int) -> int:
    """The tool: one integer operation."""
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def parse_tool_call(text: str) -> tuple[int, str, int] | None:
    """The first ``[a+b]`` call in a model turn, or None when the turn is an answer."""
    found = _CALL.search(text)
    return (int(found.group(1)), found.group(2), int(found.group(3))) if found else None


async def run(task: dict[str, Any], llm: Any) -> float:
    import openai

    client = llm.async_openai()
    messages: list[dict[str, str]] = [{"role": "user", "content": task["prompt"]}]
    answer = None
    try:
        for _ in range(llm.max_turns):
            reply = await client.chat.completions.create(
                model=llm.model,
                messages=messages,
                max_tokens=llm.max_tokens,
                # The character model may sample a special token; keep it in the text so the next turn
                # renders exactly the tokens it sampled.
                extra_body={"skip_special_tokens": False},
            )
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            call = parse_tool_call(text)
            if call is None:
                answer = text
                break
            messages.append({"role": "tool", "content": f"({calculate(*call)})", "tool_call_id": "calc"})
    except openai.BadRequestError:  # over the turn or context budget: the trajectory ends unanswered
        return 0.0
    finally:
        await client.close()
    return 1.0 if answer is not None and answer.strip() == str(task["answer"]).strip() else 0.0
