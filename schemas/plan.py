"""The plan: what the compiler decides and the runtime obeys.

Fully explicit: every role with its devices, parallel degrees, engine arguments, memory estimate item by item
and time estimate; the schedule; and every algorithm setting the runtime needs. The runtime reads nothing
else — never the spec, never a default of its own that the plan could have fixed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .layout import TrainLayout

#: 2: train roles carry a typed `layout`, every role its Ray placement (`ray`), the plan its `runtime_gaps`.
PLAN_FORMAT_VERSION = 3

#: Steps in a row whose update a non-finite loss or gradient norm skipped before the run stops
#: (`Schedule.max_nonfinite_steps`, for compiled plans and older plans alike): one such step is an accident of a batch
#: (an outlier reward, a rare overflow) and costs only its update; several in a row mean the policy or its inputs are
#: broken, and more skipped steps cost time.
MAX_NONFINITE_STEPS = 3

#: What `rlc run` executes of the weight-sync contract (`Schedule.weight_sync*`): the methods, plus "senders"
#: (weight_sync_senders > 1) and "tp_slicing" (weight_sync_slicing "tp"). The planner prices every variant and
#: picks only among these; the others are stated in the plan as priced but not executable. Widen it when the
#: runtime lands a path.
WEIGHT_SYNC_EXECUTABLE: frozenset[str] = frozenset(
    {"broadcast", "disk", "inplace", "shared_memory", "senders", "tp_slicing"}
)
#: With `weight_sync_slicing: tp`, which parts of a model the runtime cuts into tensor-parallel shards, per vLLM model
#: class (the catalog's `hf_architecture`): "dense" (attention, dense MLP, embedding and head) and "experts" (the
#: routed experts of an engine of TP alone; an engine with EP > 1 or attention DP always gets them whole). Every
#: other part, and every part of a class not listed, travels whole. Widen it with the runtime's verified classes.
WEIGHT_SYNC_TP_SLICES: dict[str, frozenset[str]] = {"Qwen3ForCausalLM": frozenset({"dense"})}

RoleKind = Literal["train", "rollout", "teacher", "reward", "environments"]


class PlanModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class NodeDevices(PlanModel):
    node: int = Field(description="Node index, 0 is the head.")
    local_ids: list[int] = Field(description="Device ids on that node (ASCEND_RT_VISIBLE_DEVICES numbering).")


class Parallel(PlanModel):
    tp: int = Field(1, description="Tensor parallel degree.")
    pp: int = Field(1, description="Pipeline parallel degree.")
    cp: int = Field(1, description="Context parallel degree.")
    ep: int = Field(1, description="Expert parallel degree.")
    dp: int = Field(1, description="Data parallel degree (for rollout: engine replicas).")


class Memory(PlanModel):
    items: dict[str, float] = Field(description="GiB per device by item (weights, grads, optimizer, ...).")
    total_gib: float = Field(description="Sum of the items.")
    capacity_gib: float = Field(description="Usable device memory minus the safety margin.")
    phase: str = Field("steady", description="Which phase this peak belongs to (train, rollout, steady).")


class RayPlacement(PlanModel):
    """How `rlc run` places one role's processes on Ray, fixed by the compiler so the runtime derives nothing.

    Roles that share devices (a colocated trainer and its engines) name the same placement group with the
    same bundles, and each takes its `actor_resources` share of a device's logical resource.
    """

    placement_group: str = Field(description="Placement group name; roles sharing devices share one group.")
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = Field("PACK", description="Ray placement strategy.")
    bundles: list[dict[str, float]] = Field(description="The group's bundles in order (a device or an engine).")
    bundle_indices: list[int] = Field(description="The bundle of each actor of this role (rank or engine order).")
    actor_resources: dict[str, float] = Field(description="What each actor of this role takes from its bundle.")
    reference_resources: dict[str, float] | None = Field(
        None,
        description="Train roles with a separate KL reference policy: what each reference rank (one per trainer "
        "rank, on the same bundle) takes.",
    )
    engine_workers: list[list[int]] = Field(
        default_factory=list,
        description="Engines across nodes only: each engine's worker bundles (one device each, whole nodes), in "
        "engine order. The engine's actor drives no device; vLLM's Ray executor starts one worker on each of these "
        "bundles (VLLM_RAY_BUNDLE_INDICES). Empty: each engine's actor drives its devices itself.",
    )
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Engines across nodes only: what each vLLM worker takes from its bundle (its device, or a "
        "colocated share of it; VLLM_RAY_PER_WORKER_GPUS).",
    )
    engine_hosts: list[list[int]] = Field(
        default_factory=list,
        description="Engines whose attention data parallelism spans nodes only: each engine's core-host bundles, one "
        "per further node, in engine order. The engine's actor is the front end and drives its node's engine cores; "
        "a core host on each of these bundles takes `actor_resources` too and drives its node's cores "
        "(engine `data_parallel_size_local` each). Empty: each engine runs from its actor alone.",
    )


class Role(PlanModel):
    name: str = Field(description="Unique role name: actor, rollout, teacher-<name>.")
    kind: RoleKind
    devices: int = Field(description="Device count.")
    placement: list[NodeDevices] = Field(description="Device ids per node.")
    parallel: Parallel
    layout: TrainLayout | None = Field(
        None, description="Train roles: the parallel layout the trainer builds, exactly (degrees, dtypes, ...)."
    )
    ray: RayPlacement | None = Field(None, description="Ray placement of this role's processes.")
    backend: str = Field(description="fsdp2, megatron, vllm, vllm-ascend, or python for reward workers.")
    replicas: int = Field(1, description="Engine replicas (rollout/teacher) or data-parallel ranks (train).")
    memory: Memory
    engine: dict[str, Any] = Field(default_factory=dict, description="Engine or trainer arguments, verbatim.")
    estimates: dict[str, float] = Field(default_factory=dict, description="Per-role time/throughput figures.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for this role's processes.")
    notes: list[str] = Field(default_factory=list, description="Why the planner chose this.")
    routing_capture: Literal["rlc", "vllm"] | None = Field(
        None,
        description="Rollout roles of plans that replay the engine's experts in training (the train role's "
        "`engine.routing_replay` is rollout): who records the experts each engine's router chose for every token. "
        "rlc: rlc's capture inside vLLM's worker (the cpu target; the engines run without prefix caching, since a "
        "prompt served from it has no recorded routing); vllm: the engine's own (engine argument "
        "enable_return_routed_experts). None: nothing records routing.",
    )

    @model_validator(mode="after")
    def _layout_matches(self) -> Role:
        if self.routing_capture is not None and self.kind != "rollout":
            raise ValueError(f"{self.kind} role {self.name} records routing; only rollout engines do")
        if self.kind == "train":
            if self.layout is None:
                raise ValueError(f"train role {self.name} has no layout")
            t = self.layout
            stated = (self.devices, self.parallel.tp, self.parallel.pp, self.parallel.cp, self.parallel.ep)
            if stated != (t.world_size, t.tp, t.pp, t.cp, t.ep) or self.parallel.dp != t.dp:
                raise ValueError(f"train role {self.name}: parallel {self.parallel} disagrees with its layout")
        elif self.layout is not None:
            raise ValueError(f"{self.kind} role {self.name} has a trainer layout")
        return self


class OffloadStep(PlanModel):
    phase: Literal["before_rollout", "before_train"] = Field(description="When the move happens.")
    action: Literal["offload", "onload", "sleep", "wake"] = Field(description="What happens.")
    what: str = Field(description="params, optimizer, grads, rollout_weights, kv_cache.")


class WeightSyncOption(PlanModel):
    """One weight-sync method the planner priced for the chosen layout."""

    method: Literal["broadcast", "disk", "inplace", "shared_memory", "adapter"]
    senders: int = Field(1, ge=1, description="Trainer ranks sending in parallel (broadcast).")
    slicing: Literal["full", "tp"] = Field("full", description="Bytes per engine worker: everything, or its TP shard.")
    seconds: float = Field(description="Estimated seconds per sync (`cost.weight_sync`).")
    bytes_per_worker: int = Field(description="Bytes each engine worker receives per sync.")
    runs: bool = Field(description="The runtime executes it (`WEIGHT_SYNC_EXECUTABLE`).")
    verdict: str = Field("", description="chosen, or why it was not.")


class Schedule(PlanModel):
    mode: Literal["colocated", "disaggregated"]
    steps: int
    batch_prompts: int
    group_size: int
    batch_samples: int = Field(description="batch_prompts × group_size.")
    micro_batch_tokens: int = Field(description="Token budget of one packed training micro-batch.")
    logprob_chunk_tokens: int = Field(description="Tokens per chunk in the log-prob computation.")
    packing: bool
    max_staleness: int = Field(description="0 = synchronous; colocated is always 0.")
    rollout_chunk_prompts: int = Field(description="Prompts per generate request sent to one engine.")
    rollout_chunks_per_engine: int = Field(
        2,
        description="Generate requests each engine holds at once; they run concurrently "
        "(`cost.engine_inflight_requests`).",
    )
    weight_sync: Literal["broadcast", "disk", "inplace", "shared_memory"] = Field(
        description="How new weights reach the engines. broadcast: trainer ranks send buckets over collective groups "
        "to every engine worker; disk: a safetensors folder every engine reloads; inplace (colocated): each node's "
        "first trainer rank writes a safetensors folder into its node's /dev/shm and the node's engines reload from "
        "it; shared_memory (colocated, cpu): the trainer rank on the engine's node writes the weights as flat tensors "
        "into POSIX shared memory that the engine's workers map directly, with no file (`cost.weight_sync`)."
    )
    weight_sync_senders: int = Field(
        1,
        ge=1,
        description="broadcast: trainer ranks that send buckets in parallel, each over its own group to every engine "
        "worker (at most the trainer's ranks); 1 in older plans and for the other methods.",
    )
    weight_sync_slicing: Literal["full", "tp"] = Field(
        "full",
        description="broadcast: tp = each engine worker receives only its tensor-parallel shard of the TP-sharded "
        "dense weights (attention, MLP, embedding; routed experts of an engine with EP > 1 or attention DP still "
        "arrive whole); full = every byte to every worker (older plans).",
    )
    weight_sync_note: str = Field(
        "", description="Why this method, its estimate and the runner-up, or which path runs where a faster one cannot."
    )
    weight_sync_options: list[WeightSyncOption] = Field(
        default_factory=list,
        description="Every method the planner priced for the chosen layout, fastest first (empty in older plans).",
    )
    weight_update: Literal["interrupt", "wait"] = Field(
        "interrupt",
        description="What a weight update does to samples in flight: continue them under the new weights, or let "
        "them finish first (`search_context.weight_update`).",
    )
    sync_check_max_gap: float = Field(
        1e-3,
        description="Largest mean |log-prob difference| between each engine and the trainer on a probe scored "
        "after every weight sync; above it the run stops: max(1e-3, 3 × sync_check_noise) unless the spec sets it "
        "(`schedule.sync_check_max_gap`).",
    )
    sync_check_noise: float | None = Field(
        None,
        description="How far a fresh sync's engine and trainer score the probe apart, for this plan's dtype and model "
        "kind (the largest measured or published figure, `schedule.SYNC_NOISE`). When a step moved the probe by more "
        "than `sync_check_min_step`, an engine nearer the weights before the step than the new ones by more than this "
        "stops the run. None: that test is off.",
    )
    sync_check_min_step: float | None = Field(
        None,
        description="How far a step must move the probe (mean |new − old| trainer log-prob) before each engine is "
        "judged against the weights before the step: 3 × sync_check_noise, past which the triangle inequality "
        "separates a fresh engine (within 2 × the noise) from one that missed the step (within the noise of the old "
        "weights). Below it no log-prob check can tell an engine one version behind. None: that test is off.",
    )
    offload: list[OffloadStep] = Field(default_factory=list, description="Colocated phase transitions.")
    checkpoint_every: int
    keep_checkpoints: int
    stall_timeout_s: float = Field(
        1800.0,
        description="Longest the run waits with work in flight and nothing finishing (no generate request, agent "
        "episode or train step) before it stops and names what stalled; the compiler sets it from the step-time "
        "estimate (`schedule.stall_timeout_s`).",
    )
    max_nonfinite_steps: int = Field(
        MAX_NONFINITE_STEPS,
        ge=1,
        description="Steps in a row whose update was skipped for a non-finite loss or gradient norm before the run "
        "stops, naming the checkpoint to resume from (`schedule.max_nonfinite_steps`; older plans read the default).",
    )

    @model_validator(mode="after")
    def _colocated_is_synchronous(self) -> Schedule:
        if self.mode == "colocated" and self.max_staleness != 0:
            raise ValueError(f"a colocated schedule is synchronous: max_staleness is 0, not {self.max_staleness}")
        return self


class DynamicSamplingSettings(PlanModel):
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more generated."""

    expected_keep_rate: float = Field(gt=0, le=1, description="Share of groups the planner expects to keep.")
    max_draws: float = Field(ge=1, description="At most this many groups generated per trained group in a step.")
    expected_generated_per_kept: float = Field(
        ge=1, description="Groups generated per trained group that the rollout estimate prices: min(1/keep, max_draws)."
    )


