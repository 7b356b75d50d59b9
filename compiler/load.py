"""Load a spec file: YAML with line numbers → `Spec`, or diagnostics that say exactly what is wrong.

Every structural problem in the file is reported at once (pydantic collects them all); each is mapped back
to the YAML line it came from, and unknown keys get a did-you-mean drawn from the keys valid at that place.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlc.compiler.diagnostics import Diagnostic, Report
from rlc.schemas.spec import Spec

Loc = tuple[str | int, ...]
MAX_SPEC_BYTES = 1 << 20
#: Values a spec may expand to (aliases counted once per use); real specs have a few hundred.
MAX_NODES = 10_000
#: Nesting levels a spec may have; the deepest real one has six.
MAX_DEPTH = 32


@dataclass
class LineMap:
    """Maps dotted spec paths to the 1-based line where the key (or item) appears in the YAML source."""

    lines: dict[Loc, int] = field(default_factory=dict)
    #: Paths set on the command line → the `--set` text that set them (their file lines no longer apply).
    overrides: dict[Loc, str] = field(default_factory=dict)

    @staticmethod
    def _loc(loc: Loc | str) -> Loc:
        return tuple(int(p) if p.isdigit() else p for p in loc.split(".") if p) if isinstance(loc, str) else loc

    def override_for(self, loc: Loc | str) -> str | None:
        """The `--set` that set `loc` or one of its ancestors, if any."""
        loc = self._loc(loc)
        return next((text for path, text in self.overrides.items() if loc[: len(path)] == path), None)

    def line_for(self, loc: Loc | str) -> int | None:
        """The line of `loc`, or of its nearest ancestor that appears in the file; None for a `--set` value."""
        loc = self._loc(loc)
        if self.override_for(loc) is not None:
            return None
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get((), None)


@dataclass
class LoadResult:
    spec: Spec | None
    report: Report
    lines: LineMap
    data: dict[str, Any] | None = None
    # When the file has structural errors: the spec with the offending keys removed (defaults in their
    # place), so semantic rules can still report problems in the rest of the file in the same pass.
    repaired: Spec | None = None


class YamlShapeError(ValueError):
    """A YAML document whose shape no spec has: recursive aliases, nesting too deep, alias expansion too large."""


class _DepthLimitedLoader(yaml.SafeLoader):
    """The pure-Python loader, for PyYAML without libyaml: its composer recurses once per level, so it stops
    at MAX_DEPTH (libyaml refuses past 1,000 levels by itself, and the node walk stops at MAX_DEPTH)."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlShapeError(f"nesting is deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


#: libyaml's parser where PyYAML has it: the Python scanner is quadratic on deeply nested flow collections.
_Loader: type = getattr(yaml, "CSafeLoader", _DepthLimitedLoader)


def _walk_nodes(
    node: yaml.Node,
    loc: Loc,
    lines: dict[Loc, int],
    duplicates: list[tuple[Loc, int]],
    budget: list[int],
    on_path: set[int],
) -> None:
    """Record each key's line and duplicate keys, expanding aliases as the constructed data will.

    Every visit spends one unit of `budget` (an alias is visited once per reference, so "billion laughs"
    documents run it out in microseconds instead of expanding exponentially); a node met again on its own
    path is a recursive alias; nesting deeper than MAX_DEPTH is refused.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise YamlShapeError(
            f"the document expands to more than {MAX_NODES:,} values (aliases `*name` repeat what they point to)"
        )
    if len(loc) > MAX_DEPTH:
        raise YamlShapeError(f"nesting is deeper than {MAX_DEPTH} levels")
    if id(node) in on_path:
        raise YamlShapeError(f"the alias at line {node.start_mark.line + 1} refers to a value that contains it")
    lines.setdefault(loc, node.start_mark.line + 1)
    if not isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        return
    on_path.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else f"<{type(key_node).__name__}>"
            child = (*loc, key)
            if key in seen:
                duplicates.append((child, key_node.start_mark.line + 1))
            seen.add(key)
            lines[child] = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                _walk_nodes(key_node, child, {}, [], budget, on_path)
            _walk_nodes(value_node, child, lines, duplicates, budget, on_path)
    else:
        for index, item in enumerate(node.value):
            child = (*loc, index)
            lines[child] = item.start_mark.line + 1
            _walk_nodes(item, child, lines, duplicates, budget, on_path)
    on_path.discard(id(node))


def _bounded_yaml(text: str) -> tuple[Any, dict[Loc, int], list[tuple[Loc, int]]]:
    """Parse YAML into data, line numbers and duplicate keys, refusing shapes no spec has (YamlShapeError).

    The node tree is checked before anything is constructed, so an alias bomb or a recursive alias costs
    no more than MAX_NODES steps. Raises yaml.YAMLError for malformed text.
    """
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        lines: dict[Loc, int] = {}
        duplicates: list[tuple[Loc, int]] = []
        if root is None:
            return None, lines, duplicates
        _walk_nodes(root, (), lines, duplicates, [MAX_NODES], set())
        return loader.construct_document(root), lines, duplicates
    finally:
        loader.dispose()


def dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `--set a.b.c=value`; the value is read as YAML so numbers and booleans keep their types."""
    if "=" not in text:
        raise ValueError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ValueError(f"--set has an empty key in {text!r}")
    if "\x00" in text:
        raise ValueError(f"--set {key.strip()}: the value holds a NUL byte")
    try:
        value = _bounded_yaml(raw)[0] if raw.strip() else ""
    except YamlShapeError as exc:
        raise ValueError(f"--set {key.strip()}: {exc}") from None
    except (yaml.YAMLError, RecursionError):
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """Apply `--set` overrides in place, creating intermediate mappings as needed."""
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic model classes reachable from a field annotation (through Optional, list, dict, Annotated)."""
    found: list[type[BaseModel]] = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _model_classes(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, dict, tuple):
        for arg in typing.get_args(annotation):
            found.extend(_model_classes(arg))
    return found


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The spec section model that owns the mapping at `loc` (used to suggest valid keys)."""
    model: type[BaseModel] = Spec
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(part)
        if info is None:
            # dict keys such as placement.teachers.<name>: stay on the dict's value model
            continue
        classes = _model_classes(info.annotation)
        if not classes:
            return None
        model = classes[0]
    return model


