"""Resolve a spec against the data files: the hardware target and the model architectures it names.

The result (`Problem`) is what rules and the planner reason about. Unknown names become diagnostics with a
did-you-mean, never exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.load import LineMap
from rlc.schemas.arch import AttentionArch, ModelArch, MoeArch
from rlc.schemas.registry import UnknownNameError, load_arch, load_target
from rlc.schemas.spec import TARGET_NAMES, InlineArch, ModelRef, Spec
from rlc.schemas.target import TargetProfile


@dataclass
class Problem:
    """A spec with everything it refers to looked up: what the rules and the planner work on."""

    spec: Spec
    target: TargetProfile
    arch: ModelArch
    teacher_archs: dict[str, ModelArch] = field(default_factory=dict)
    #: Where the target profile came from: `shipped`, or the --targets / RLC_TARGETS directory.
    profile_source: str = "shipped"

    @property
    def devices_per_node(self) -> int:
        return self.spec.cluster.devices_per_node or self.target.devices_per_node

    @property
    def total_devices(self) -> int:
        return self.spec.cluster.nodes * self.devices_per_node


def arch_from_inline(name: str, inline: InlineArch) -> ModelArch:
    """Turn an inline `arch:` block into a catalog-shaped architecture (parameter counts computed)."""
    head_dim = inline.head_dim or inline.hidden_size // inline.num_attention_heads
    moe = None
    if inline.moe is not None:
        moe = inline.moe.model_dump()
    fields = {
        "id": name,
        "family": "inline",
        "hf_architecture": "unknown",
        "num_layers": inline.num_layers,
        "hidden_size": inline.hidden_size,
        "num_attention_heads": inline.num_attention_heads,
        "num_kv_heads": inline.num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inline.intermediate_size,
        "vocab_size": inline.vocab_size,
        "tie_word_embeddings": inline.tie_word_embeddings,
        "max_position_embeddings": inline.max_position_embeddings,
        "mtp_layers": inline.mtp_layers,
        "moe": moe,
    }
    draft = ModelArch.model_construct(
        **{**fields, "moe": MoeArch(**moe) if moe else None},
        aliases=[],
        attention=AttentionArch(),
        original_max_position_embeddings=None,
        rope_scaling_max_factor=1.0,
        params_b=1.0,
        active_params_b=1.0,
        dtype="bfloat16",
        sources={},
    )
    fields["params_b"] = draft.total_params() / 1e9
    fields["active_params_b"] = draft.active_params() / 1e9
    fields["sources"] = {name: "inline arch block in the spec" for name in ModelArch.model_fields}
    return ModelArch.model_validate(fields)


def resolve_model(ref: ModelRef, path: str, lines: LineMap, file: str) -> tuple[ModelArch | None, list[Diagnostic]]:
    """Look up a model reference; an unknown catalog id is a diagnostic with a did-you-mean."""
    if ref.arch is not None:
        try:
            return arch_from_inline(ref.name or "inline", ref.arch), []
        except ValueError as exc:
            return None, [
                Diagnostic(
                    "RLC106",
                    f"inline arch is inconsistent: {exc}",
                    f"{path}.arch",
                    line=lines.line_for(f"{path}.arch"),
                    file=file,
                )
            ]
    assert ref.name is not None
    try:
        return load_arch(ref.name), []
    except UnknownNameError as exc:
        hint = (
            f"did you mean `{exc.suggestions[0]}`?"
            if exc.suggestions
            else "run `rlc models` for the catalog, or give an inline `arch:` block"
        )
        return None, [
            Diagnostic(
                "RLC105",
                f"unknown model `{ref.name}`",
                f"{path}.name",
                hint=hint,
                line=lines.line_for(f"{path}.name"),
                file=file,
            )
        ]


def with_device_memory(target: TargetProfile, budget_gib: float | None) -> TargetProfile:
    """The target with `cluster.device_memory_gib` as its usable memory per device.

    On cpu the budget is a convention (each worker process's slice of host RAM), so it may grow or shrink;
    on accelerators it can only lower what the device offers (rule RLC214 reports a larger value).
    """
    if budget_gib is None:
        return target
    usable = budget_gib if target.kind == "cpu" else min(budget_gib, target.usable_hbm_gib)
    return target.model_copy(update={"usable_hbm_gib": usable, "hbm_gib": max(target.hbm_gib, usable)})


def resolve(
    spec: Spec, lines: LineMap, file: str, targets: Sequence[Path] | None = None
) -> tuple[Problem | None, list[Diagnostic]]:
    """Look up the target (in the `targets` profile directories first) and every model; report all unknown
    names and unreadable profiles at once."""
    found: list[Diagnostic] = []
    target: TargetProfile | None = None
    source = "shipped"
    if spec.target is None:
        found.append(
            Diagnostic(
                "RLC107",
                "no hardware target: set `target:` in the spec or pass --target",
                "target",
                hint=f"one of {', '.join(TARGET_NAMES)}",
                line=1,
                file=file,
            )
        )
    else:
        from rlc.schemas.profiles import ProfileError, find_target, target_dirs

        try:
            loaded, source = find_target(spec.target, target_dirs(targets))
        except ProfileError as exc:
            found.append(Diagnostic("RLC108", str(exc), "target", line=lines.line_for("target"), file=file))
            loaded = load_target(spec.target)
        target = with_device_memory(loaded, spec.cluster.device_memory_gib)
        if spec.cluster.memory_margin is not None:
            target = target.model_copy(update={"allocator_overhead": spec.cluster.memory_margin})
    arch, problems = resolve_model(spec.model, "model", lines, file)
    found.extend(problems)
    teachers: dict[str, ModelArch] = {}
    for index, teacher in enumerate(spec.distill.teachers if spec.distill else []):
        teacher_arch, problems = resolve_model(teacher.model, f"distill.teachers.{index}.model", lines, file)
        found.extend(problems)
        if teacher_arch is not None:
            teachers[teacher.name] = teacher_arch
    if target is None or arch is None or found:
        return None, found
    return Problem(spec=spec, target=target, arch=arch, teacher_archs=teachers, profile_source=source), found
