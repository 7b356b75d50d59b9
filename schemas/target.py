"""Hardware targets: the data-file contract for `schemas/targets/*.yaml`.

A target says what one device is (memory the runtime can really allocate, peak compute, link bandwidths),
how devices group on a node, and how the runtime must address them (Ray resource name, visible-devices
variable, collective backend, torch device). The memory and cost models read nothing else about the
hardware, so every number carries a source or an uncertainty note, enforced by a validator.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0.0)]
Fraction = Annotated[float, Field(gt=0.0, le=1.0)]


def numeric_field_names(model: type[BaseModel], prefix: str = "", nested: bool = True) -> list[str]:
    """Dotted names of the int/float fields of `model` (optional ones too), descending into nested models."""
    names: list[str] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if nested:
                names.extend(numeric_field_names(annotation, f"{prefix}{name}."))
            continue
        args = typing.get_args(annotation) or (annotation,)
        if any(arg in (int, float) for arg in args):
            names.append(prefix + name)
    return names


class Efficiency(BaseModel):
    """Achieved fractions of peak, so the cost model turns peaks into time estimates."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    train_mfu: Fraction = Field(description="Fraction of bf16_tflops achieved by training (model FLOPs utilisation).")
    moe_train_ratio: Fraction = Field(
        1.0,
        description=(
            "A mixture-of-experts model's training MFU as a fraction of train_mfu (routing, token permutation and "
            "grouped expert GEMMs run below a dense layer's efficiency)."
        ),
    )
    linear_attention_train_ratio: Fraction = Field(
        1.0,
        description=(
            "A Gated-DeltaNet hybrid's training MFU as a fraction of train_mfu (the chunked delta rule and the "
            "causal conv run below a dense layer's efficiency; far below on cpu, whose kernels are torch's)."
        ),
    )
    prefill_mfu: Fraction = Field(description="Fraction of bf16_tflops achieved by rollout prefill.")
    decode_bandwidth_efficiency: Fraction = Field(
        description="Fraction of hbm_bandwidth_gbps achieved by memory-bound decode (weights + KV reads)."
    )
    collective_efficiency: Fraction = Field(
        description="Fraction of link bandwidth achieved as collective bus bandwidth (all-reduce, broadcast)."
    )
    step_overhead_s: float = Field(
        0.0, ge=0.0, description="Fixed seconds per RL step beside the modelled phases (controller, rewards, Python)."
    )
    micro_batch_overhead_s: float = Field(
        0.0, ge=0.0, description="Fixed seconds per trainer pass over one micro-batch (launches, packing, Python)."
    )
    weight_sync_overhead_s: float = Field(
        0.0, ge=0.0, description="Fixed seconds per weight sync (RPCs to every engine, group set-up, barriers)."
    )
    weight_reload_gbps: PositiveFloat = Field(
        1000.0, description="Rate at which an engine takes in new weights (reload_weights: copies, repacking), GB/s."
    )
    decode_step_overhead_s: float | None = Field(
        None,
        ge=0.0,
        description="Host seconds per engine step (scheduling, sampling, output handling); unset: the cost model's "
        "default for the target's kind.",
    )
    decode_sequence_overhead_s: float | None = Field(
        None,
        ge=0.0,
        description="Host seconds per running sequence per engine step (per-request bookkeeping on hosts where "
        "it shows); unset: the cost model's default for the target's kind.",
    )
    agent_call_overhead_s: float | None = Field(
        None,
        ge=0.0,
        description="Host seconds per agent model call (the engine's OpenAI endpoint and the agent's client, one "
        "call at a time); unset: the cost model's default for the target's kind.",
    )
    weight_sync_link_share: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Share of a device's link (intra-node, scale-out) one weight-sync sender or receiver achieves "
        "per byte, buckets and their round trips included; unset: the cost model's default for the target's kind.",
    )
    weight_sync_host_share: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Share of host_to_device_bandwidth_gbps a colocated weight sync achieves staging weights "
        "through host memory (/dev/shm files, shared memory); unset: the cost model's default for the kind.",
    )
    weight_sync_disk_gbps: float | None = Field(
        None,
        gt=0.0,
        description="Rate a disk weight sync writes and reads its safetensors folder, GB/s; unset: the cost "
        "model's default for the target's kind.",
    )


