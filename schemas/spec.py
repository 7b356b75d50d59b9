"""The experiment spec: what users write.

It speaks the user's language (model, target, nodes, mode, algorithm, data, reward, rollout, train, lora,
distill, placement, output), never a framework's internals. Every model forbids unknown keys so that a typo
is reported (with a did-you-mean) instead of silently ignored. Structural checks live here; checks that need
the hardware profile or the model architecture live in `rlc.compiler.rules`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

TargetName = Literal["a2", "a2-32g", "a3", "cpu", "h100", "h800", "h20", "a800"]
TARGET_NAMES: tuple[str, ...] = TargetName.__args__  # type: ignore[attr-defined]

BUILTIN_TASKS: tuple[str, ...] = ("arithmetic",)
BUILTIN_REWARDS: tuple[str, ...] = ("exact_match", "math_exact")

# Upper bounds: the largest value real hardware, models or runs mean, so a typo or a hostile number is an
# error with the range instead of a planner that searches for hours or overflows.
MAX_NODES = 1024
MAX_DEVICES_PER_NODE = 64
#: Devices the planner searches at most (nodes × devices per node; checked by rule RLC217).
MAX_DEVICES = 8192
MAX_TOKENS = 1 << 24  # 16 Mi tokens: past any model's context window or a micro-batch budget
MAX_STEPS = 100_000_000
MAX_PATH = 4096  # PATH_MAX on Linux
MAX_TEXT = 256

PositiveInt = Annotated[int, Field(ge=1)]
Fraction = Annotated[float, Field(gt=0.0, le=1.0)]
Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Degree = Annotated[int, Field(ge=1, le=MAX_DEVICES)]
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS)]
#: `train.routing_replay`: the JSON Schema also accepts the booleans older specs wrote (true: proximal).
RoutingReplay = Annotated[
    Literal["auto", "off", "proximal", "rollout"],
    WithJsonSchema(
        {
            "anyOf": [
                {"enum": ["auto", "off", "proximal", "rollout"], "type": "string"},
                {"type": "boolean", "deprecated": True},
            ]
        }
    ),
]


def _no_nul(value: str) -> str:
    """A NUL byte cannot be in a path, a name or a command-line argument; refuse it instead of losing it."""
    if "\x00" in value:
        raise ValueError("holds a NUL byte (\\0), which no path or name can contain")
    return value


Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_no_nul)]
PathText = Annotated[str, Field(max_length=MAX_PATH), AfterValidator(_no_nul)]


class StrictModel(BaseModel):
    """Base for every spec section: unknown keys are errors, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


class Cluster(StrictModel):
    nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] = Field(1, description="Number of nodes (hosts) in the cluster.")
    devices_per_node: Annotated[int, Field(ge=1, le=MAX_DEVICES_PER_NODE)] | None = Field(
        None,
        description="Accelerators per node. Defaults to the target's value (8 on a2, 16 dies on a3, 2 on cpu).",
    )
    device_memory_gib: float | None = Field(
        None,
        gt=0.0,
        le=4096.0,
        description="Memory the planner may use per device, GiB. On cpu: the host-RAM slice of each worker "
        "process (default 3.5); on accelerators: a cap below the target's usable HBM, to leave headroom.",
    )
    memory_margin: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="Share of each trainer device's allocated memory kept free for allocator fragmentation "
        "(default: the target's allocator_overhead, 0.14 on Ascend, from a measured reserved/allocated peak).",
    )


class MoeArch(StrictModel):
    num_experts: Annotated[int, Field(ge=1, le=4096)] = Field(description="Routed experts per MoE layer.")
    experts_per_token: Annotated[int, Field(ge=1, le=256)] = Field(
        description="Routed experts activated per token (top-k)."
    )
    expert_intermediate_size: Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        description="FFN width of one routed expert."
    )
    num_shared_experts: int = Field(0, ge=0, le=64, description="Always-active shared experts per MoE layer.")
    first_dense_layers: int = Field(0, ge=0, le=1024, description="Leading layers that use a dense FFN instead.")


class InlineArch(StrictModel):
    """A model architecture given in the spec, for models the catalog does not know."""

    num_layers: Annotated[int, Field(ge=1, le=1024)] = Field(description="Decoder layers.")
    hidden_size: Annotated[int, Field(ge=1, le=1 << 17)] = Field(description="Model width.")
    num_attention_heads: Annotated[int, Field(ge=1, le=1024)] = Field(description="Query heads.")
    num_kv_heads: Annotated[int, Field(ge=1, le=1024)] = Field(description="Key/value heads (GQA groups).")
    head_dim: Annotated[int, Field(ge=1, le=4096)] | None = Field(
        None, description="Per-head width; defaults to hidden / heads."
    )
    intermediate_size: Annotated[int, Field(ge=1, le=1 << 20)] = Field(description="Dense FFN width.")
    vocab_size: Annotated[int, Field(ge=1, le=1 << 22)] = Field(description="Vocabulary size.")
    tie_word_embeddings: bool = Field(False, description="Whether the LM head shares the embedding matrix.")
    max_position_embeddings: Tokens = Field(32768, description="Longest context the model was trained for.")
    mtp_layers: int = Field(
        0, ge=0, le=16, description="Multi-token-prediction layers usable as a speculative drafter."
    )
    moe: MoeArch | None = Field(None, description="Mixture-of-experts settings; omit for a dense model.")