class OverlongSettings(PlanModel):
    """DAPO's soft overlong punishment (buffer_len > 0) and filtering of truncated responses."""

    buffer_len: int = Field(ge=0, description="Tokens before max_response_len where the punishment starts.")
    penalty: float = Field(gt=0, description="Reward lost at max_response_len.")
    filter_truncated: bool = Field(description="Truncated responses train with their loss masked.")


class AlgorithmSettings(PlanModel):
    name: str = Field(
        description="Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp (per-token KL reward), "
        "reinforce_pp_batchnorm, reinforce_pp_baseline."
    )
    minibatches: int = Field(1, ge=1, le=4096, description="Optimizer steps per training step.")
    decoupled_loss: bool
    clip: float = Field(description="ε_low of the token ratio.")
    clip_high: float | None = Field(None, description="ε_high of the token ratio (None, in older plans: clip).")
    dual_clip: float | None = Field(
        None, description="Dual-clip bound c on negative-advantage losses (None: none, as older plans meant)."
    )
    log_ratio_clamp: float | None = Field(
        None, description="log(π_θ/π_prox) clamped to ±this before exp (None: no clamp, as older plans meant)."
    )
    importance_ratio: Literal["token", "sequence"] = Field("token", description="token (PPO) or sequence (GSPO).")
    sequence_clip_low: float | None = Field(None, description="GSPO: ε_low of the sequence ratio.")
    sequence_clip_high: float | None = Field(None, description="GSPO: ε_high of the sequence ratio.")
    behave_imp_weight_cap: float
    behave_correction: Literal["token_mask", "token_truncate", "sequence_truncate", "sequence_mask"] = Field(
        "token_mask", description="What happens to behaviour weights above behave_imp_weight_cap."
    )
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="Loss aggregation over the minibatch's tokens and sequences."
    )
    loss_norm_tokens: int | None = Field(None, description="seq-mean-token-sum-norm: the constant normaliser.")
    kl_coef: float
    kl_estimator: str
    reward_kl_coef: float | None = Field(
        None, description="reinforce_pp: β of the per-token KL penalty −β·KL_t in the reward (None otherwise)."
    )
    reward_kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None, description="reinforce_pp: estimator of KL_t from behaviour and reference log-probs (None otherwise)."
    )
    normalize_std: bool
    group_std: Literal["population", "sample"] = Field(
        "population", description="grpo: the group std over n (population) or n − 1 (sample) samples."
    )
    dynamic_sampling: DynamicSamplingSettings | None = Field(None, description="DAPO dynamic sampling; None: off.")
    overlong: OverlongSettings | None = Field(None, description="DAPO overlong shaping/filtering; None: off.")
    lr: float
    weight_decay: float
    grad_clip: float
    seed: int

    @model_validator(mode="before")
    @classmethod
    def _older_reinforce_pp(cls, data: Any) -> Any:
        """A plan from before reinforce_pp carried its KL reward (no reward_kl_coef) meant the batch-normalised
        reward: it keeps that meaning under its new name."""
        if isinstance(data, dict) and data.get("name") == "reinforce_pp" and "reward_kl_coef" not in data:
            return {**data, "name": "reinforce_pp_batchnorm"}
        return data

    @property
    def needs_reference(self) -> bool:
        """Whether a reference policy is scored each step: a KL loss (kl_coef) or reinforce_pp's KL reward."""
        return self.kl_coef > 0 or (self.name == "reinforce_pp" and (self.reward_kl_coef or 0.0) > 0)