#: Efficiencies a profile may leave unset (the cost model's default for the target's kind applies).
OPTIONAL_EFFICIENCIES = tuple(name for name, f in Efficiency.model_fields.items() if f.default is None)


class Determinism(BaseModel):
    """The platform's switches that make kernels give the same result run after run, and what they cost.

    `rlc compile` puts `env` into the plan's environment and has trainer ranks call
    `torch.use_deterministic_algorithms(True)` when a plan turns deterministic kernels on (the spec's
    `algorithm.deterministic`, or `auto` where `auto_on` says they are free).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: dict[str, str] = Field(
        default_factory=dict, description="Environment for every process while deterministic kernels are on."
    )
    torch_deterministic: bool = Field(
        False, description="Trainer ranks call torch.use_deterministic_algorithms(True) (warn_only=False)."
    )
    auto_on: bool = Field(False, description="`algorithm.deterministic: auto` turns the switches on here.")
    cost: str = Field(
        "unknown: this profile names no deterministic switches",
        description="What the switches cost in step time and where that figure comes from.",
    )
    caveats: list[str] = Field(
        default_factory=list, description="What the switches need or do not cover on this target."
    )


class TargetProfile(BaseModel):
    """One hardware target: a device and the node it sits in."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Target name used in specs (`target: a3`); equals the file name without .yaml.")
    description: str = Field(description="Human-readable product name and what one device means here.")
    kind: Literal["npu", "gpu", "cpu"] = Field(description="Device family; selects the runtime platform adapter.")
    chip: str = Field(description="Chip name, e.g. Ascend 910B, Ascend 910C (per die), H100 SXM.")
    soc_names: list[str] = Field(
        default_factory=list,
        description="SoC / product names the runtime may report (acl.get_soc_name, torch device name) for detection.",
    )
    devices_per_node: PositiveInt = Field(
        description="Devices the runtime sees per node (torch_npu devices: A2 chips, A3 dies; GPUs; CPU workers)."
    )
    hbm_gib: PositiveFloat = Field(description="Device memory per device, GiB (physical).")
    usable_hbm_gib: PositiveFloat = Field(
        description="Memory per device the runtime can actually allocate (torch total capacity), GiB."
    )
    reserve_gib: float = Field(
        ge=0.0,
        description=(
            "Per-device memory to keep free for communication buffers, allocator fragmentation and runtime "
            "workspaces, GiB; the planner budgets usable_hbm_gib − reserve_gib."
        ),
    )
    sync_group_gib: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Device memory one more collective group holds on a rank that joins it, GiB: what the trainer rank "
            "that broadcasts new weights (and each engine worker that receives them) keeps for the weight-sync "
            "group beside its other groups."
        ),
    )
    allocator_overhead: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "Share the device's caching allocator reserves beyond what is allocated (fragmentation), as a fraction "
            "of the allocated bytes; the planner keeps it free on every trainer device (the `margin` item)."
        ),
    )
    bf16_tflops: PositiveFloat = Field(description="Dense peak bf16 TFLOPS per device (no sparsity).")
    hbm_bandwidth_gbps: PositiveFloat = Field(description="Device memory bandwidth per device, GB/s.")
    intra_node_bandwidth_gbps: PositiveFloat = Field(
        description="Per-device bandwidth to other devices in the node (HCCS, NVLink), GB/s, one direction."
    )
    inter_node_bandwidth_gbps: PositiveFloat = Field(
        description="Per-device scale-out bandwidth to other nodes (RoCE, InfiniBand), GB/s, one direction."
    )
    host_memory_gib: PositiveFloat = Field(description="Host RAM per node, GiB (bounds offloaded states).")
    host_to_device_bandwidth_gbps: PositiveFloat = Field(
        description="Effective host↔device copy bandwidth per device, GB/s (offload and reload timing)."
    )
    device_group_size: PositiveInt = Field(
        1,
        description=(
            "Allocation granule: device counts per node must be multiples of it (2 on A3, whose dies come in "
            "pairs on one package; 1 elsewhere)."
        ),
    )
    ray_resource: str = Field(
        description="Ray resource name a device is requested by: NPU, GPU, or a logical name for cpu workers."
    )
    visible_devices_env: str = Field(
        description="Environment variable that masks visible devices (ASCEND_RT_VISIBLE_DEVICES, ...); '' if none."
    )
    collective_backend: Literal["hccl", "nccl", "gloo"] = Field(
        description="torch.distributed backend for collectives between devices."
    )
    torch_device: Literal["npu", "cuda", "cpu"] = Field(description="torch device type string.")
    efficiency: Efficiency = Field(description="Achieved fractions of the peaks above, for the cost model.")
    estimate_uncertainty: float = Field(
        1.5,
        ge=1.0,
        description="Factor by which measured step times may exceed the estimate, and fall short of it unless "
        "estimate_uncertainty_fast says otherwise (the band explain shows).",
    )
    estimate_uncertainty_fast: float | None = Field(
        None,
        ge=1.0,
        description="Factor by which measured step times may fall short of the estimate; unset: "
        "estimate_uncertainty (a symmetric band). Published runs mostly take longer than estimated, so the two "
        "sides of the evidence differ.",
    )
    calibration: dict[str, str] = Field(
        default_factory=dict,
        description="Where a calibrated profile came from (`rlc calibrate`): base profile, runs, fitted fields.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Default runtime environment for every process on this target; plans may override entries.",
    )
    determinism: Determinism = Field(
        default_factory=Determinism, description="Deterministic-kernel switches and their cost on this target."
    )
    sources: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Field name (dotted for nested fields) -> source citation or uncertainty note. Every numeric field "
            "has an entry."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> TargetProfile:
        # An optional efficiency left unset (in a profile written before it existed, say) takes the cost model's
        # default for the kind, which is its source.
        unset = {f"efficiency.{n}" for n in OPTIONAL_EFFICIENCIES if getattr(self.efficiency, n) is None}
        missing = [n for n in numeric_field_names(type(self)) if n not in self.sources and n not in unset]
        if missing:
            raise ValueError(f"sources has no entry for {', '.join(missing)}")
        known = set(type(self).model_fields) | set(numeric_field_names(type(self)))
        unknown = sorted(key for key in self.sources if key not in known)
        if unknown:
            raise ValueError(f"sources names unknown fields: {', '.join(unknown)}")
        empty = sorted(key for key, text in self.sources.items() if not text.strip())
        if empty:
            raise ValueError(f"sources entries are empty: {', '.join(empty)}")
        if self.usable_hbm_gib > self.hbm_gib:
            raise ValueError(f"usable_hbm_gib {self.usable_hbm_gib} exceeds hbm_gib {self.hbm_gib}")
        if self.reserve_gib >= self.usable_hbm_gib:
            raise ValueError(f"reserve_gib {self.reserve_gib} leaves nothing of usable_hbm_gib")
        if self.devices_per_node % self.device_group_size:
            raise ValueError(
                f"devices_per_node {self.devices_per_node} is not a multiple of "
                f"device_group_size {self.device_group_size}"
            )
        expected = {"npu": ("hccl", "npu"), "gpu": ("nccl", "cuda"), "cpu": ("gloo", "cpu")}[self.kind]
        if (self.collective_backend, self.torch_device) != expected:
            raise ValueError(
                f"kind {self.kind!r} expects collective_backend {expected[0]!r} and torch_device "
                f"{expected[1]!r}, got {self.collective_backend!r} and {self.torch_device!r}"
            )
        return self

    @property
    def uncertainty_below(self) -> float:
        """The factor measured step times may fall short of the estimate by (estimate_uncertainty when unset)."""
        return self.estimate_uncertainty_fast or self.estimate_uncertainty

    @property
    def budget_gib(self) -> float:
        """Per-device memory the planner may fill: usable_hbm_gib − reserve_gib."""
        return self.usable_hbm_gib - self.reserve_gib