class ModelRef(StrictModel):
    name: Text | None = Field(
        None,
        description="Catalog id (e.g. qwen3-8b; case-insensitive, -instruct/-base suffixes allowed). "
        "Omit it and give `arch` for a model the catalog does not know.",
    )
    path: PathText | None = Field(
        None,
        description="Local Hugging Face folder with config.json, tokenizer and safetensors weights. "
        "On the cpu target the tiny quickstart model is built here when missing.",
    )
    arch: InlineArch | None = Field(None, description="Inline architecture, instead of a catalog id.")

    @model_validator(mode="after")
    def _name_or_arch(self) -> ModelRef:
        if self.name is None and self.arch is None:
            raise ValueError("give a catalog `name` (e.g. qwen3-8b) or an inline `arch` block")
        return self


class DynamicSampling(StrictModel):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476 §3.2): a group whose rewards are all equal has
    zero advantage and no gradient, so it is dropped and more prompts are generated until the step's batch is
    full of groups that carry signal."""

    expected_keep_rate: Fraction = Field(
        0.5,
        description="Share of groups expected to have unequal rewards. Used only by the planner: a step generates "
        "about 1 / expected_keep_rate groups per kept one (at most max_draws), which the rollout estimate prices. "
        "`rlc calibrate RUN` reports the measured rate (rollout/generated_per_kept).",
    )
    max_draws: float = Field(
        3.0,
        ge=1.0,
        le=64.0,
        description="Bound on extra generation: at most this many groups are generated per group a step trains "
        "on (verl's max_num_gen_batches, as a ratio). Past it, groups without signal are trained as they are "
        "(advantage 0) rather than generating more; rollout/zero_signal_kept counts them.",
    )


class Overlong(StrictModel):
    """DAPO's overlong reward shaping and filtering (Yu et al. 2025, arXiv 2503.14476 §3.4)."""

    buffer_len: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        description="Soft overlong punishment: a response longer than max_response_len − buffer_len loses "
        "penalty × (its length − (max_response_len − buffer_len)) / buffer_len of reward, growing linearly to "
        "the full penalty at max_response_len (DAPO used 4096 of 20480). 0: no punishment.",
    )
    penalty: float = Field(1.0, gt=0.0, le=1e3, description="Reward a response at max_response_len loses.")
    filter_truncated: bool = Field(
        False,
        description="Overlong filtering: samples cut off at max_response_len (no end-of-sequence token) keep their "
        "place in the group's baseline but train with their loss masked.",
    )


Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_batchnorm", "reinforce_pp_baseline"]


