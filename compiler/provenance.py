"""Where each spec value came from: the user's file, a default, `--set`, `--target`, or the planner.

`spec.resolved.yaml` prints this next to every value, so a reader can tell at a glance which numbers were
chosen on purpose and which were filled in. The map is keyed by dotted path (`algorithm.lr`,
`distill.teachers.0.model.path`) and computed from pydantic's `model_fields_set`, which records exactly
the keys that were present in the validated data (the file with its `--set` overrides applied).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel

from rlc.compiler.load import parse_override
from rlc.schemas.spec import Spec

Source = Literal["spec", "default", "--set", "--target", "planner"]
SOURCES: tuple[str, ...] = ("spec", "default", "--set", "--target", "planner")

Loc = tuple[str, ...]


def _override_paths(overrides: Iterable[str]) -> list[Loc]:
    paths: list[Loc] = []
    for text in overrides:
        try:
            parts, _ = parse_override(text)
        except ValueError:
            continue  # the loader already reported it; a bad override sets nothing
        paths.append(tuple(parts))
    return paths


def _leaf_source(loc: Loc, explicit: bool, set_paths: list[Loc], target_given: bool) -> str:
    if target_given and loc == ("target",):
        return "--target"
    if not explicit:
        return "default"
    if any(loc[: len(p)] == p for p in set_paths):
        return "--set"
    return "spec"


def _walk(value: Any, loc: Loc, explicit: bool, set_paths: list[Loc], target_given: bool, out: dict[str, str]) -> None:
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            child_explicit = explicit and name in value.model_fields_set
            _walk(getattr(value, name), (*loc, name), child_explicit, set_paths, target_given, out)
        return
    if isinstance(value, list) and any(isinstance(item, BaseModel) for item in value):
        for index, item in enumerate(value):
            _walk(item, (*loc, str(index)), explicit, set_paths, target_given, out)
        return
    if isinstance(value, dict) and value and all(isinstance(item, BaseModel) for item in value.values()):
        for key, item in value.items():
            _walk(item, (*loc, str(key)), explicit, set_paths, target_given, out)
        return
    out[".".join(loc)] = _leaf_source(loc, explicit, set_paths, target_given)


def compute_provenance(spec: Spec, overrides: Iterable[str] = (), *, target_given: bool = False) -> dict[str, str]:
    """Dotted path of every leaf value in `spec` → spec | default | --set | --target.

    `overrides` are the raw `--set key=value` strings; `target_given` says whether `--target` was passed.
    Leaves are scalars, lists of scalars, and sections left out entirely (`lora: null` → `lora`).
    """
    out: dict[str, str] = {}
    _walk(spec, (), True, _override_paths(overrides), target_given, out)
    return dict(sorted(out.items()))
