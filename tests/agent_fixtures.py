"""Agents for the tests: well-behaved, failing in each way the runtime must survive, and one that is a separate
OS process using only the `openai` package (no rlc import), as an independent agent would be."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

#: The program the separate-process agent runs: the calculator protocol with the stock `openai` client.
PROGRAM = r"""
import json, os, re, sys
import openai
task = json.loads(sys.argv[1])
client = openai.OpenAI(max_retries=0, timeout=float(os.environ["RLC_TIMEOUT_S"]))  # OPENAI_* from the env
messages = [{"role": "user", "content": task["prompt"]}]
answer = None
for _ in range(int(os.environ["RLC_MAX_TURNS"])):
    reply = client.chat.completions.create(model=os.environ["RLC_MODEL"], messages=messages,
        max_tokens=int(os.environ["RLC_MAX_TOKENS"]), extra_body={"skip_special_tokens": False})
    text = reply.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": text})
    call = re.search(r"\[(\d+)\+(\d+)\]", text)
    if call is None:
        answer = text
        break
    messages.append({"role": "tool", "content": f"({int(call.group(1)) + int(call.group(2))})", "tool_call_id": "c"})
print(json.dumps({"reward": float(answer is not None and answer.strip() == task["answer"])}))
"""


def separate_process(task: dict[str, Any], llm: Any) -> dict[str, float]:
    """Run the agent as its own Python process; only the endpoint's environment variables connect them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLC_")}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-I", "-c", PROGRAM, json.dumps(task)],
        env={**env, **llm.env()},
        capture_output=True,
        text=True,
        timeout=llm.timeout_s,
        cwd="/",
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "agent process failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


async def one_call(task: dict[str, Any], llm: Any) -> float:
    client = llm.async_openai()
    messages = [{"role": "user", "content": task["prompt"]}]
    await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=llm.max_tokens)
    await client.close()
    return 1.0


async def raises(task: dict[str, Any], llm: Any) -> float:
    raise ValueError("the sandbox is on fire")


def hangs(task: dict[str, Any], llm: Any) -> float:
    time.sleep(3600)
    return 1.0


async def hangs_async(task: dict[str, Any], llm: Any) -> float:
    await asyncio.sleep(3600)
    return 1.0


def returns_text(task: dict[str, Any], llm: Any) -> str:
    return "great success"


def returns_dict(task: dict[str, Any], llm: Any) -> dict[str, float]:
    return {"reward": 0.5, "steps": 3.0}


def sometimes_fails(task: dict[str, Any], llm: Any) -> float:
    """Calls the model once, then fails for every fourth task (by index: all its trajectories), and hangs for
    exactly one trajectory: the first to claim the marker file named by `llm.options["hang_marker"]`, so that
    its re-issue (and every other trajectory) goes on."""
    client = llm.openai()
    client.completions.create(model=llm.model, prompt=task["prompt"], max_tokens=4)
    if task["index"] % 4 == 3:
        raise RuntimeError("flaky tool")
    try:
        os.close(os.open(llm.options["hang_marker"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass
    else:
        time.sleep(3600)
    return 1.0