class Algorithm(StrictModel):
    name: Estimator = Field(
        "grpo",
        description="Advantage estimator (no critic in any). grpo: (reward − group mean) / group std (Shao et "
        "al. 2024, DeepSeekMath; the std only with normalize_std, its convention group_std). dr_grpo: reward − "
        "group mean, and the loss summed per sequence over a constant normaliser (Liu et al. 2025, Dr. GRPO, "
        "arXiv 2503.20783). rloo: reward − the mean of the group's other samples (Ahmadian et al. 2024, arXiv "
        "2402.14740). reinforce_pp: REINFORCE++ as published (Hu et al. 2025, arXiv 2501.03262): a per-token "
        "reward −β·KL_t to the reference policy plus the reward at the last token, each token's return to the "
        "end normalised over the batch's tokens (reward_kl_coef, reward_kl_estimator; it loads a reference "
        "policy). reinforce_pp_batchnorm: the reward normalised over the batch's tokens, no KL in the reward "
        "and no group baseline (what reinforce_pp meant in earlier rlc versions). reinforce_pp_baseline: reward "
        "− group mean, then normalised over the batch (ibid.).",
    )
    group_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        8,
        description="Samples per prompt (the GRPO group). 1 only with distill: a single sample has no group "
        "baseline, so the RL term is zero and the distillation term alone trains (on-policy distillation).",
    )
    batch_prompts: Annotated[int, Field(ge=1, le=1 << 20)] = Field(64, description="Prompts per training step.")
    max_staleness: int = Field(
        2,
        ge=0,
        le=1024,
        description="How many policy versions a sample may lag behind the trainer (0 = synchronous).",
    )
    minibatches: Annotated[int, Field(ge=1, le=4096)] = Field(
        1,
        description="Optimizer steps per training step: the batch is split into this many nearly equal "
        "minibatches, each a step of its own, and the new weights go to the engines after the last (AReaL's "
        "ppo_n_minibatches; verl's train batch / ppo_mini_batch_size). Above 1 the decoupled loss recomputes "
        "the proximal log-probs before the first update (one more forward pass over the batch), and later "
        "minibatches are clipped against them.",
    )
    decoupled_loss: bool = Field(
        True, description="Decoupled PPO: clip against a recomputed proximal policy, reweight by behaviour."
    )
    clip: float = Field(0.2, gt=0.0, lt=1.0, description="PPO ratio clip epsilon (both sides unless clip_high).")
    clip_low: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="ε_low of the token ratio's trust region [1 − ε_low, 1 + ε_high] (default: clip). Give clip or "
        "clip_low, not both.",
    )
    clip_high: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="ε_high of the token ratio (default: ε_low). Above ε_low it is DAPO's clip-higher (Yu et al. "
        "2025, arXiv 2503.14476: 0.28 with ε_low 0.2), which keeps low-probability tokens able to grow.",
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1.0,
        le=1e3,
        description="Dual clip c: a negative-advantage token's loss is at most −c·A however large its ratio (Ye et "
        "al. 2020, arXiv 1912.09729; verl's clip_ratio_c and default, 3.0). With log_ratio_clamp no token can "
        "dominate a minibatch. null turns it off (earlier rlc versions' default): with minibatches > 1 one token "
        "whose ratio grew to e^20 then outweighs the rest of the batch.",
    )
    log_ratio_clamp: float | None = Field(
        20.0,
        gt=0.0,
        le=80.0,
        description="The policy ratio's log, log(π_θ/π_prox), is clamped to ±this before exp (verl's ±20), so the "
        "ratio stays finite. null turns it off.",
    )
    importance_ratio: Literal["token", "sequence"] = Field(
        "token",
        description="token: each token's ratio π_θ/π_prox, clipped per token (PPO). sequence: GSPO (Zheng et al. "
        "2025, arXiv 2507.18071): every token of a response uses the response's length-normalised ratio "
        "exp(mean log(π_θ/π_prox)), clipped per sequence to [1 − sequence_clip_low, 1 + sequence_clip_high]; the "
        "behaviour weight of the decoupled loss stays per token, as AReaL composes them (TRL's "
        "importance_sampling_level).",
    )
    sequence_clip_low: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="importance_ratio sequence only: ε_low of the sequence ratio (default 3e-4, the GSPO paper's).",
    )
    sequence_clip_high: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="importance_ratio sequence only: ε_high of the sequence ratio (default 4e-4, the GSPO paper's).",
    )
    behave_imp_weight_cap: float = Field(
        5.0,
        gt=1.0,
        le=1e6,
        description="The bound C on the decoupled loss' behaviour importance weight w = π_prox/π_behave; what "
        "happens above it is behave_correction's choice.",
    )
    behave_correction: Literal["token_mask", "token_truncate", "sequence_truncate", "sequence_mask"] = Field(
        "token_mask",
        description="Off-policy correction of the behaviour weight above behave_imp_weight_cap C. token_mask: the "
        "token is dropped from the loss (AReaL). token_truncate: truncated importance sampling, w ← min(w, C) (Yao "
        "et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training'; verl rollout_is "
        "token). sequence_truncate: every token weighted by min(Π w, C) over its response (verl rollout_is "
        "sequence). sequence_mask: masked importance sampling, a response with Π w > C is dropped (Liu et al. "
        "2025, 'When speed kills stability'). Both masks keep dropped tokens in the loss' denominators (AReaL's "
        "rule; for token_mask verl's IcePop threshold mode gives the same numbers), where verl's rollout_rs removes "
        "them from the loss mask (a larger weight for the tokens kept). Needs decoupled_loss.",
    )
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = (
        Field(
            None,
            description="How per-token losses make the step's loss (verl's loss_agg_mode), exactly over the whole "
            "minibatch whatever its split into micro-batches and ranks. token-mean: over all tokens (DAPO). "
            "seq-mean-token-sum: per-response sums, averaged over responses. seq-mean-token-mean: per-response "
            "means, averaged (the GRPO paper, GSPO). seq-mean-token-sum-norm: per-response sums over a constant "
            "(loss_norm_tokens) and the response count (Dr. GRPO; TRL's dr_grpo). Default: seq-mean-token-sum-norm "
            "for dr_grpo, seq-mean-token-mean for importance_ratio sequence, else token-mean.",
        )
    )
    loss_norm_tokens: Tokens | None = Field(
        None,
        description="loss_agg seq-mean-token-sum-norm only: the constant normaliser in tokens (default: "
        "rollout.max_response_len, Dr. GRPO's generation budget).",
    )
    dynamic_sampling: DynamicSampling | None = Field(
        None, description="DAPO's dynamic sampling: drop groups whose rewards are all equal and generate more."
    )
    overlong: Overlong | None = Field(
        None, description="DAPO's soft overlong punishment and overlong filtering of truncated responses."
    )
    kl_coef: float = Field(
        0.0, ge=0.0, le=1e3, description="Weight of the KL penalty to the reference policy (0 = none)."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator for the penalty.")
    reward_kl_coef: float | None = Field(
        None,
        ge=0.0,
        le=1e3,
        description="name reinforce_pp only: β of the per-token KL penalty in the reward, −β·KL_t to the "
        "reference policy (default 0.01, OpenRLHF's init_kl_coef). 0 leaves the batch-normalised reward "
        "(reinforce_pp_batchnorm) and needs no reference.",
    )
    reward_kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None,
        description="name reinforce_pp only: the estimator of KL_t from the behaviour policy's and the reference's "
        "log-probs of the sampled token (default k1 = log π_behave − log π_ref, the paper's).",
    )
    normalize_std: bool = Field(
        True,
        description="name grpo only: divide group-centred rewards by the group's std (false: Dr. GRPO's baseline).",
    )
    group_std: Literal["population", "sample"] = Field(
        "population",
        description="name grpo only: the group std divides the variance by n (population, rlc's default) or n − 1 "
        "(sample, Bessel's correction: verl's and torch.std's). With n = 8 the sample std is 7% larger.",
    )
    lr: float = Field(1.0e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=10.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, le=1e6, description="Global gradient-norm clip.")
    steps: Steps = Field(200, description="Training steps (policy updates).")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for data order, sampling and initialisation.")
    deterministic: Literal["auto"] | bool = Field(
        "auto",
        description="Turn on the platform's deterministic kernels (torch.use_deterministic_algorithms, "
        "HCCL_DETERMINISTIC, vLLM batch invariance) so that two runs of a colocated or max_staleness 0 plan "
        "give the same per-step metrics. auto: on where they cost nothing measurable (the cpu target), off "
        "on accelerators, where they slow training and rollout. Sampling is seeded per request unless this is "
        "false: false also drops the seeds (vLLM draws each seeded sequence's noise separately, measured at 5-15% "
        "more engine CPU per token on the cpu target) and with them exact repeats and `rlc run --replay`.",
    )

    @property
    def batch_samples(self) -> int:
        """Samples per training step: batch_prompts × group_size."""
        return self.batch_prompts * self.group_size

    @property
    def clip_range(self) -> tuple[float, float]:
        """The token ratio's (ε_low, ε_high)."""
        low = self.clip if self.clip_low is None else self.clip_low
        return low, low if self.clip_high is None else self.clip_high

    @property
    def sequence_clip_range(self) -> tuple[float, float]:
        """GSPO's (ε_low, ε_high) of the sequence ratio."""
        low = 3e-4 if self.sequence_clip_low is None else self.sequence_clip_low
        return low, 4e-4 if self.sequence_clip_high is None else self.sequence_clip_high

    @property
    def aggregation(self) -> str:
        """loss_agg with its default resolved."""
        if self.loss_agg is not None:
            return self.loss_agg
        if self.name == "dr_grpo":
            return "seq-mean-token-sum-norm"
        return "seq-mean-token-mean" if self.importance_ratio == "sequence" else "token-mean"

    @property
    def reward_kl(self) -> tuple[float, str]:
        """reinforce_pp's reward KL (β, estimator) with defaults resolved; (0, k1) for every other estimator."""
        if self.name != "reinforce_pp":
            return 0.0, "k1"
        beta = 0.01 if self.reward_kl_coef is None else self.reward_kl_coef
        return beta, self.reward_kl_estimator or "k1"

    @property
    def needs_reference(self) -> bool:
        """Whether a reference policy is scored each step: a KL loss (kl_coef) or a KL reward (reinforce_pp)."""
        return self.kl_coef > 0 or self.reward_kl[0] > 0

    @property
    def expected_oversample(self) -> float:
        """Groups generated per trained group that the planner prices (1 without dynamic sampling)."""
        ds = self.dynamic_sampling
        return 1.0 if ds is None else min(1.0 / ds.expected_keep_rate, ds.max_draws)

    @field_validator("deterministic", mode="before")
    @classmethod
    def _true_false_or_auto(cls, value: object) -> object:
        if value == "auto" or isinstance(value, bool):
            return value
        raise ValueError("expected true, false or auto")


