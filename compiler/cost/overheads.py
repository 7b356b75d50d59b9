"""Per-kind fixed costs and efficiencies: decode-step and per-sequence host time, eager launches, agent calls; a
target profile's measured value wins over the kind's default."""

from __future__ import annotations

from rlc.compiler.cost.weight_sync import SYNC_FIGURES
from rlc.compiler.memory import ModelSizes
from rlc.schemas.target import TargetProfile

__all__ = [
    "AGENT_CALL_OVERHEAD_S",
    "DECODE_SEQUENCE_OVERHEAD_S",
    "DECODE_STEP_OVERHEAD_S",
    "EAGER_LAYER_LAUNCH_S",
    "HOST_OVERLAPS_DEVICE",
    "KIND_DEFAULTS",
    "agent_call_overhead_s",
    "decode_sequence_overhead_s",
    "decode_step_overhead_s",
    "eager_launch_s",
    "efficiency",
]

#: Fixed per-decode-step cost of the engine (scheduler, sampling, kernel launches in eager mode), seconds.
#: cpu: measured 4 ms (the quickstart engine generating 4 tokens for 8 sequences, less their sequence cost).
DECODE_STEP_OVERHEAD_S = {"npu": 4e-3, "gpu": 2e-3, "cpu": 4e-3}
#: Host time to launch one decoder layer's kernels in an eager engine (vLLM enforce_eager, no graph capture),
#: seconds, for a dense and for an MoE layer. Launches run ahead of the device on an asynchronous queue, so an
#: eager decode step takes max(device time, layers × launch time): small models at small batches are host-bound.
#: npu, MoE: 1.86 ms, the published eager − graph difference of vllm-ascend issue 7723 (Qwen3-Coder-480B-A35B
#: W8A8, 62 layers, one request: 171 ms eager vs 55.6 ms FULL_DECODE_ONLY TPOT). gpu, dense: 0.34 ms, the
#: published difference of vllm-omni issue 7960 (Qwen2.5-Omni-7B thinker on A800, 28 layers: ~22.5 ms eager vs
#: ~13 ms CUDA-graph TPOT). npu, dense: 1.11 ms, a floor from verl issue 6747 (Qwen2.5-0.5B GRPO on one 910B,
#: verl 0.7.1 with vllm-ascend in its default graph mode, 16 samples capped at 1,024 response tokens: 31.27 s
#: of generation, so at least 31.27 s / 1,024 = 30.5 ms per decode step; less DECODE_STEP_OVERHEAD_S over its
#: 24 layers). An eager engine launches at least what a piecewise graph engine launches, so its per-layer host
#: time is no lower. [estimate] gpu MoE scales by kernels per layer: a dense vLLM decoder layer launches ~12
#: (two norms, QKV, rotary, cache write, attention, O, gate-up, activation, down, two TP all-reduces), a
#: quantised MoE layer ~33 (router, top-k, token permutation, grouped GEMMs with their quantisation,
#: un-permutation, shared expert): 0.34 · 33/12. cpu: 0 (its engines always run eager and
#: DECODE_STEP_OVERHEAD_S / DECODE_SEQUENCE_OVERHEAD_S were measured that way).
EAGER_LAYER_LAUNCH_S = {
    "npu": {"dense": (31.27 / 1024 - DECODE_STEP_OVERHEAD_S["npu"]) / 24, "moe": 1.86e-3},
    "gpu": {"dense": 0.34e-3, "moe": 0.34e-3 * 33 / 12},
    "cpu": {"dense": 0.0, "moe": 0.0},
}
#: Host-side cost per sequence per decode step in the engine's own process (scheduling, sampler bookkeeping,
#: output processing), which tensor parallelism does not split. cpu: measured 0.23 ms with the quickstart
#: model (vLLM generate of 4 tokens for 8 vs 128 sequences, TP 1 and TP 2 alike). [estimate] accelerators: the
#: same Python path (vLLM's scheduler and output processor; vllm-ascend adds no host work per sequence of its
#: own) on host cores of about this machine's single-thread speed (Kunpeng 920 on Atlas 800T A2/A3, Xeon on
#: DGX hosts), so the cpu figure; `rlc calibrate` fits it from a run. On accelerators it overlaps the device's
#: step (`HOST_OVERLAPS_DEVICE`), so it only shows where c sequences' host work outlasts the device's step.
#: gpu: 0, bounded by data: with 0.23 ms the NeMo-RL v0.3 per-phase generation timings (the GPU fit runs of
#: benchmarks/published_runs.yaml) cannot be met at any decode efficiency (benchmarks/fit_gpu_efficiency.py
#: then prices Llama-3.1-8B's generation 1.39x slow), so a DGX host's per-sequence work stays inside the
#: fitted decode efficiency.
DECODE_SEQUENCE_OVERHEAD_S = {"npu": 0.23e-3, "gpu": 0.0, "cpu": 0.23e-3}
#: Whether an engine's per-sequence host work runs beside the device's step rather than after it. Accelerators:
#: vLLM V1 splits the engine core (scheduling, the device step) from output processing in the front-end
#: process and queues device work asynchronously, so one step's host work overlaps the device's:
#: step = max(device, c × per-sequence cost). cpu: the host is the device, so they add (what was measured).
HOST_OVERLAPS_DEVICE = {"npu": True, "gpu": True, "cpu": False}
#: Host seconds one agent model call costs beyond the engine's decode work: the OpenAI-compatible endpoint in
#: the engine's actor (HTTP, rlc's session router, chat template, tokenization, detokenization, recording) and
#: the agent's `openai` client. Both run on Python event loops that take calls one at a time, so an engine
#: serving n calls in a turn round pays about n times this beside its decode steps (`agent_rollout_s`).
#: cpu: measured 8 ms, the central value of benchmarks/agent_call_cost.py over three runs on a two-core machine
#: (the slope over n of the wall time of n concurrent one-token chat calls on examples/cpu-agent.yaml's engine:
#: 7.2, 8.4 and 11.8 ms; about 4 ms of it the engine actor's CPU, 5 ms the clients'). [estimate] accelerators:
#: the same Python path on a server's faster host cores; not measured, `rlc calibrate` fits it from an agent run.
AGENT_CALL_OVERHEAD_S = {"npu": 2e-3, "gpu": 2e-3, "cpu": 8e-3}
#: Figures a profile may leave unset, each with its default per target kind (the host overheads above and the
#: weight-sync rates, `weight_sync.SYNC_FIGURES`).
KIND_DEFAULTS = {
    "decode_step_overhead_s": DECODE_STEP_OVERHEAD_S,
    "decode_sequence_overhead_s": DECODE_SEQUENCE_OVERHEAD_S,
    "agent_call_overhead_s": AGENT_CALL_OVERHEAD_S,
    **SYNC_FIGURES,
}


