"""Time model: seconds per RL step for a layout, split into rollout, training, weight sync and switch.

The planner ranks layouts by trained tokens per second, so the model only has to order layouts correctly
and land in the right range; it is a roofline (max of bytes over bandwidth and FLOPs over peak, each scaled by
the target's measured efficiency) plus explicit communication terms. Every formula names its source; the
fixed assumptions (response length, overlap, latencies) are module constants with a stated reason.
Pure functions only.

The model is a package of one idea per module: `workload`, `links`, `overheads`, `rollout`, `train`, `step`,
`weight_sync`.
"""

from __future__ import annotations

from rlc.compiler.cost.links import COLLECTIVE_LATENCY_S, EP_WIDTH_BANDWIDTH, NET_HOP_LATENCY_S, ep_width_bandwidth  # noqa: F401
from rlc.compiler.cost.overheads import (  # noqa: F401
    AGENT_CALL_OVERHEAD_S,
    DECODE_SEQUENCE_OVERHEAD_S,
    DECODE_STEP_OVERHEAD_S,
    EAGER_LAYER_LAUNCH_S,
    HOST_OVERLAPS_DEVICE,
    KIND_DEFAULTS,
    agent_call_overhead_s,
    decode_sequence_overhead_s,
    decode_step_overhead_s,
    eager_launch_s,
    efficiency,
)
from rlc.compiler.cost.rollout import (  # noqa: F401
    SAMPLER_PASSES,
    STREAM_OVERFILL,
    STREAM_REQUEST_PROMPTS,
    TAIL_CONCURRENCY_FRACTION,
    RolloutTime,
    agent_rollout_s,
    decode_attention_flops,
    decode_step_s,
    decoding_share,
    engine_inflight_requests,
    interrupt_s,
    rollout_time,
)
from rlc.compiler.cost.step import (  # noqa: F401
    ENGINE_CYCLE_S,
    StepTime,
    engine_offload_s,
    step_time,
    switch_s,
    teacher_time_s,
)
from rlc.compiler.cost.train import (  # noqa: F401
    DP_OVERLAP,
    HOST_ADAM_PARAMS_PER_S,
    TrainTime,
    expert_gemm_efficiency,
    train_compute_s,
    train_flops,
    train_mfu,
    train_time,
)
from rlc.compiler.cost.weight_sync import (  # noqa: F401
    SYNC_TIE,
    WEIGHT_SYNC_DISK_GBPS,
    WEIGHT_SYNC_HOST_SHARE,
    WEIGHT_SYNC_LINK_SHARE,
    SyncOption,
    SyncShape,
    adapter_option,
    bound_shape,
    engine_weight_share,
    max_senders,
    pick,
    priced_options,
    sync_figure,
    sync_seconds,
    worker_bytes,
)
from rlc.compiler.cost.workload import (  # noqa: F401
    EULER_GAMMA,
    PROMPT_FRACTION,
    RESPONSE_FRACTION,
    TURNS_FRACTION,
    AgentWork,
    Workload,
    accepted_tokens_per_step,
    agent_work,
    expected_longest_response,
    workload,
)