class Data(StrictModel):
    train: PathText = Field(
        description="JSONL file with one object per line, or a built-in task name (arithmetic).",
    )
    prompt_key: Text = Field("prompt", description="JSONL key holding the prompt text.")
    answer_key: Text = Field("answer", description="JSONL key holding the reference answer for the reward.")
    domain_key: Text | None = Field(
        None, description="JSONL key naming each example's domain (used to route MOPD teachers)."
    )
    digits: Annotated[int, Field(ge=1, le=6)] = Field(
        1, description="Built-in arithmetic task only: digits per operand."
    )
    shots: Annotated[int, Field(ge=0, le=100_000)] = Field(
        0,
        description="Built-in arithmetic task only: solved examples written before each question, which makes "
        "long prompts (about 6 tokens per shot) for long-context runs.",
    )

    @property
    def is_builtin(self) -> bool:
        return self.train in BUILTIN_TASKS


class Reward(StrictModel):
    fn: str = Field(
        "math_exact",
        description="Built-in reward (exact_match, math_exact) or a custom one as `package.module:function`.",
        pattern=r"^([A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$",
        max_length=MAX_TEXT,
    )
    timeout_s: Annotated[float, Field(ge=0.001, le=86_400)] = Field(
        10.0,
        description="Seconds one sample's reward may take; past it the call is interrupted and the sample "
        "scores 0 as a failed one (a verifier that hangs on one completion must not stall the run).",
    )
    max_failed_share: Annotated[float, Field(ge=0, le=1)] = Field(
        0.05,
        description="Share of the last batch-worth of samples whose reward may fail (raise, time out, or "
        "return something that is not a finite number; each scores 0) before the run stops.",
    )


