"""What one RL step asks of the hardware: prompts, samples, mean and longest lengths, agent turns and tool waits."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log

__all__ = [
    "EULER_GAMMA",
    "PROMPT_FRACTION",
    "RESPONSE_FRACTION",
    "TURNS_FRACTION",
    "AgentWork",
    "Workload",
    "accepted_tokens_per_step",
    "agent_work",
    "expected_longest_response",
    "workload",
]

#: Mean response length as a fraction of max_response_len. RL responses are long-tailed: most finish well
#: before the cap while a few hit it (AReaL, StreamRL report means around half the cap on math tasks).
RESPONSE_FRACTION = 0.5
#: Mean model calls of an agent trajectory as a fraction of max_turns when the spec does not state
#: `expected_turns`: the cap is set for the longest episode, as the length caps are.
TURNS_FRACTION = 0.5
#: Mean prompt length as a fraction of max_prompt_len (the cap is set for the longest prompt).
PROMPT_FRACTION = 0.5
#: Euler–Mascheroni constant, for the harmonic numbers in `expected_longest_response`.
EULER_GAMMA = 0.5772156649


def expected_longest_response(mean: float, cap: int, samples: int) -> float:
    """Expected length of the longest of `samples` responses: min(cap, mean · H_n), H_n = Σ_{k≤n} 1/k.

    A synchronous step waits for the slowest sample of the whole batch. Response lengths are modelled as
    exponential with the workload's mean (the maximum-entropy law for a known mean on [0, ∞), and right-skewed as
    RL lengths are: StreamRL, Zhong et al. 2025, §2.3; RLHFuse, Zhong et al. 2025, §2.2, both report the longest
    samples of a batch dominating generation time); the expected maximum of n i.i.d. exponentials is
    mean · H_n (Rényi's representation of exponential order statistics; David & Nagaraja, Order Statistics, 2003,
    §3.1), H_n ≈ ln n + γ + 1/(2n). The engine stops a sample at the cap, which bounds it: with a mean near half
    the cap any batch of 4 or more samples reaches the cap.
    """
    if samples <= 0 or mean <= 0:
        return float(min(cap, max(0.0, mean)))
    n = samples
    harmonic = sum(1.0 / k for k in range(1, n + 1)) if n <= 64 else log(n) + EULER_GAMMA + 1 / (2 * n)
    return min(float(cap), mean * harmonic)


@dataclass(frozen=True)
class AgentWork:
    """What an agentic rollout asks of an engine per trajectory, beside its tokens: several model calls, each
    after the environment answered the one before."""

    turns: float  # mean model calls per trajectory (the spec's expected_turns)
    turn_tokens: float  # mean tokens one call generates
    max_turn_tokens: int  # the most one call may generate (max_tokens_per_turn, within max_response_len)
    tool_s: float  # seconds the environment takes between two calls (the spec's assumed tool latency)


@dataclass(frozen=True)
class Workload:
    """What one RL step processes; derived from the spec once."""

    samples: int
    prompt_tokens: float
    response_tokens: float
    max_prompt: int
    max_response: int
    staleness: int
    decoupled: bool
    reference: bool
    lora: bool
    mtp_tokens: int = 0
    mtp_acceptance: float = 0.0
    mtp_draft_layers: int = 0
    group_size: int = 1
    #: Forward-only passes over the batch besides a KL reference's and the proximal one (`proximal_forwards`);
    #: comparisons with frameworks that make one where rlc makes none (verl's old_log_prob with a single
    #: mini-batch) set 1.
    extra_forwards: int = 0
    #: Optimizer steps per RL step (`algorithm.minibatches`): each takes its share of the micro-batches, its
    #: own pipeline fill and drain, gradient reduction and optimizer update.
    minibatches: int = 1
    #: Agentic rollouts (`rollout.agent`): each trajectory is several calls with tool time between them.
    agent: AgentWork | None = None
    #: Weight updates interrupt running samples (re-prefilled under the new weights) rather than wait for them
    #: (`plan.schedule.weight_update`).
    interrupt: bool = True
    #: Samples generated per trained sample: DAPO's dynamic sampling drops groups without signal and generates
    #: more (`Algorithm.expected_oversample`); 1 without it.
    oversample: float = 1.0

    @property
    def generated_samples(self) -> int:
        """Samples the engines generate per step (the trained ones and those dynamic sampling drops)."""
        return ceil(self.samples * self.oversample - 1e-9)

    @property
    def proximal_forwards(self) -> int:
        """Forward passes for the decoupled loss' proximal log-probs: none with one minibatch (the train
        forward's own), one over the batch with several (before the first update, AReaL's recompute_logprob)."""
        return 1 if self.decoupled and self.minibatches > 1 else 0

    @property
    def context_tokens(self) -> float:
        """Mean sequence length (prompt + response)."""
        return self.prompt_tokens + self.response_tokens

    @property
    def inflight_context(self) -> float:
        """Mean KV length of a sequence while it decodes: its prompt plus half its response.

        vLLM allocates KV blocks as a sequence grows (PagedAttention, Kwon et al. 2023), so a running
        sequence holds prompt + tokens generated so far, on average prompt + response / 2. This is both the
        KV a decode step reads per sequence and what each running sequence occupies, so the KV-limited
        concurrency is counted at this length too (not at the final length, which undercounts it by up to
        (prompt + response) / (prompt + response / 2), most for long responses and small tensor parallelism).
        """
        return self.prompt_tokens + self.response_tokens / 2

    @property
    def trained_tokens(self) -> float:
        """Tokens the trainer consumes per step: the ranking numerator."""
        return self.samples * self.context_tokens

    def rank_tokens(self, dp: int) -> float:
        """Tokens the busiest of `dp` data-parallel ranks trains: a sequence is never split across DP ranks
        (context parallelism splits it, inside a rank's group), so it takes ceil(samples / dp) mean-length
        sequences of each minibatch, and the ranks take every optimizer step together. Data parallelism wider
        than a minibatch's samples leaves ranks idle and gains nothing."""
        per_step = ceil(self.samples / self.minibatches)
        return self.minibatches * ceil(per_step / max(1, dp)) * self.context_tokens

    def micro_batches_per_step(self, dp: int, budget: int) -> int:
        """Micro-batches of at most `budget` tokens the busiest rank runs in each optimizer step."""
        return max(1, ceil(self.rank_tokens(dp) / self.minibatches / budget))


def workload(
    *,
    batch_prompts: int,
    group_size: int,
    max_prompt_len: int,
    max_response_len: int,
    staleness: int,
    decoupled: bool,
    reference: bool,
    lora: bool,
    mtp_tokens: int = 0,
    mtp_acceptance: float = 0.0,
    mtp_draft_layers: int = 0,
    minibatches: int = 1,
    agent: AgentWork | None = None,
    interrupt: bool = True,
    oversample: float = 1.0,
) -> Workload:
    """Build a Workload with the documented mean-length assumptions."""
    return Workload(
        samples=batch_prompts * group_size,
        group_size=group_size,
        prompt_tokens=max_prompt_len * PROMPT_FRACTION,
        response_tokens=max_response_len * RESPONSE_FRACTION,
        max_prompt=max_prompt_len,
        max_response=max_response_len,
        staleness=staleness,
        decoupled=decoupled,
        reference=reference,
        lora=lora,
        mtp_tokens=mtp_tokens,
        mtp_acceptance=mtp_acceptance,
        mtp_draft_layers=mtp_draft_layers,
        minibatches=minibatches,
        agent=agent,
        interrupt=interrupt,
        oversample=oversample,
    )


def agent_work(
    *, max_turns: int, expected_turns: float | None, max_tokens_per_turn: int, max_response_len: int, tool_s: float
) -> AgentWork:
    """An agent's per-trajectory work under the documented assumptions: `expected_turns` calls (unset: half of
    max_turns, at least one, as lengths default to half their caps), each generating RESPONSE_FRACTION of its
    token cap, but no more together than the trajectory's mean response (RESPONSE_FRACTION of max_response_len,
    which the trainer's workload counts): a long episode of many turns runs into its context budget."""
    turns = expected_turns if expected_turns is not None else max(1.0, max_turns * TURNS_FRACTION)
    cap = min(max_tokens_per_turn, max_response_len)
    per_turn = min(cap * RESPONSE_FRACTION, max_response_len * RESPONSE_FRACTION / turns)
    return AgentWork(float(turns), per_turn, cap, tool_s)


def accepted_tokens_per_step(k: int, a: float) -> float:
    """Expected tokens emitted per verification step with k draft tokens and per-token acceptance a.

    Leviathan et al. 2023 (speculative decoding, eq. 1): E = (1 − a^(k+1)) / (1 − a); 1 without drafting.
    """
    if k <= 0:
        return 1.0
    return (1 - a ** (k + 1)) / (1 - a)