class Sampling(PlanModel):
    max_prompt_len: int
    max_response_len: int
    temperature: float
    top_p: float
    speculative: dict[str, Any] | None = Field(None, description="vLLM speculative_config, if any.")
    draft_acceptance: float | None = Field(
        None,
        description="Per-token draft acceptance the rollout estimate assumed (`rollout.mtp.acceptance_rate`); "
        "`rlc calibrate` and `rlc explain` compare it with a run's `spec_decode/acceptance_rate`.",
    )


class DataSettings(PlanModel):
    train: str
    builtin: bool
    prompt_key: str
    answer_key: str
    domain_key: str | None
    digits: int
    shots: int = Field(0, description="Built-in arithmetic: solved examples before each question.")
    reward: str
    reward_timeout_s: float = Field(
        10.0, ge=0.001, le=86_400, description="Seconds one sample's reward may take (reward.timeout_s)."
    )
    reward_max_failed_share: float = Field(
        0.05, ge=0, le=1, description="Share of a batch-worth of samples whose reward may fail before the run stops."
    )


class LinearAttentionLayers(PlanModel):
    """A hybrid model's Gated-DeltaNet layers: what the trainer builds with packed boundaries, and the heads
    that context parallelism splits (`layout.runtime_gaps` checks the layout against them)."""

    layers: int = Field(ge=1, description="Linear-attention (Gated-DeltaNet) decoder layers.")
    full_attention_interval: int = Field(ge=1, description="Every Nth layer is full attention.")
    key_heads: int = Field(ge=1, description="Key (and query) heads of a linear-attention layer.")
    value_heads: int = Field(ge=1, description="Value heads of a linear-attention layer.")