class Mtp(StrictModel):
    num_speculative_tokens: Annotated[int, Field(ge=1, le=15)] = Field(
        1, description="Draft tokens proposed per step (vLLM requires k + 1 <= 16)."
    )
    method: Literal["auto", "mtp", "ngram"] = Field(
        "auto",
        description="Drafter: the model's own MTP layers (auto picks them when the model has any) or n-gram "
        "prompt lookup (works on every model and on the cpu target).",
    )
    ngram_min: Annotated[int, Field(ge=1, le=8)] = Field(
        2,
        description="n-gram only: shortest prompt/context match the drafter looks up (it tries up to 4 tokens).",
    )
    acceptance_rate: float = Field(
        0.7,
        gt=0.0,
        lt=1.0,
        description="Assumed per-token draft acceptance, used only by the planner's rollout time estimate.",
    )


ImportPath = Annotated[
    str,
    Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$", max_length=MAX_TEXT),
]


class Environments(StrictModel):
    """The processes that run the agent and its tools: one Ray actor per worker, sized and placed by the planner."""

    workers: Annotated[int, Field(ge=1, le=4096)] = Field(
        1, description="Agent runner processes; each runs many trajectories at once."
    )
    cpus: float = Field(
        1.0, ge=0.0, le=1024.0, description="CPUs per worker (0 when the agent brings its own sandbox elsewhere)."
    )
    memory_gib: float = Field(
        1.0, ge=0.0, le=4096.0, description="Host memory per worker, GiB (0 when the agent brings its own sandbox)."
    )
    tool_latency_s: float = Field(
        1.0,
        ge=0.0,
        le=86400.0,
        description="Assumed seconds an environment takes per tool call; used only by the planner's estimates.",
    )


class Agent(StrictModel):
    """Multi-turn agentic rollouts: user code drives the engines through an OpenAI-compatible endpoint."""

    run: ImportPath = Field(
        description="`package.module:function`, an `async def run(task: dict, llm) -> float | dict` (a plain "
        "function runs in a thread). `llm` carries base_url, api_key (the trajectory's session key) and model.",
    )
    max_turns: Annotated[int, Field(ge=1, le=4096)] = Field(
        8, description="Model calls per trajectory; the next call gets a context_length_exceeded error."
    )
    max_tokens_per_turn: Tokens = Field(1024, description="Tokens one call may generate (max_tokens is capped).")
    expected_turns: float | None = Field(
        None,
        ge=1.0,
        le=4096.0,
        description="Model calls a trajectory makes on average; used only by the planner's estimates (default: "
        "half of max_turns, at least 1).",
    )
    timeout_s: float = Field(
        600.0, gt=0.0, le=86400.0, description="Wall-clock limit of one trajectory; past it the episode is dropped."
    )
    export: Literal["trajectory", "turns"] = Field(
        "trajectory",
        description="trajectory: one training row per trajectory, tool and user tokens masked; turns: one row per "
        "model call.",
    )
    turn_discount: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="export turns: a call k turns before the end gets advantage × turn_discount^k.",
    )
    tool_call_parser: Text | None = Field(
        None,
        description="vLLM tool-call parser for the chat endpoint (e.g. hermes, qwen3_coder); none for text actions.",
    )
    max_failed_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Share of a batch's trajectories that may fail (agent raised, hung or returned no reward) "
        "before the run stops.",
    )
    environments: Environments = Field(
        default_factory=Environments, description="Where the agent code and its tools run."
    )
    options: Annotated[dict[Text, str | int | float | bool], Field(max_length=64)] = Field(
        default_factory=dict,
        description="Settings handed to the agent as `llm.options` (e.g. rlc.agents.mini_swe's environment: "
        "local, bubblewrap, docker, singularity).",
    )


