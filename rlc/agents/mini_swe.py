"""mini-swe-agent (PyPI `mini-swe-agent` 2.x) as an rlc agent: `run: rlc.agents.mini_swe:run`.

mini-swe-agent talks through litellm, so it reaches the rollout engine with `llm.litellm_kwargs()` as its
`model_kwargs` (cost tracking off: a served policy has no price). Its text-based model class reads the bash
action out of a fenced block, so the engine needs no tool-call parser. Its step limit is `max_turns`, its wall
clock `timeout_s`, and its environment comes from the spec's `rollout.agent.options`:

- `environment`: `local` (default), `bubblewrap`, `docker`, `singularity`, or any class path mini-swe-agent
  takes; `environment_<key>: value` options are passed to it (e.g. `environment_image` for docker).
- `config`: mini-swe-agent's config file name or path for the prompts (default `mini_textbased`).
- `command_timeout_s`: seconds one action may run (default 30).

A task is the data row: `prompt` is the problem statement and `answer` says where to work and how to score, as
JSON: `test` (required) is a shell command run in the environment after the agent stops, reward 1 when it exits
0; `repo` (a local folder, for `local` and `bubblewrap`) is copied to a fresh working directory per trajectory
(trajectories of one task run at once); `image` and `cwd` go to a container environment (docker, singularity:
the repository is in the image). mini-swe-agent is an optional dependency (`pip install 'rlc[agents]'`),
imported only when an episode runs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["parse_task", "run"]


def parse_task(task: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(problem statement, {test, and repo / image / cwd where given}) of a task row; ValueError says what is
    wrong."""
    try:
        spec = json.loads(str(task.get("answer", "")))
    except ValueError:
        raise ValueError('the task\'s answer must be JSON such as {"repo": DIR, "test": COMMAND}') from None
    if not isinstance(spec, dict) or not spec.get("test"):
        raise ValueError('the task\'s answer must name a "test" command')
    unknown = sorted(set(spec) - {"test", "repo", "image", "cwd"})
    if unknown:
        raise ValueError(f"the task's answer has unknown keys {unknown} (known: test, repo, image, cwd)")
    if spec.get("repo") and not Path(spec["repo"]).is_dir():
        raise ValueError(f"the task's repo {spec['repo']} is not a directory")
    return str(task["prompt"]), {k: str(v) for k, v in spec.items()}


def _environment(options: dict[str, Any], where: dict[str, str]) -> Any:
    from minisweagent.environments import get_environment

    config: dict[str, Any] = {
        k.removeprefix("environment_"): v for k, v in options.items() if k.startswith("environment_")
    }
    config.update({k: v for k, v in where.items() if k in ("cwd", "image")})
    config.setdefault("timeout", int(options.get("command_timeout_s", 30)))
    return get_environment({"environment_class": str(options.get("environment", "local")), **config})


def _agent(llm: Any, env: Any) -> Any:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    config = get_config_from_spec(str(llm.options.get("config", "mini_textbased")))
    model_config = dict(config.get("model", {}))
    kwargs = llm.litellm_kwargs()
    model = LitellmTextbasedModel(
        **{k: v for k, v in model_config.items() if k not in ("model_name", "model_kwargs", "cost_tracking")},
        model_name=kwargs.pop("model"),
        model_kwargs={**model_config.get("model_kwargs", {}), **kwargs, "max_tokens": llm.max_tokens},
        cost_tracking="ignore_errors",
    )
    agent_config = {**config.get("agent", {}), "step_limit": llm.max_turns, "cost_limit": 0}
    agent_config["wall_time_limit_seconds"] = max(1, int(llm.timeout_s) - 5)
    return DefaultAgent(model, env, **agent_config)


def run(task: dict[str, Any], llm: Any) -> dict[str, float]:
    """One mini-swe-agent episode (on a private copy of a local repository); reward from the task's tests."""
    problem, spec = parse_task(task)
    with tempfile.TemporaryDirectory(prefix="rlc-swe-") as scratch:
        where = {k: v for k, v in spec.items() if k in ("cwd", "image")}
        if spec.get("repo"):
            workdir = Path(scratch) / Path(spec["repo"]).name
            shutil.copytree(spec["repo"], workdir, symlinks=True)
            where.setdefault("cwd", str(workdir))
        env = _environment(dict(llm.options), where)
        agent = _agent(llm, env)
        result = agent.run(problem)
        try:
            verdict = env.execute({"command": spec["test"]}, timeout=max(5, int(llm.timeout_s)))
        except Exception:  # the tests printed the submission marker, or the sandbox failed: not passed
            verdict = {"returncode": 1}
        return {
            "reward": 1.0 if verdict.get("returncode") == 0 else 0.0,
            "steps": float(agent.n_calls),
            "submitted": float(result.get("exit_status") == "Submitted"),
        }