class LatentAttention(PlanModel):
    """A multi-head latent attention (DeepSeek's MLA) model's attention: what the trainer's packed forward runs
    (query/key heads wider than value heads) and which layouts split it (`layout.latent_attention_gaps`)."""

    kv_lora_rank: int = Field(ge=1, description="Rank of the compressed key/value latent, shared by every head.")
    q_lora_rank: int | None = Field(None, description="Rank of the query latent; None for a full-rank query.")
    qk_head_dim: int = Field(ge=1, description="Query/key head width: the part without position plus the rotary part.")
    qk_rope_head_dim: int = Field(ge=1, description="Rotary part of a query/key head (one rotary key for all heads).")
    v_head_dim: int = Field(ge=1, description="Value head width.")


class ExpertLayers(PlanModel):
    """A mixture-of-experts model's routed experts: what the trainer splits over EP ranks and the engines load."""

    layers: int = Field(ge=1, description="Decoder layers whose FFN is a mixture of experts.")
    num_experts: int = Field(ge=1, description="Routed experts per MoE layer.")
    experts_per_token: int = Field(ge=1, description="Routed experts per token (top-k).")
    routing_id_bytes: Literal[1, 2] = Field(
        description="Bytes of one recorded expert id in the routing that travels from the engines to the trainer: "
        "1 (uint8) below 255 experts, else 2 (uint16). A token's routing is the model's decoder layers × "
        "experts_per_token ids. Plans from before it: derived from num_experts.",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_plans(cls, data: Any) -> Any:
        """Plans compiled before the field state the width the compiler would have chosen."""
        if isinstance(data, dict) and "routing_id_bytes" not in data and isinstance(data.get("num_experts"), int):
            return {**data, "routing_id_bytes": 1 if data["num_experts"] < 255 else 2}
        return data


class ModelSettings(PlanModel):
    id: str
    path: str | None = Field(description="Local HF folder; None on cpu means build the tiny model.")
    hf_architecture: str
    params_b: float
    vocab_size: int
    build_tiny: bool = Field(False, description="Build the quickstart model at `path` when it is missing.")
    tiny_max_positions: int | None = Field(
        None, description="Rotary positions of the tiny model to build (its catalog entry: rlc-tiny, rlc-tiny-long)."
    )
    linear_attention: LinearAttentionLayers | None = Field(
        None, description="Hybrid models only: their linear-attention layers (None: every layer is attention)."
    )
    experts: ExpertLayers | None = Field(
        None, description="Mixture-of-experts models only: their routed experts (None: every FFN is dense)."
    )
    latent_attention: LatentAttention | None = Field(
        None, description="Multi-head latent attention (DeepSeek-V3/R1) models only (None: q/k/v heads of one width)."
    )
    layers: int | None = Field(None, description="Decoder layers (what pipeline stages split).")


class LoraSettings(PlanModel):
    rank: int
    alpha: float
    dropout: float
    target_modules: str | list[str]
    rollout: Literal["adapter", "merged"]


class TeacherSettings(PlanModel):
    name: str
    role: str = Field(description="The teacher role in `roles`.")
    model: ModelSettings
    domain: str | None
    weight: float


class DistillSettings(PlanModel):
    routing: Literal["domain", "mixture"]
    loss: str
    coef: float
    teachers: list[TeacherSettings]


class AgentSettings(PlanModel):
    """Agentic rollouts (`rollout.agent`): what the runners, the engines' endpoint and the recorder obey."""

    run: str = Field(description="The agent function, `package.module:function` (user code).")
    role: str = Field("environments", description="The role whose actors run the agent.")
    served_model_name: str = Field(description="The model name the endpoint answers to.")
    max_turns: int
    max_tokens_per_turn: int
    max_context_tokens: int = Field(description="Longest trajectory context (prompt + every turn and observation).")
    timeout_s: float = Field(description="Wall clock per trajectory.")
    export: Literal["trajectory", "turns"]
    turn_discount: float
    tool_call_parser: str | None
    max_failed_share: float
    inflight_per_engine: int = Field(
        description="Trajectories kept in flight per engine (engine busy while tools run)."
    )
    concurrency_per_worker: int = Field(description="Trajectories one environment worker runs at once.")
    expected_turns: float | None = Field(
        None,
        ge=1.0,
        le=4096.0,
        description="Mean model calls per trajectory the estimates price (the spec's, else half of max_turns).",
    )
    tool_latency_s: float | None = Field(
        None, ge=0.0, le=86400.0, description="Seconds per tool call the estimates assume (the spec's tool_latency_s)."
    )
    options: dict[str, str | int | float | bool] = Field(default_factory=dict, description="The agent's `llm.options`.")


class Reproducibility(PlanModel):
    """Whether two runs of this plan are expected to give the same per-step metrics, and what the compiler
    turned on for it. A plan compiled before rlc recorded this says it does not know."""

    deterministic: bool = Field(
        False,
        description="Two runs of this plan (same seed, software and hardware) give identical per-step metrics.",
    )
    reasons: list[str] = Field(
        default_factory=lambda: ["the plan was compiled before rlc recorded reproducibility"],
        description="Why runs of this plan may differ; empty when `deterministic`.",
    )
    seeded_sampling: bool = Field(
        False,
        description="Every rollout request carries a vLLM seed derived from (algorithm.seed, prompt cursor); sample "
        "i of a group draws from seed + i, so samples do not depend on batching or timing.",
    )
    deterministic_kernels: bool = Field(
        False, description="The target's deterministic switches are on (their environment is in `env`)."
    )
    torch_deterministic: bool = Field(False, description="Trainer ranks call torch.use_deterministic_algorithms(True).")
    switches: dict[str, str] = Field(
        default_factory=dict, description="The environment entries of `env` that are deterministic switches."
    )
    cost: str = Field("", description="What the deterministic switches cost in step time, and the source.")
    replay_log: bool = Field(
        False,
        description="The run records each generate request (prompts, policy version) and each batch in "
        "RUN/rollouts.jsonl, which `rlc run PLAN --replay RUN` feeds back.",
    )


class Estimates(PlanModel):
    step_time_s: float
    rollout_s: float
    train_s: float
    weight_sync_s: float
    weight_sync_bytes_per_worker: int = Field(
        0, ge=0, description="Bytes each engine worker receives per weight sync (0 in older plans: not stated)."
    )
    switch_s: float = Field(0.0, description="Colocated phase-switch cost (offload/onload, sleep/wake).")
    tokens_per_s: float = Field(description="Trained tokens per second (the ranking score).")
    overhead_s: float = Field(0.0, description="Fixed per-step cost beside the phases (the target's step_overhead_s).")
    uncertainty: float = Field(
        1.5, ge=1, description="Measured step times land at most at step_time_s × uncertainty (the band's slow side)."
    )
    uncertainty_fast: float | None = Field(
        None,
        ge=1,
        description="... and at least at step_time_s / uncertainty_fast (None, in plans before it: uncertainty).",
    )

    @property
    def uncertainty_below(self) -> float:
        """The band's fast-side factor (plans before it stated one factor for both sides)."""
        return self.uncertainty_fast or self.uncertainty

    @property
    def band(self) -> tuple[float, float]:
        """The step-time range the target's stated uncertainty gives (explain's and SUMMARY's "likely")."""
        return self.step_time_s / self.uncertainty_below, self.step_time_s * self.uncertainty

    @property
    def band_text(self) -> str:
        """How the band relates to the estimate: `×1.5` either way, or `÷1.25 to ×2.5`."""
        fast, slow = self.uncertainty_below, self.uncertainty
        return f"×{slow:g}" if fast == slow else f"÷{fast:g} to ×{slow:g}"


class Candidate(PlanModel):
    """A layout the search considered: the winner's runners-up and why each lost."""

    summary: str
    tokens_per_s: float
    step_time_s: float
    verdict: str
    lost_on: str = Field(
        "", description="The step term that made it lose: rollout, teachers, train, sync, switch, memory, or tie."
    )


class Cluster(PlanModel):
    nodes: int
    devices_per_node: int
    total_devices: int
    ray_resource: str = Field(description="Ray custom resource that counts this target's devices.")


class Plan(PlanModel):
    format_version: int = PLAN_FORMAT_VERSION
    rlc_version: str
    name: str
    spec_hash: str = Field(description="sha256 of the resolved spec.")
    target: str
    target_kind: Literal["npu", "gpu", "cpu"]
    platform: Literal["npu", "cuda", "cpu"]
    cluster: Cluster
    model: ModelSettings
    roles: list[Role]
    schedule: Schedule
    algorithm: AlgorithmSettings
    sampling: Sampling
    data: DataSettings
    lora: LoraSettings | None = None
    distill: DistillSettings | None = None
    agent: AgentSettings | None = Field(None, description="Agentic rollouts; None: one completion per sample.")
    run_dir: str
    loggers: list[str]
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every process.")
    estimates: Estimates
    reproducibility: Reproducibility = Field(
        default_factory=Reproducibility, description="Whether runs of this plan are expected to repeat exactly."
    )
    runners_up: list[Candidate] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    runtime_gaps: list[str] = Field(
        default_factory=list,
        description="What `rlc run` cannot execute about this plan on its platform; a plan with gaps is refused.",
    )
    profile: dict[str, str] = Field(
        default_factory=dict,
        description="The target profile the estimates used: its source (shipped or a --targets directory), its "
        "sha256 and, for a calibrated profile, where the calibration came from.",
    )

    def role(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)

    def roles_of(self, kind: RoleKind) -> list[Role]:
        return [r for r in self.roles if r.kind == kind]