class Rollout(StrictModel):
    max_prompt_len: Tokens = Field(2048, description="Longest prompt in tokens.")
    max_response_len: Tokens = Field(8192, description="Longest generated response in tokens.")
    temperature: float = Field(1.0, gt=0.0, le=4.0, description="Sampling temperature.")
    top_p: Fraction = Field(1.0, description="Nucleus sampling mass.")
    mtp: Mtp | None = Field(None, description="Speculative decoding in rollout (MTP layers or n-gram).")
    weight_sync: Literal["auto", "broadcast", "disk"] = Field(
        "auto",
        description="How new weights reach the engines: a collective broadcast from trainer rank 0, or "
        "safetensors on shared disk. auto: broadcast when disaggregated; colocated: through host shared memory "
        "on one node, or files in the run directory (which every node must see) across nodes.",
    )
    agent: Agent | None = Field(
        None,
        description="Agentic rollouts: a user agent drives the engines over many turns instead of one completion.",
    )
    weight_update: Literal["auto", "interrupt", "wait"] = Field(
        "auto",
        description="What a weight update does to samples the engines are generating. interrupt: freeze them, load, "
        "and continue the same sequences under the new weights (prefilled again), each token labelled with the "
        "version that sampled it (AReaL's interruptible rollout); wait: let them finish first (new ones queue). "
        "auto: wait with LoRA adapters (a running request keeps the adapter it started with), else interrupt. "
        "Only asynchronous runs update weights with samples in flight.",
    )
    sync_check_max_gap: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="After every weight sync each engine scores a few tokens the trainer scored with the same "
        "weights; a mean |log-prob difference| above this stops the run (an engine serving other weights). "
        "Default: 3x the largest gap a fresh sync shows for the plan's dtype and model, at least 1e-3: 1e-3 in "
        "float32 (cpu), 0.054 for a dense model in bfloat16, 0.12 for a Gated-DeltaNet hybrid, 0.408 with routed "
        "experts.",
    )

    @property
    def max_total_len(self) -> int:
        return self.max_prompt_len + self.max_response_len


class Offload(StrictModel):
    params: bool = Field(False, description="Keep training parameters on host memory when not in use.")
    optimizer: bool = Field(False, description="Keep optimizer states on host memory when not in use.")


