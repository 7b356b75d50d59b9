"""`EngineClient`: a rollout engine actor as the driver sees it, the one place that turns a call into a Ray call.

Every method sends one call to the `RolloutEngine` actor and returns its `ObjectRef` at once (`ray.get` or
`ray.wait` it, or take its `.future()`); the types say what each resolves to. Workflows, the weight path, the
post-sync check, phase switches and teachers call engines only through it, so a renamed or re-typed engine method
is one change here and a type error at every caller, not a string that fails at run time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .engine import SampleRequest
from .weight_sync import DEFAULT_BUCKET_BYTES, TensorMeta

__all__ = ["EngineClient"]

Ref = Any  # ray.ObjectRef[...]: Ray's generic is not subscriptable at run time


class EngineClient:
    """Typed calls to one engine actor (`rollout_engine_actor`); `actor` is the Ray handle."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    # ---------------------------------------------------------------- lifecycle

    def ready(self) -> Ref:
        """→ float: seconds the engine took to start (raises the error that stopped it)."""
        return self.actor.ready.remote()

    def healthy(self) -> Ref:
        """→ bool: whether vLLM's engine core (and an agent endpoint) still run."""
        return self.actor.healthy.remote()

    def node_id(self) -> Ref:
        """→ str: the Ray node the engine runs on."""
        return self.actor.node_id.remote()

    def node_ids(self) -> Ref:
        """→ list[str]: the Ray nodes the engine's model runs on (its workers' nodes for an engine across nodes)."""
        return self.actor.node_ids.remote()

    def process_facts(self) -> Ref:
        """→ dict: the actor's and its vLLM workers' threads and determinism settings."""
        return self.actor.process_facts.remote()

    def shutdown(self) -> Ref:
        """→ None: stop serving and the engine-core process."""
        return self.actor.shutdown.remote()

    # ---------------------------------------------------------------- generation and scoring

    def generate(self, requests: Sequence[SampleRequest | Mapping[str, Any]]) -> Ref:
        """→ list[list[engine.Sample]]: each request's samples, each token with its behaviour log-prob and version."""
        return self.actor.generate.remote(list(requests))

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> Ref:
        """→ list[list[float]]: log p(x_t | x_<t), t ≥ 1, of each sequence at temperature 1."""
        return self.actor.prompt_logprobs.remote([list(s) for s in sequences])

    def prompt_logprobs_by_core(self, sequences: Sequence[Sequence[int]]) -> Ref:
        """→ list[list[list[float]]]: `prompt_logprobs` scored on each engine core (data-parallel rank), by core."""
        return self.actor.prompt_logprobs_by_core.remote([list(s) for s in sequences])

    def get_version(self) -> Ref:
        """→ int: the policy version new tokens are stamped with."""
        return self.actor.get_version.remote()

    def spec_decode_metrics(self) -> Ref:
        """→ dict[str, float]: cumulative speculative-decoding counters (empty without it)."""
        return self.actor.spec_decode_metrics.remote()

    # ---------------------------------------------------------------- weight updates

    def update_weights_from_path(self, path: str, version: int) -> Ref:
        """→ float: seconds; load safetensors from `path` as policy `version`."""
        return self.actor.update_weights_from_path.remote(path, version)

    def update_weights_from_shared_memory(self, path: str, meta: Any, version: int) -> Ref:
        """→ float: seconds; load the weights in the shared-memory segment `path` (laid out by `meta`) as `version`."""
        return self.actor.update_weights_from_shared_memory.remote(path, meta, version)

    def update_lora_adapter(self, path: str, version: int) -> Ref:
        """→ float: seconds; serve the PEFT adapter in `path` as policy `version`."""
        return self.actor.update_lora_adapter.remote(path, version)

    def init_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str | None = None) -> Ref:
        """→ int: join the trainer's weight-sync group as `rank` (returns once the trainer joins too)."""
        return self.actor.init_sync_group.remote(host, port, rank, world_size, backend)

    def init_sync_groups(self, groups: Mapping[str, Any], rank: int) -> Ref:
        """→ int: join the trainer's weight-sync groups (`weight_sync.SyncGroups`), `rank` first in each."""
        return self.actor.init_sync_groups.remote(dict(groups), rank)

    def sync_shards(self, meta: Sequence[TensorMeta]) -> Ref:
        """→ list[dict]: each worker's TP rank and what it receives of each tensor under tp slicing."""
        return self.actor.sync_shards.remote(list(meta))

    def sync_stats(self) -> Ref:
        """→ list[dict[str, int]]: bytes and tensors the last broadcast sync brought each worker."""
        return self.actor.sync_stats.remote()

    def update_weights_broadcast(
        self, meta: Sequence[TensorMeta], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Ref:
        """→ float: seconds; receive the trainer's broadcast of `meta` as policy `version`."""
        return self.actor.update_weights_broadcast.remote(list(meta), version, bucket_bytes)

    def close_sync_group(self) -> Ref:
        """→ None: leave the weight-sync group."""
        return self.actor.close_sync_group.remote()

    # ---------------------------------------------------------------- colocated phases

    def sleep(self, level: int = 1) -> Ref:
        """→ None: release (level 2) or offload (level 1) the weights and drop the KV cache."""
        return self.actor.sleep.remote(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> Ref:
        """→ None: undo `sleep` (`tags`: weights or kv_cache alone)."""
        return self.actor.wake_up.remote(list(tags) if tags else None)

    # ---------------------------------------------------------------- agents

    def endpoint(self) -> Ref:
        """→ str: the OpenAI base URL agents call."""
        return self.actor.endpoint.remote()

    def open_sessions(self, keys: Sequence[str], timeout_s: float) -> Ref:
        """→ int: admit agent calls with these keys for `timeout_s` seconds."""
        return self.actor.open_sessions.remote(list(keys), timeout_s)

    def close_sessions(self, keys: Sequence[str]) -> Ref:
        """→ list[SessionRecord | None]: stop these sessions and return what each recorded."""
        return self.actor.close_sessions.remote(list(keys))
