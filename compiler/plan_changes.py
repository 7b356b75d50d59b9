"""What a hand edit changed in a plan directory, for `rlc run --allow-modified` to print before it runs.

`rlc run` reads only plan.json, so for it the answer is value by value (the manifest keeps the compiled plan
to compare with); for every other file it is that the file changed or was added, which the run does not read.
"""

from __future__ import annotations

from pathlib import Path

from rlc.compiler.manifest import MANIFEST, PLAN_FILE, list_files, read_manifest, sha256_file
from rlc.messages import first_line

#: Lines shown for plan.json before the rest is summarised.
MAX_LINES = 60


def plan_json_changes(plan_dir: Path, compiled: object) -> list[str]:
    """What differs between plan.json and `compiled` (the manifest's copy of the plan as compiled), one line each,
    through the plan diff `rlc diff` shows."""
    from pydantic import ValidationError

    from rlc.compiler.diff import change_text, diff_plans
    from rlc.schemas.plan import Plan

    try:
        before = Plan.model_validate(compiled)
    except ValidationError:
        return [f"{PLAN_FILE}: changed (the manifest's copy of the compiled plan is unreadable)"]
    try:
        after = Plan.model_validate_json((plan_dir / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{PLAN_FILE}: no longer a valid plan ({first_line(exc)})"]
    changes = diff_plans(before, after)
    if not changes:
        return [f"{PLAN_FILE}: reformatted; every value is as compiled"]
    lines = [f"{PLAN_FILE}: {change_text(c)}" for c in changes]
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"{PLAN_FILE}: ... and {len(lines) - MAX_LINES} more change(s)"]
    return lines


def describe_modifications(plan_dir: Path) -> list[str]:
    """One line per change against the manifest: plan.json value by value, other files by name."""
    manifest = read_manifest(plan_dir)
    if manifest is None:
        return []
    listed: dict[str, str] = {str(k): str(v) for k, v in manifest["files"].items()}
    present = set(list_files(plan_dir)) - {MANIFEST}
    lines: list[str] = []
    for name in sorted(listed.keys() & present):
        if sha256_file(plan_dir / name) == listed[name]:
            continue
        if name == PLAN_FILE and "compiled_plan" in manifest:
            lines.extend(plan_json_changes(plan_dir, manifest["compiled_plan"]))
        elif name == PLAN_FILE:
            lines.append(f"{PLAN_FILE}: changed (this plan predates value-by-value reports; recompile to see them)")
        else:
            lines.append(f"{name}: changed; rlc run does not read it")
    for name in sorted(present - listed.keys()):
        lines.append(f"{name}: added; rlc run does not read it")
    return lines
