"""Starter specs for `rlc init`: a small, valid spec per target that users then edit."""

from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# The schema is written next to the starter spec so editors validate offline.
SCHEMA_NEIGHBOUR = "rlc.schema.json"

_CPU = """\
# yaml-language-server: $schema={schema}
# Quickstart on this machine: a tiny Qwen3-architecture model learns two-operand addition with GRPO.
name: {name}
target: cpu
model: {{name: rlc-tiny}}          # built locally on first run; nothing is downloaded
mode: disaggregated
algorithm: {{group_size: 8, batch_prompts: 16, max_staleness: 1, lr: 1.0e-3, steps: 60}}
data: {{train: arithmetic, digits: 1}}
reward: {{fn: exact_match}}
rollout: {{max_prompt_len: 8, max_response_len: 4, temperature: 1.0}}
output: {{dir: runs/{name}, checkpoint_every: 20}}
"""

_ACCELERATOR = """\
# yaml-language-server: $schema={schema}
name: {name}
target: {target}
cluster: {{nodes: 1}}
model: {{name: qwen3-8b, path: /models/Qwen3-8B}}     # a local Hugging Face folder on every node
mode: auto                                            # colocated | disaggregated | auto
algorithm: {{group_size: 8, batch_prompts: 64, max_staleness: 2, lr: 1.0e-6, steps: 200}}
data: {{train: /data/math.jsonl, prompt_key: prompt, answer_key: answer}}
reward: {{fn: math_exact}}
rollout: {{max_prompt_len: 2048, max_response_len: 8192, temperature: 1.0}}
train: {{backend: auto, packing: true, recompute: auto}}
output: {{dir: runs/{name}, loggers: [jsonl, tensorboard]}}   # + wandb | swanlab | mlflow (rlc[trackers])
"""


def starter_spec(name: str, target: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"name {name!r} must match [a-z0-9][a-z0-9._-]* (lowercase, digits, . _ -)")
    template = _CPU if target == "cpu" else _ACCELERATOR
    return template.format(schema=f"./{SCHEMA_NEIGHBOUR}", name=name, target=target)
