"""Write a compiled plan to disk: plan.json, the resolved spec, per-role engine args, launchers, summary, manifest.

The directory is the contract between `rlc compile` and `rlc run`, so it must be reproducible (same inputs →
byte-identical files: sorted keys, floats rounded to 12 significant digits, no timestamps) and never half
written: everything goes to a temporary sibling directory that is renamed into place at the end. An existing
directory is replaced only when it is an older plan (it has a manifest and nothing the manifest does not
list); anything else is refused, so a typo in `-o` cannot wipe a user's files.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

from rlc import __version__
from rlc.compiler.manifest import (
    MANIFEST,
    PLAN_FILE,
    build_manifest,
    dumps_json,
    list_files,
    read_manifest,
    sha256_bytes,
)
from rlc.compiler.node_setup import (
    RAY_PORTS,
    NodeSetup,
    PlanEmitError,
    node_setup,
)
from rlc.compiler.rayjob import render_rayjob
from rlc.compiler.resolved_spec import render_resolved_spec
from rlc.compiler.routing import plan_routing, routing_lines
from rlc.compiler.sync_lines import sync_rows
from rlc.schemas.cluster_nodes import NODE_RESOURCE_PREFIX, NODE_RESOURCE_UNITS
from rlc.schemas.plan import Plan, Role
from rlc.schemas.spec import Spec

__all__ = ["PlanDirError", "PlanEmitError", "emit_plan_dir", "render_plan_files"]

SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+:-]*$")
NODE_PORT_FLAGS = (
    "node-manager-port",
    "object-manager-port",
    "runtime-env-agent-port",
    "dashboard-agent-grpc-port",
    "dashboard-agent-listen-port",
    "metrics-export-port",
    "min-worker-port",
    "max-worker-port",
)
PREFLIGHT_MODULES = {"npu": "ray,torch,torch_npu,vllm,vllm_ascend", "gpu": "ray,torch,vllm", "cpu": "ray,torch,vllm"}


class PlanDirError(OSError):
    """The output directory cannot be (re)placed: it holds files that are not an older plan."""


class ShellSafe(str):
    """Text that may appear verbatim in launch.sh: shell-quoted, or checked to be a plain name."""


# ---------------------------------------------------------------------------------------------- formatting


def stable(value: Any) -> Any:
    """`value` with every float rounded to 12 significant digits (drops 0.1+0.2-style noise, keeps lr)."""
    if isinstance(value, float):
        return float(f"{value:.12g}")
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [stable(v) for v in value]
    return value


def json_text(data: Any) -> str:
    return dumps_json(stable(data))


def shquote(value: Any) -> ShellSafe:
    """Jinja filter: one shell word that reads back as exactly `value` (shlex.quote)."""
    return ShellSafe(shlex.quote(str(value)))


def safe_name(value: Any) -> ShellSafe:
    """Jinja filter for identifiers printed bare (env names, flags, hashes); refuses anything else."""
    text = str(value)
    if not SAFE_NAME.match(text):
        raise PlanEmitError(f"{text!r} cannot appear unquoted in launch.sh")
    return ShellSafe(text)


def _shell_finalize(value: Any) -> Any:
    """Every `{{ }}` in launch.sh must be an int or went through shquote/name: enforced, not hoped for."""
    if isinstance(value, ShellSafe) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise PlanEmitError(f"launch.sh template printed {value!r} without the shquote filter")


def _md(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _num(value: float) -> str:
    return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _ranges(ids: list[int]) -> str:
    parts: list[str] = []
    ordered = sorted(ids)
    start = prev = ordered[0] if ordered else 0
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts) if ordered else "-"


def _placement(placement: list[Any]) -> str:
    return " ".join(f"n{p.node}:{_ranges(p.local_ids)}" for p in placement) or "-"


def _share(seconds: float, total: float) -> str:
    return f"{100 * seconds / total:.0f}%" if total > 0 else "-"


@cache
def _environment(shell: bool) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("rlc.templates", ""),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        finalize=_shell_finalize if shell else None,
        # bash's ${#array[@]} would open a Jinja comment; shell templates take no comments of Jinja's own
        comment_start_string="<%#" if shell else "{#",
        comment_end_string="#%>" if shell else "#}",
    )
    env.filters.update(
        shquote=shquote,
        name=safe_name,
        names=lambda values: ShellSafe(", ".join(safe_name(v) for v in values)),
        md=_md,
        num=_num,
        gib=lambda v: f"{v:.2f}",
        secs=lambda v: f"{v:.1f}",
        share=_share,
        placement=_placement,
        compact=lambda v: _md(json.dumps(stable(v), sort_keys=True)),
    )
    return env


# ---------------------------------------------------------------------------------------------- files


def render_launch(plan: Plan, setup: NodeSetup, *, plan_hash: str, version: str = __version__) -> str:
    """launch.sh: `launch.sh head|worker [--dry-run]` for this plan's cluster."""
    required = [plan.model.path] if plan.model.path and not plan.model.build_tiny else []
    if not plan.data.builtin:
        required.append(plan.data.train)
    for teacher in plan.distill.teachers if plan.distill else []:
        if teacher.model.path:
            required.append(teacher.model.path)
    resource_args = [f"--num-gpus={setup.devices_per_node}"] if setup.uses_num_gpus else []
    device_entry = "" if setup.uses_num_gpus else f"{json.dumps(setup.ray_resource)}: {setup.devices_per_node}"
    context = {
        "version": version,
        "plan_hash": plan_hash,
        "target": plan.target,
        "kind": setup.kind,
        "nodes": setup.nodes,
        "devices_per_node": setup.devices_per_node,
        "total_devices": setup.total_devices,
        "ray_resource": setup.ray_resource,
        "resource_args": resource_args,
        "device_resource_entry": device_entry,
        "node_resource_prefix": NODE_RESOURCE_PREFIX,
        "node_resource_units": NODE_RESOURCE_UNITS,
        "preflight_modules": PREFLIGHT_MODULES[setup.kind],
        "required_paths": list(dict.fromkeys(required)),
        "run_dir": plan.run_dir,
        "submission_id": f"rlc-{plan.name}-{plan_hash[:12]}",
        "metadata_json": json.dumps(
            {"rlc_plan_hash": plan_hash, "rlc_plan_name": plan.name, "rlc_version": version}, sort_keys=True
        ),
        "ports": RAY_PORTS,
        "node_port_flags": NODE_PORT_FLAGS,
        "env": setup.env,
        "role_env_conflicts": setup.role_env_conflicts,
    }
    return _environment(True).get_template("launch.sh.j2").render(context)