class Train(StrictModel):
    backend: Literal["auto", "fsdp2", "megatron"] = Field(
        "auto",
        description="Training backend: fsdp2 (auto picks it). megatron is refused (RLC223): nothing in rlc executes "
        "it; pin backend: fsdp2 with the same degrees.",
    )
    packing: bool = Field(True, description="Pack sequences into token-budget micro-batches (no padding).")
    recompute: Literal["auto", "none", "selective", "full"] = Field(
        "auto",
        description="Activation recomputation; auto lets the planner pick the cheapest that fits. The fsdp2 "
        "trainer recomputes whole layers (full) or nothing; selective is refused (RLC215).",
    )
    offload: Offload = Field(default_factory=Offload, description="Host offload of training state.")
    micro_batch_tokens: Tokens | None = Field(
        None, description="Tokens per packed micro-batch; the planner picks one when omitted."
    )
    logprob_chunk_tokens: Tokens = Field(
        1024, description="Tokens per chunk when computing log-probs, so full-vocab logits never materialise."
    )
    precision: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Trainer compute dtype; parameters, optimizer state and gradient reduction stay float32. "
        "auto: bfloat16 on accelerators, float32 on cpu (where vLLM runs float32, so log-probs agree).",
    )
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="MoE models: coefficient of the router's load-balancing loss (Switch Transformer, Fedus et "
        "al. 2021): per MoE layer E·Σ f_i·P_i, f_i the tokens routed to expert i over all tokens (summing to "
        "top-k) and P_i the mean router probability, averaged over the MoE layers: per layer transformers' "
        "load_balancing_loss_func, so the coefficient means what transformers' router_aux_loss_coef means "
        "(Qwen3-MoE configs: 0.001). f and P run over each optimizer step's whole minibatch (every micro-batch, "
        "every data- and context-parallel rank), as Qwen3-MoE training does; padding and each sequence's last "
        "token are not counted. f is fixed before the first backward: from the proximal pass where one runs, from "
        "the engine's experts under rollout replay, else from the micro-batches run so far (exact with one "
        "micro-batch per rank). 0 (off) is what RL recipes use (AReaL, MindSpeed-RL moe_aux_loss_coeff 0.0): the "
        "policy gradient alone moves the router.",
    )
    routing_replay: RoutingReplay = Field(
        "auto",
        description="MoE models: which experts the trainer's forwards use for the sampled tokens. rollout (R3, "
        "arXiv 2510.11370): the experts the rollout engine chose, recorded per token and replayed in the proximal, "
        "policy and reference forwards, so the behaviour log-probs and the trained ones come from the same experts. "
        "proximal: the policy forward reuses the experts the proximal pass chose (trainer-side replay; it acts with "
        "several minibatches, where later ones train after earlier updates moved the router). off: every forward "
        "routes afresh. auto: rollout where the target's engines record their experts, else proximal where the "
        "plan makes a proximal pass, else off; the plan says which and why. Tokens without recorded experts (a "
        "sequence's last token) route afresh; moe/rollout_routing_agreement reports the share of (token, MoE layer) "
        "pairs where the trainer's own choice equals the engine's. true and false (older specs) mean proximal and "
        "off.",
    )

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _older_routing_replay(cls, value: object) -> object:
        """Specs written when the key was a switch for trainer-side replay keep their meaning."""
        if isinstance(value, bool):
            return "proximal" if value else "off"
        return value


class Lora(StrictModel):
    rank: Annotated[int, Field(ge=1, le=1 << 17)] = Field(32, description="LoRA rank r (at most the widest model).")
    alpha: float = Field(64.0, gt=0.0, le=1e6, description="LoRA scaling alpha (effective scale alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: Literal["all-linear"] | Annotated[list[Text], Field(max_length=64)] = Field(
        "all-linear", description="Which linear layers get adapters: all-linear or a list of module names."
    )
    rollout: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="How rollout sees the adapter: vLLM serves it (adapter) or it is merged into the base "
        "weights before each sync (merged). auto picks adapter where the engine supports LoRA.",
    )


class Teacher(StrictModel):
    name: str = Field(
        description="Teacher name, used in metrics (distill/<name>/...).", pattern=r"^[a-z0-9_-]+$", max_length=63
    )
    model: ModelRef = Field(description="The teacher model (catalog id or inline arch, plus local path).")
    domain: Text | None = Field(None, description="Dataset domain this teacher serves (routing: domain).")
    weight: float = Field(1.0, gt=0.0, le=1e6, description="Mixture weight (routing: mixture).")


class Distill(StrictModel):
    teachers: list[Teacher] = Field(
        min_length=1, max_length=16, description="Teachers for multi-teacher on-policy distillation."
    )
    routing: Literal["domain", "mixture"] = Field(
        "domain", description="domain: each trajectory goes to its domain's teacher; mixture: all, by weight."
    )
    loss: Literal["reverse_kl"] = Field("reverse_kl", description="Per-token distillation loss.")
    coef: float = Field(1.0, ge=0.0, le=1e3, description="Weight of the distillation term next to the RL loss.")

    @model_validator(mode="after")
    def _unique_names(self) -> Distill:
        names = [t.name for t in self.teachers]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"teacher names must be unique; repeated: {', '.join(duplicated)}")
        return self


class TrainPin(StrictModel):
    devices: Degree | None = Field(None, description="Devices for the trainer.")
    backend: Literal["fsdp2", "megatron"] | None = Field(
        None, description="Training backend: fsdp2. megatron is refused (RLC223): nothing in rlc executes it."
    )
    tp: Degree | None = Field(None, description="Tensor parallel degree.")
    pp: Degree | None = Field(None, description="Pipeline parallel degree.")
    cp: Degree | None = Field(None, description="Context parallel degree.")
    cp_kind: Literal["ulysses", "ring"] | None = Field(
        None,
        description="Context parallel kind: ulysses (all-to-all of heads; tp·cp must divide the heads) or ring "
        "(K/V blocks passed around the ranks). Default: ulysses where the heads allow it, else ring.",
    )
    ep: Degree | None = Field(None, description="Expert parallel degree.")
    recompute: Literal["none", "selective", "full"] | None = Field(None, description="Activation recompute.")
    offload: Offload | None = Field(None, description="Host offload of training state.")
    micro_batch_tokens: Tokens | None = Field(None, description="Tokens per micro-batch.")


