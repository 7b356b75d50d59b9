"""`spec.resolved.yaml`: every field of the spec, defaults filled in, each value commented with its source.

The file is valid spec YAML (it loads back into the same `Spec`, except where the planner resolved an
`auto`), so it doubles as a reproducible, fully explicit spec. Values the user left to the planner
(`mode: auto`, an unset micro-batch size, ...) show the planner's choice, marked `planner`. It is written
by hand rather than with yaml.dump because PyYAML cannot attach comments; strings that are not plainly
safe are written as JSON strings with every non-ASCII or control character escaped, which YAML reads back
verbatim, so no value can break a line or a comment.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from pydantic import ValidationError

from rlc.compiler.provenance import compute_provenance
from rlc.schemas.plan import Plan
from rlc.schemas.spec import Spec

_PLAIN = re.compile(r"^[A-Za-z0-9_./@+-][A-Za-z0-9_./@+:-]*$")


def planner_choices(spec: Spec, plan: Plan) -> dict[str, Any]:
    """Spec fields left to the planner (auto or unset) → what the plan chose, where the spec can say it."""
    out: dict[str, Any] = {}
    if spec.mode == "auto":
        out["mode"] = plan.schedule.mode
    if spec.cluster.devices_per_node is None:
        out["cluster.devices_per_node"] = plan.cluster.devices_per_node
    if spec.output.dir is None:
        out["output.dir"] = plan.run_dir
    trainers = plan.roles_of("train")
    if spec.train.backend == "auto" and trainers and trainers[0].backend in ("fsdp2", "megatron"):
        out["train.backend"] = trainers[0].backend
    recompute = trainers[0].engine.get("recompute") if trainers else None
    if spec.train.recompute == "auto" and recompute in ("none", "selective", "full"):
        out["train.recompute"] = recompute
    if spec.train.micro_batch_tokens is None:
        out["train.micro_batch_tokens"] = plan.schedule.micro_batch_tokens
    if spec.rollout.weight_sync == "auto" and plan.schedule.weight_sync in ("broadcast", "disk"):
        out["rollout.weight_sync"] = plan.schedule.weight_sync
    if spec.lora is not None and spec.lora.rollout == "auto" and plan.lora is not None:
        out["lora.rollout"] = plan.lora.rollout
    replay = trainers[0].engine.get("routing_replay") if trainers else None
    if spec.train.routing_replay == "auto" and replay in ("off", "proximal", "rollout"):
        out["train.routing_replay"] = replay
    speculative = plan.sampling.speculative or {}
    if spec.rollout.mtp is not None and spec.rollout.mtp.method == "auto" and speculative.get("method"):
        method = str(speculative["method"])
        out["rollout.mtp.method"] = "ngram" if method == "ngram" else "mtp" if "mtp" in method else "auto"
    return out


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value


def _get(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def scalar(value: Any) -> str:
    """One YAML scalar that reads back as exactly `value`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return yaml.safe_dump(value).splitlines()[0]
    text = str(value)
    if _PLAIN.match(text) and yaml.safe_load(f"k: {text}") == {"k": text}:
        return text
    return json.dumps(text, ensure_ascii=True)


def flow(value: Any) -> str:
    """A value on one line: scalars, [lists] and {mappings} in flow style."""
    if isinstance(value, list):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{scalar(str(k))}: {flow(v)}" for k, v in value.items()) + "}"
    return scalar(value)


def _comment(path: str, sources: dict[str, str], was: dict[str, Any]) -> str:
    source = sources.get(path, "default")
    if source == "planner" and was.get(path) == "auto":
        return "  # planner (was auto)"
    return f"  # {source}"


def _emit(node: dict[str, Any], prefix: str, indent: int, sources: dict[str, str], was: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    pad = " " * indent
    for key, value in node.items():
        path = f"{prefix}{key}"
        label = scalar(str(key))
        if path in sources or not isinstance(value, dict | list) or not value:
            lines.append(f"{pad}{label}: {flow(value)}{_comment(path, sources, was)}")
        elif isinstance(value, dict):
            lines.append(f"{pad}{label}:")
            lines.extend(_emit(value, f"{path}.", indent + 2, sources, was))
        else:
            lines.append(f"{pad}{label}:")
            for index, item in enumerate(value):
                item_path = f"{path}.{index}"
                if isinstance(item, dict) and item:
                    body = _emit(item, f"{item_path}.", indent + 4, sources, was)
                    body[0] = f"{pad}  - {body[0][indent + 4 :]}"
                    lines.extend(body)
                else:
                    lines.append(f"{pad}  - {flow(item)}{_comment(item_path, sources, was)}")
    return lines


def render_resolved_spec(spec: Spec, plan: Plan, provenance: dict[str, str]) -> str:
    """The text of spec.resolved.yaml for `spec` compiled into `plan`."""
    data = spec.model_dump(mode="json")
    sources = {**compute_provenance(spec), **provenance}
    was: dict[str, Any] = {}
    choices = planner_choices(spec, plan)
    candidate = json.loads(json.dumps(data))
    for path, value in choices.items():
        _set(candidate, path, value)
    try:
        Spec.model_validate(candidate)
    except ValidationError:
        choices = {}  # a planner value the spec cannot express: keep the user's `auto` rather than lie
    for path, value in choices.items():
        was[path] = _get(data, path)
        _set(data, path, value)
        sources[path] = "planner"
    header = [
        f"# Resolved spec of `{spec.name}`: every field with its value and where the value came from:",
        "#   spec = your file, default = rlc's default, --set / --target = the command line,",
        "#   planner = chosen by the compiler for a field left to it (auto or unset).",
    ]
    return "\n".join(header + _emit(data, "", 0, sources, was)) + "\n"