def render_summary(plan: Plan, *, plan_hash: str, version: str = __version__) -> str:
    """SUMMARY.md: layout, memory item by item, step-time split, runners-up."""
    est = plan.estimates
    parts = [("rollout", est.rollout_s), ("training", est.train_s), ("weight sync", est.weight_sync_s)]
    if est.switch_s:
        parts.append(("phase switch", est.switch_s))
    if est.overhead_s:
        parts.append(("fixed per step", est.overhead_s))
    routing = plan_routing(plan)
    context = {
        "sync_rows": sync_rows(plan),
        "band": est.band,
        "plan": plan,
        "plan_hash": plan_hash,
        "routing": routing_lines(routing, why=False) if routing else [],
        "version": version,
        "step_parts": parts,
        "step_parts_total": sum(s for _, s in parts),
    }
    text = _environment(False).get_template("SUMMARY.md.j2").render(context)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


def _role_file(role: Role) -> str:
    if not SAFE_NAME.match(role.name) or "/" in role.name or role.name.startswith("."):
        raise PlanEmitError(f"role name {role.name!r} cannot be a file name")
    return f"roles/{role.name}.json"


def render_plan_files(plan: Plan, spec: Spec, *, provenance: dict[str, str]) -> dict[str, bytes]:
    """Every file of the plan directory (relative path → bytes), manifest.json included."""
    names = [r.name for r in plan.roles]
    if len(set(names)) != len(names):
        raise PlanEmitError(f"role names must be unique: {names}")
    plan_json = json_text(plan.model_dump(mode="json")).encode()
    plan_hash = sha256_bytes(plan_json)
    setup = node_setup(plan)
    files: dict[str, bytes] = {PLAN_FILE: plan_json}
    files["spec.resolved.yaml"] = render_resolved_spec(spec, plan, provenance).encode()
    for role in plan.roles:
        files[_role_file(role)] = json_text(role.engine).encode()
    files["launch.sh"] = render_launch(plan, setup, plan_hash=plan_hash).encode()
    files["SUMMARY.md"] = render_summary(plan, plan_hash=plan_hash).encode()
    every = sorted([*files, "rayjob.yaml", MANIFEST])
    files["rayjob.yaml"] = render_rayjob(plan, setup, plan_hash=plan_hash, files=every, version=__version__).encode()
    manifest = build_manifest(files, spec_hash=plan.spec_hash, plan_hash=plan_hash, format_version=plan.format_version)
    files[MANIFEST] = dumps_json(manifest).encode()
    return files


# ---------------------------------------------------------------------------------------------- writing


def _check_replaceable(out_dir: Path) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise PlanDirError(f"{out_dir} exists and is not a directory; choose another output path")
    if not any(out_dir.iterdir()):
        return
    # The manifest first: walking a folder that is no plan (`-o /`, a home directory) could take minutes.
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise PlanDirError(
            f"{out_dir} is not empty and is not an rlc plan directory (no manifest.json); refusing to overwrite "
            "it: choose another output path or remove it"
        )
    foreign = sorted(set(list_files(out_dir)) - set(manifest["files"]) - {MANIFEST})
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise PlanDirError(
            f"{out_dir} is an older plan but also holds files rlc did not write ({shown}); refusing to "
            "overwrite it: move them away or choose another output path"
        )


def emit_plan_dir(plan: Plan, spec: Spec, out_dir: Path, *, provenance: dict[str, str]) -> list[Path]:
    """Write the plan directory atomically and return its files (manifest.json last).

    Raises PlanDirError when `out_dir` holds something other than an older plan, PlanEmitError when the plan
    cannot be rendered safely.
    """
    out_dir = Path(out_dir)
    files = render_plan_files(plan, spec, provenance=provenance)
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old: Path | None = None
    try:
        order = [name for name in files if name != MANIFEST] + [MANIFEST]
        for name in order:
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(files[name])
            path.chmod(0o755 if name == "launch.sh" else 0o644)
        for folder in [staging, *(p for p in staging.rglob("*") if p.is_dir())]:
            folder.chmod(0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rmdir(old)
            os.rename(out_dir, old)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.rename(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return [out_dir / name for name in order]