def did_you_mean(word: str, candidates: list[str]) -> str:
    matches = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else ""


def _error_to_diagnostic(error: dict[str, Any], lines: LineMap, file: str) -> Diagnostic:
    loc: Loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
    path = dotted(loc)
    line = lines.line_for(loc)
    kind = error["type"]
    value = error.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        valid = sorted(parent.model_fields) if parent else []
        guess = did_you_mean(str(loc[-1]), valid)
        hint = f"did you mean `{guess}`?" if guess else f"valid keys here: {', '.join(valid)}"
        return Diagnostic("RLC101", f"unknown key `{loc[-1]}`", path, hint=hint, line=line, file=file)
    if kind == "missing":
        return Diagnostic("RLC103", f"required key `{loc[-1]}` is missing", path, hint="add it", line=line, file=file)
    if kind in ("literal_error", "enum"):
        expected = error.get("ctx", {}).get("expected", "")
        guess = did_you_mean(str(value), [e.strip(" '") for e in str(expected).replace(" or ", ",").split(",")])
        hint = f"did you mean `{guess}`?" if guess else f"expected {expected}"
        return Diagnostic("RLC104", f"{value!r} is not allowed", path, hint=hint, line=line, file=file)
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    shown = "" if isinstance(value, dict | list) or value is None else f" (got {_short(value)})"
    code = "RLC102" if kind.endswith("_type") or kind.endswith("_parsing") else "RLC104"
    via = lines.override_for(loc)
    if via is not None:
        shown += f" from `--set {_short_text(via)}`"
    return Diagnostic(code, f"{message}{shown}", path, hint=_range_hint(loc), line=line, file=file)


def _short_text(text: str) -> str:
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _short(value: Any) -> str:
    return _short_text(repr(value))


def _range_hint(loc: Loc) -> str:
    """`allowed: 1 ≤ value ≤ 1024` for a bounded numeric field (empty for anything else)."""
    parent = _model_at(loc[:-1]) if loc else None
    info = parent.model_fields.get(loc[-1]) if parent is not None and isinstance(loc[-1], str) else None
    if info is None:
        return ""
    constraints = list(info.metadata)
    for arg in typing.get_args(info.annotation):
        if typing.get_origin(arg) is typing.Annotated:
            for meta in arg.__metadata__:
                constraints.extend(getattr(meta, "metadata", [meta]))
    low = next((f"{m.ge:g} ≤ " for m in constraints if getattr(m, "ge", None) is not None), "")
    low = low or next((f"{m.gt:g} < " for m in constraints if getattr(m, "gt", None) is not None), "")
    high = next((f" ≤ {m.le:g}" for m in constraints if getattr(m, "le", None) is not None), "")
    high = high or next((f" < {m.lt:g}" for m in constraints if getattr(m, "lt", None) is not None), "")
    return f"allowed: {low}value{high}" if low or high else ""