def efficiency(target: TargetProfile, name: str) -> float:
    """An efficiency as the cost model reads it: the profile's (e.g. `rlc calibrate`'s fit), else for a host
    overhead the profile leaves unset its kind's default (KIND_DEFAULTS)."""
    value = getattr(target.efficiency, name)
    return KIND_DEFAULTS[name][target.kind] if value is None else float(value)


def agent_call_overhead_s(target: TargetProfile) -> float:
    """Host seconds per agent model call."""
    return efficiency(target, "agent_call_overhead_s")


def decode_step_overhead_s(target: TargetProfile) -> float:
    """Host seconds per engine step."""
    return efficiency(target, "decode_step_overhead_s")


def decode_sequence_overhead_s(target: TargetProfile) -> float:
    """Host seconds per sequence per engine step."""
    return efficiency(target, "decode_sequence_overhead_s")


def eager_launch_s(sizes: ModelSizes, target: TargetProfile) -> float:
    """Host time to launch one eager decode step's kernels: Σ over layers of EAGER_LAYER_LAUNCH_S (dense layers
    and MoE layers at their own rates). The step takes at least this long however little the device does."""
    arch = sizes.arch
    rates = EAGER_LAYER_LAUNCH_S[target.kind]
    moe_layers = 0 if arch.moe is None else arch.num_layers - arch.moe.first_dense_layers
    return (arch.num_layers - moe_layers) * rates["dense"] + moe_layers * rates["moe"]
