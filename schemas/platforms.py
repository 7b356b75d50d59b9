"""What each accelerator platform a plan names implies: torch device type, collective backend, the variable that
masks visible devices, vLLM's sleep mode and dtype. One table, read by the runtime's `platform.Platform` (which
adds the device operations) and by the launch request the dry run prints, so neither keeps its own copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PLATFORM_FACTS", "PlatformFacts", "PlatformName"]

PlatformName = Literal["cpu", "cuda", "npu"]


@dataclass(frozen=True)
class PlatformFacts:
    """Static facts about one accelerator kind; cheap to create and safe to pickle into Ray actors."""

    name: PlatformName
    device_type: str
    """torch device type: ``cpu``, ``cuda`` or ``npu``."""
    dist_backend: str
    """torch.distributed backend for trainer groups and weight sync: gloo, nccl or hccl."""
    visible_devices_env: str | None
    """Env var that restricts which devices a process sees (None on cpu, where workers are processes)."""
    supports_sleep_mode: bool
    """vLLM's sleep/wake_up (offload weights, drop KV cache); refused by vLLM on cpu."""
    vllm_dtype: str
    """dtype for vLLM engines and trainer weights: bf16 kernels die with SIGILL on these CPUs."""


PLATFORM_FACTS: dict[str, PlatformFacts] = {
    "cpu": PlatformFacts("cpu", "cpu", "gloo", None, False, "float32"),
    "cuda": PlatformFacts("cuda", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", True, "bfloat16"),
    "npu": PlatformFacts("npu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", True, "bfloat16"),
}