class RolloutPin(StrictModel):
    devices: Degree | None = Field(None, description="Devices for rollout engines.")
    tp: Degree | None = Field(None, description="Tensor parallel degree per engine.")
    ep: Degree | None = Field(None, description="Expert parallel degree per engine (MoE).")
    memory_fraction: Fraction | None = Field(None, description="Share of device memory vLLM may use.")
    max_num_seqs: Annotated[int, Field(ge=1, le=65536)] | None = Field(
        None, description="Concurrent sequences per engine."
    )
    eager: bool | None = Field(
        None,
        description=(
            "Run the engines without graph capture (vLLM enforce_eager), e.g. where a model's graph mode fails; "
            "every decode step then launches its kernels from the host. Default: graph mode on accelerators."
        ),
    )


class TeacherPin(StrictModel):
    devices: Degree | None = Field(None, description="Devices for this teacher's engines.")
    tp: Degree | None = Field(None, description="Tensor parallel degree per teacher engine.")
    memory_fraction: Fraction | None = Field(None, description="Share of device memory the teacher may use.")


class Placement(StrictModel):
    train: TrainPin = Field(default_factory=TrainPin, description="Pins for the trainer.")
    rollout: RolloutPin = Field(default_factory=RolloutPin, description="Pins for the rollout engines.")
    teachers: dict[Text, TeacherPin] = Field(default_factory=dict, max_length=16, description="Pins per teacher name.")


class Output(StrictModel):
    dir: PathText | None = Field(None, description="Run directory; defaults to runs/<name>.")
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "swanlab", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"],
        description=(
            "Metric sinks, each written under the run directory with the same numeric metrics per step: jsonl "
            "(metrics.jsonl, what rlc's own tools read), tensorboard (tensorboard/), wandb (Weights & Biases "
            "offline, wandb/; upload with `wandb sync`), swanlab (SwanLab offline, swanlab/; upload with "
            "`swanlab sync`), mlflow (a SQLite store, mlflow/mlflow.db). wandb, swanlab and mlflow also record the "
            "plan's summary as the run's config and need `pip install 'rlc[trackers]'`; none uses the network."
        ),
    )
    checkpoint_every: Steps = Field(50, description="Save a checkpoint every N steps (and at the end).")
    keep_checkpoints: Annotated[int, Field(ge=1, le=1000)] = Field(
        2, description="How many recent checkpoints to keep."
    )

    @field_validator("loggers")
    @classmethod
    def _each_logger_once(cls, loggers: list[str]) -> list[str]:
        repeated = sorted({name for name in loggers if loggers.count(name) > 1})
        if repeated:
            raise ValueError(f"each logger once; repeated: {', '.join(repeated)}")
        return loggers


class Spec(StrictModel):
    """An RL post-training experiment."""

    model_config = ConfigDict(
        extra="forbid",
        validate_default=True,
        json_schema_extra={"title": "rlc experiment spec"},
    )

    name: str = Field(
        description="Experiment name: lowercase letters, digits, '.', '_' and '-'.",
        pattern=r"^[a-z0-9][a-z0-9._-]*$",
        max_length=63,
    )
    target: TargetName | None = Field(None, description="Hardware target; `--target` on the command line overrides it.")
    cluster: Cluster = Field(default_factory=Cluster, description="Cluster size.")
    model: ModelRef = Field(description="The policy model being trained.")
    mode: Literal["colocated", "disaggregated", "auto"] = Field(
        "auto",
        description="colocated: training and rollout time-share devices; disaggregated: separate pools "
        "running asynchronously; auto: the planner picks the faster.",
    )
    algorithm: Algorithm = Field(default_factory=Algorithm, description="RL algorithm settings.")
    data: Data = Field(description="Training prompts.")
    reward: Reward = Field(default_factory=Reward, description="Reward function.")
    rollout: Rollout = Field(default_factory=Rollout, description="Generation settings.")
    train: Train = Field(default_factory=Train, description="Trainer settings.")
    lora: Lora | None = Field(None, description="LoRA adapters instead of full fine-tuning.")
    distill: Distill | None = Field(None, description="Multi-teacher on-policy distillation (MOPD).")
    placement: Placement = Field(default_factory=Placement, description="Optional pins for the planner.")
    output: Output = Field(default_factory=Output, description="Where metrics and checkpoints go.")

    @property
    def run_dir(self) -> str:
        return self.output.dir or f"runs/{self.name}"


def spec_json_schema() -> dict[str, object]:
    """The spec's JSON Schema (for editors via yaml-language-server, and for CI)."""
    return Spec.model_json_schema(mode="validation")