def load_spec_text(
    text: str | bytes,
    file: str = "<spec>",
    *,
    target: str | None = None,
    overrides: list[str] | None = None,
) -> LoadResult:
    """Parse and structurally validate spec text; never raises for a user's mistake."""
    report = Report(file)
    lines = LineMap()
    if isinstance(text, bytes):
        if b"\x00" in text:
            report.add(Diagnostic("RLC004", "file is binary, not YAML text", file=file))
            return LoadResult(None, report, lines)
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            report.add(
                Diagnostic("RLC004", f"file is not UTF-8 text (byte {exc.start})", file=file, hint="save as UTF-8")
            )
            return LoadResult(None, report, lines)
    if text.startswith("\ufeff"):
        text = text[1:]
    if len(text) > MAX_SPEC_BYTES:
        report.add(Diagnostic("RLC004", f"spec is larger than {MAX_SPEC_BYTES} bytes; not a spec", file=file))
        return LoadResult(None, report, lines)
    try:
        data, lines.lines, duplicates = _bounded_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        report.add(
            Diagnostic(
                "RLC001",
                f"malformed YAML: {problem}",
                line=mark.line + 1 if mark else None,
                file=file,
                hint="check indentation, colons and quotes near this line",
            )
        )
        return LoadResult(None, report, lines)
    except YamlShapeError as exc:
        report.add(Diagnostic("RLC007", f"spec refused: {exc}", file=file, hint="write the values out plainly"))
        return LoadResult(None, report, lines)
    except RecursionError:
        report.add(Diagnostic("RLC001", "malformed YAML: nesting is too deep", file=file))
        return LoadResult(None, report, lines)
    for loc, line in duplicates:
        report.add(
            Diagnostic(
                "RLC005",
                f"key `{loc[-1]}` appears more than once; YAML keeps only the last",
                dotted(loc),
                line=line,
                file=file,
                hint="remove the duplicate",
            )
        )
    if data is None:
        report.add(Diagnostic("RLC002", "spec is empty", file=file, hint="run `rlc init` for a starter spec"))
        return LoadResult(None, report, lines)
    if not isinstance(data, dict):
        report.add(
            Diagnostic(
                "RLC003",
                f"spec must be a mapping of keys to values, got {type(data).__name__}",
                file=file,
                line=1,
                hint="start with `name: my-run` on the first line",
            )
        )
        return LoadResult(None, report, lines)
    data = {str(k): v for k, v in data.items()}
    try:
        apply_overrides(data, overrides or [])
        lines.overrides = {tuple(parse_override(text)[0]): text for text in overrides or []}
    except (ValueError, AttributeError) as exc:
        report.add(Diagnostic("RLC006", f"bad override: {exc}", file=file))
        return LoadResult(None, report, lines, data)
    if target is not None:
        data["target"] = target
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            report.add(_error_to_diagnostic(dict(error), lines, file))
        return LoadResult(None, report, lines, data, repaired=_repair(data, exc))
    except (RecursionError, TypeError) as exc:
        report.add(Diagnostic("RLC102", f"spec has an unsupported structure: {exc}", file=file))
        return LoadResult(None, report, lines, data)
    return LoadResult(spec, report, lines, data)


def _drop(data: Any, loc: Loc) -> bool:
    """Remove the value at `loc` (so its default applies); False when it cannot be removed."""
    node = data
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(node, dict) and loc and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False


def _repair(data: dict[str, Any], error: ValidationError, rounds: int = 4) -> Spec | None:
    """Drop every offending value and validate again; None when a required value is missing."""
    import copy

    repaired = copy.deepcopy(data)
    for _ in range(rounds):
        locs = [tuple(p for p in e["loc"] if not str(p).startswith("function-after")) for e in error.errors()]
        if not all(_drop(repaired, loc) for loc in locs if loc):
            return None
        try:
            return Spec.model_validate(repaired)
        except ValidationError as again:
            error = again
        except (RecursionError, TypeError):
            return None
    return None


def load_spec_file(path: str | Path, *, target: str | None = None, overrides: list[str] | None = None) -> LoadResult:
    """Read a spec file from disk; a missing or unreadable file is a diagnostic, not an exception."""
    path = Path(path)
    file = str(path)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            report = Report(file)
            report.add(Diagnostic("RLC004", f"file is larger than {MAX_SPEC_BYTES} bytes; not a spec", file=file))
            return LoadResult(None, report, LineMap())
        raw = path.read_bytes()
    except OSError as exc:
        report = Report(file)
        report.add(Diagnostic("RLC000", f"cannot read spec: {exc.strerror or exc}", file=file))
        return LoadResult(None, report, LineMap())
    return load_spec_text(raw, file, target=target, overrides=overrides)
