"""Look up hardware targets and model architectures by name.

Data files ship as package data of `rlc.schemas` and are read through importlib.resources, so lookups work
the same from a source checkout, an editable install and a wheel. Names are forgiving (case, HF repo ids,
aliases, -Instruct/-Base/-Chat suffixes) and an unknown name raises `UnknownNameError` with did-you-mean
suggestions, which the validator turns into a diagnostic instead of a traceback.
"""

from __future__ import annotations

import difflib
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .arch import ModelArch
from .target import TargetProfile

_M = TypeVar("_M", bound=BaseModel)

_PACKAGE = __name__.rpartition(".")[0] or "schemas"

#: Suffixes that name a fine-tuned or base variant of the same architecture.
VARIANT_SUFFIXES: tuple[str, ...] = ("-instruct", "-base", "-chat")


class UnknownNameError(LookupError):
    """A target or model name that no data file knows; carries close matches for a did-you-mean."""

    def __init__(self, name: str, kind: str, suggestions: list[str]) -> None:
        self.name = name
        self.kind = kind
        self.suggestions = suggestions
        hint = f"; did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
        super().__init__(f"unknown {kind} {name!r}{hint}")


def _yaml_files(folder: str) -> list[Traversable]:
    root = resources.files(_PACKAGE).joinpath(folder)
    return sorted((f for f in root.iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name)


def _read(file: Traversable) -> dict:
    data = yaml.safe_load(file.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{file.name}: expected a mapping at the top level")
    stem = file.name.removesuffix(".yaml")
    if data.get("id") != stem:
        raise ValueError(f"{file.name}: id {data.get('id')!r} must equal the file name {stem!r}")
    return data


def _validated(model: type[_M], file: Traversable) -> _M:
    """Validate one data file, naming the file in the error so a bad contribution is easy to find."""
    try:
        return model.model_validate(_read(file))
    except ValidationError as err:
        raise ValueError(f"{file.name} is not a valid {model.__name__}:\n{err}") from err


@cache
def _targets() -> dict[str, TargetProfile]:
    return {p.id: p for p in (_validated(TargetProfile, f) for f in _yaml_files("targets"))}


@cache
def _models() -> tuple[dict[str, ModelArch], dict[str, str]]:
    """All architectures by id, and every lookup key (id, alias; lower case) → id."""
    archs = {a.id: a for a in (_validated(ModelArch, f) for f in _yaml_files("catalog"))}
    keys: dict[str, str] = {}
    for arch in archs.values():
        for key in (arch.id, *arch.aliases):
            norm = _normalise(key)
            if keys.setdefault(norm, arch.id) != arch.id:
                raise ValueError(f"catalog name {key!r} is claimed by both {keys[norm]!r} and {arch.id!r}")
    return archs, keys


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _candidates(name: str) -> list[str]:
    """Keys to try for a user-written model name, most specific first."""
    norm = _normalise(name)
    forms = [norm]
    if "/" in norm:  # HF repo id or a local folder: the last component names the model
        forms.append(norm.rstrip("/").rpartition("/")[2])
    out: list[str] = []
    for form in forms:
        out.append(form)
        stripped = form
        changed = True
        while changed:
            changed = False
            for suffix in VARIANT_SUFFIXES:
                if stripped.endswith(suffix):
                    stripped = stripped.removesuffix(suffix)
                    out.append(stripped)
                    changed = True
    return out


def _suggest(name: str, keys: dict[str, str]) -> list[str]:
    probe = _candidates(name)[-1]
    matches = difflib.get_close_matches(probe, list(keys), n=6, cutoff=0.6)
    return list(dict.fromkeys(keys[m] for m in matches))[:3]


def target_ids() -> list[str]:
    """Ids of every shipped hardware target, sorted."""
    return sorted(_targets())


def load_target(name: str) -> TargetProfile:
    """The target profile called `name` (case-insensitive); UnknownNameError if none."""
    targets = _targets()
    key = _normalise(name)
    if key in targets:
        return targets[key]
    raise UnknownNameError(name, "target", _suggest(name, {t: t for t in targets}))


def model_ids() -> list[str]:
    """Canonical ids of every catalog model, sorted."""
    return sorted(_models()[0])


def resolve_model_id(name: str) -> str:
    """The canonical catalog id for `name` (aliases, HF repo ids, variant suffixes); UnknownNameError if none."""
    _, keys = _models()
    for candidate in _candidates(name):
        if candidate in keys:
            return keys[candidate]
    raise UnknownNameError(name, "model", _suggest(name, keys))


def load_arch(name: str) -> ModelArch:
    """The architecture for `name`, e.g. "Qwen/Qwen3-8B-Instruct" → qwen3-8b; UnknownNameError if none."""
    return _models()[0][resolve_model_id(name)]
