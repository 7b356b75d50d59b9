"""rlc's worker extension for a test engine whose vLLM workers run in processes of their own (TP > 1) and keep their
weights: importing this module in a worker (vLLM imports the extension before it builds the model) takes the plan's
cpu GEMM choice there too, so the tp-sliced sync copies shards straight into the parameters. The engine's front-end
process takes the choice (`engine_setup`), but vLLM spawns its workers afresh inside a Ray actor, and rlc's own
extension does not apply it there: those workers pack their weights for oneDNN and every update is a reload."""

from __future__ import annotations

import os

from rlc.runtime.rollout.cpu_gemm import apply_cpu_gemm_choice
from rlc.runtime.rollout.weight_sync import WeightSyncExtension

__all__ = ["KeptWeightsExtension"]

apply_cpu_gemm_choice()


class KeptWeightsExtension(WeightSyncExtension):
    """`WeightSyncExtension`, imported where the cpu GEMM choice has been applied."""

    def rlc_test_set_gemm(self, value: str) -> None:
        """Set this worker's ``RLC_VLLM_CPU_GEMM``: ``onednn`` makes `cpu_gemm.keeps_weights` false, so a sync takes
        vLLM's reload (the kernels stay torch's: the choice was applied at start-up)."""
        os.environ["RLC_VLLM_CPU_GEMM"] = value
