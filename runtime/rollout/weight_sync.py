"""Moving trainer weights into running vLLM engines: by safetensors file or by collective broadcast.

Two halves of one protocol live here so they cannot drift apart:

* ``WeightSyncExtension`` is mixed into every vLLM worker (``LLM(worker_extension_cls=
  "rlc.runtime.rollout.weight_sync.WeightSyncExtension")``) and is driven by ``collective_rpc``.
  Every path ends in the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``:
  plain ``model.load_weights`` breaks on CPU because vLLM repacks weights after loading, and the
  reload re-runs that processing; a cpu engine whose layers keep their weights (``cpu_gemm``) copies in place.
* ``SyncSender`` (a sending trainer rank) and ``write_safetensors`` are the trainer's side.

Tensors cannot be ``collective_rpc`` arguments (they do not serialise), so the control message is
a path or a list of ``(name, shape, dtype)``; the data travels over stateless process groups that
vLLM's own groups never see. Both sides group tensors into the same flat buckets (``plan_buckets``),
which turns hundreds of small broadcasts into a few large ones.

The plan's ``weight_sync_senders`` (k) trainer ranks send at once: bucket b belongs to sender
``assign_buckets(...)[b]`` (balanced by bytes, computed alike on both sides), and each sender has its own group
with every engine worker (`SyncGroups`). With ``weight_sync_slicing: tp`` each sender has one group per
tensor-parallel rank of the engines, and a worker receives only its shard of each weight (`tp_slices`). A worker
posts the receives of every sender ahead (``IN_FLIGHT`` buckets each), so the senders overlap, and loads in
announced order.
"""

from __future__ import annotations

import os
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

import torch

from .routing_capture import RoutingCaptureExtension
from .shared_weights import SharedWeightsExtension
from .torch_dtypes import dtype_from_str
from .tp_slices import WireSpec, cut, shard_numel

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "IN_FLIGHT",
    "SyncGroups",
    "SyncSender",
    "TensorMeta",
    "WeightSyncExtension",
    "assign_buckets",
    "dtype_from_str",
    "iter_safetensors",
    "one_group",
    "plan_buckets",
    "sync_bucket_bytes",
    "tensor_meta",
    "write_safetensors",
]

TensorMeta = tuple[str, tuple[int, ...], str]
"""(parameter name in HF checkpoint format, shape, dtype name such as ``"float32"``)."""

DEFAULT_BUCKET_BYTES = 256 << 20
# Per-operation limit of the weight-sync group (joining it, each bucket's broadcast). A peer that dies
# without closing its connection (an engine whose vLLM core was killed before it joined) then fails the
# sync after this long instead of the backend's default 30 minutes, and the controller's retry restarts it.
SYNC_TIMEOUT_S = 300
#: Buckets each sender keeps on the wire at once: a sender gathers and packs the next while the last two travel, and
#: a worker has that many receives posted per sender (the memory bound: ``IN_FLIGHT`` buckets per sender).
IN_FLIGHT = 2
#: Receive buffers a worker keeps posted at most (``IN_FLIGHT`` buckets of each sender): many senders get smaller
#: buckets rather than more memory (`sync_bucket_bytes`).
RECEIVE_BUDGET_BYTES = 1 << 30
#: Buckets no smaller than this (per-bucket costs stay small beside the bytes), unless the model is.
MIN_BUCKET_BYTES = 16 << 20


def sync_bucket_bytes(meta: Sequence[TensorMeta], senders: int) -> int:
    """The bucket size of a sync by ``senders``: ``DEFAULT_BUCKET_BYTES`` for a large model and one sender (today's),
    smaller where that leaves each sender fewer than four buckets (no overlap of gathering, sending and loading, nor
    a balanced share) or where ``IN_FLIGHT`` buckets of every sender would pass ``RECEIVE_BUDGET_BYTES``."""
    total = sum(_numel(shape) * dtype_from_str(dt).itemsize for _, shape, dt in meta)
    size = min(DEFAULT_BUCKET_BYTES, RECEIVE_BUDGET_BYTES // (IN_FLIGHT * senders), -(-total // (4 * senders)))
    return max(size, MIN_BUCKET_BYTES)


class SyncGroups(TypedDict):
    """The weight-sync groups of one formation, as the driver announces them to senders and engine workers.

    Group ``g * tp + r`` joins trainer rank ``g`` (its rank 0) with the engine workers of tensor-parallel rank ``r``
    (every worker under ``full`` slicing, where ``tp`` is 1); ``worlds[r]`` counts its members.
    """

    senders: int
    slicing: str  # "full" | "tp"
    tp: int
    addresses: list[list[Any]]  # [host, port] of each group, index g * tp + r
    worlds: list[int]
    backend: str
    bucket_bytes: int  # the senders' and workers' `plan_buckets` size (`sync_bucket_bytes`)
    #: tp slicing: what each TP rank's workers receive of every announced tensor (`tp_slices.WireSpec`), by TP rank.
    slices: list[list[WireSpec]] | None


def one_group(host: str, port: int, world_size: int, backend: str) -> SyncGroups:
    """Today's single group: trainer rank 0 sends every byte to every engine worker."""
    return SyncGroups(
        senders=1,
        slicing="full",
        tp=1,
        addresses=[[host, int(port)]],
        worlds=[int(world_size)],
        backend=backend,
        bucket_bytes=DEFAULT_BUCKET_BYTES,
        slices=None,
    )


def tensor_meta(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """The announcement a receiver needs, in the order the sender will broadcast."""
    return [(name, tuple(t.shape), str(dtype or t.dtype).removeprefix("torch.")) for name, t in state_dict.items()]


def plan_buckets(meta: Sequence[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Split tensor indices into consecutive same-dtype buckets of at most ``bucket_bytes``.

    Sender and receiver both call this on the same ``meta``, so they agree on every bucket's layout
    without exchanging it. A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    size = 0
    dtype = None
    for i, (_, shape, dt) in enumerate(meta):
        nbytes = _numel(shape) * dtype_from_str(dt).itemsize
        if not buckets or dt != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
            dtype = dt
        buckets[-1].append(i)
        size += nbytes
    return buckets


def assign_buckets(meta: Sequence[TensorMeta], buckets: Sequence[Sequence[int]], senders: int) -> list[int]:
    """The sender of each bucket: in bucket order, the sender with the fewest bytes so far (the lowest index on a
    tie), so shares differ by at most one bucket and each sender's buckets keep the announced order. Senders and
    workers compute it alike from the same ``meta``."""
    if senders < 1:
        raise ValueError(f"{senders} weight-sync senders: at least one is needed")
    load = [0] * senders
    owners = []
    for bucket in buckets:
        s = min(range(senders), key=lambda i: (load[i], i))
        owners.append(s)
        load[s] += sum(_numel(meta[i][1]) * dtype_from_str(meta[i][2]).itemsize for i in bucket)
    return owners


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def iter_safetensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from one ``.safetensors`` file or every such file in a directory."""
    from safetensors import safe_open

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {p}")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, fh.get_tensor(name)


def write_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    filename: str = "model.safetensors",
) -> Path:
    """Write ``state_dict`` to ``out_dir/filename`` atomically: a reader never sees a partial file.

    The file is written under a temporary name in the same directory and renamed into place, so an
    engine loading while the trainer writes gets the old file or the new one, never half of each.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses shared or non-contiguous storage (tied embeddings, FSDP views).
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=out)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / filename)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out / filename


def preload_sync_group() -> None:
    """Import the sync group's library now: in a trainer process that has not loaded vLLM, that import is
    seconds of CPU, and a first sync that pays it keeps every engine waiting."""
    import vllm.distributed.utils  # noqa: F401


def _init_group(host: str, port: int, rank: int, world_size: int, backend: str) -> Any:
    # vLLM's helper builds a ProcessGroup outside torch.distributed's global state, so it can coexist
    # with the trainer's FSDP group on one side and vLLM's TP group on the other.
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend=backend, timeout=timedelta(seconds=SYNC_TIMEOUT_S)
    )


def _shutdown(pg: Any) -> None:
    if pg is not None and hasattr(pg, "shutdown"):
        pg.shutdown()


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _bucket_sizes(
    meta: Sequence[TensorMeta], buckets: Sequence[Sequence[int]], specs: Sequence[WireSpec]
) -> list[list[int]]:
    """Elements of each tensor's piece in each bucket (the whole tensor where its spec is None)."""
    return [[shard_numel(meta[i][1], specs[i]) for i in bucket] for bucket in buckets]


def _received(
    pgs: Sequence[Any],
    meta: Sequence[TensorMeta],
    specs: Sequence[WireSpec],
    bucket_bytes: int,
    device: torch.device,
    stats: dict[str, int],
) -> Iterator[tuple[int, torch.Tensor]]:
    """(tensor index, received piece) in announced order, from ``pgs[s]`` for the buckets sender ``s`` owns.

    Up to ``IN_FLIGHT`` receives per sender are posted ahead (each group works in the background), and a
    sender's next bucket is posted as soon as one of its own is taken. Buckets with nothing for this worker
    travel on no group (both sides skip them).
    """
    buckets = plan_buckets(meta, bucket_bytes)
    owners = assign_buckets(meta, buckets, len(pgs))
    sizes = _bucket_sizes(meta, buckets, specs)
    queues = [deque(b for b in range(len(buckets)) if owners[b] == s and sum(sizes[b])) for s in range(len(pgs))]
    posted: dict[int, tuple[torch.Tensor, Any]] = {}
    pending = [0] * len(pgs)

    def post(sender: int) -> None:
        while queues[sender] and pending[sender] < IN_FLIGHT:
            b = queues[sender].popleft()
            flat = torch.empty(sum(sizes[b]), dtype=dtype_from_str(meta[buckets[b][0]][2]), device=device)
            posted[b] = (flat, pgs[sender].broadcast(flat, 0))
            pending[sender] += 1

    for sender in range(len(pgs)):
        post(sender)
    for b, bucket in enumerate(buckets):
        if b in posted:
            flat, work = posted.pop(b)
            work.wait()
            pending[owners[b]] -= 1
            post(owners[b])
            stats["bytes"] += flat.numel() * flat.element_size()
        else:
            flat = torch.empty(0, dtype=dtype_from_str(meta[bucket[0]][2]), device=device)
        for i, piece in zip(bucket, flat.split(sizes[b]), strict=True):
            stats["tensors"] += 1
            shape = list(meta[i][1])
            if specs[i] is not None:
                shape[specs[i][0]] = specs[i][2]
            yield i, piece.view(shape)


class WeightSyncExtension(SharedWeightsExtension, RoutingCaptureExtension):
    """vLLM worker extension: methods here become callable through ``LLM.collective_rpc``.

    vLLM mixes this class into its Worker, so ``self`` is the worker: ``self.reload_weights``,
    ``self.device`` and ``self.rank`` are the worker's. It must not define ``__init__``. It also carries the
    routing capture of rollout routing replay (`routing_capture.RoutingCaptureExtension`), so every plan's
    extension (the speculative-decoding one derives from this) has it.
    """

    def process_facts(self) -> dict:
        """This worker's threads and determinism settings, for RUN/reproducibility.json."""
        from rlc.runtime.run_record import process_facts

        return process_facts()

    def load_from_safetensors(self, path: str) -> int:
        """Reload every weight from a safetensors file or directory; returns the tensor count."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(path):
                count += 1
                yield item

        self._rlc_reload(counted())
        return count

    def init_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> int:
        """Join a single-sender weight-sync group (`one_group`); ``rank`` is this engine's first rank in it."""
        return self.init_sync_groups(one_group(host, port, world_size, backend), rank)

    def init_sync_groups(self, groups: SyncGroups, rank: int) -> int:
        """Join the trainer's weight-sync groups (`SyncGroups`): one per sender, those of this worker's TP rank
        under tp slicing; ``rank`` is this engine's first rank in each. Returns the rank taken.

        A tensor-parallel engine has several workers, and a data-parallel one several engine cores of them (vLLM
        sends a collective call to every core). Under full slicing each worker takes ``rank + its core's DP rank x
        workers per core + its worker rank`` (a worker's own rank counts within its core); under tp slicing a group
        holds one worker of each core, so it takes ``rank + its core's DP rank``. So one call covers the whole
        engine. Blocks until every member of each group has joined, so the caller issues it concurrently with the
        senders'; groups are joined in sender order (each sender joins its groups in TP-rank order, which cannot
        deadlock).
        """
        self.close_sync_group()
        # A core's DP rank is `data_parallel_index` (vLLM resets `data_parallel_rank` to 0 in the cores of a dense
        # model's DP, which it runs as independent engines).
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        tp = int(groups["tp"])
        if groups["slicing"] == "tp":
            if int(parallel.pipeline_parallel_size) != 1:
                raise RuntimeError("weight_sync_slicing 'tp' needs engines without pipeline parallelism")
            if int(parallel.tensor_parallel_size) != tp:
                raise RuntimeError(
                    f"the sync groups are cut for TP {tp}, this engine runs TP {parallel.tensor_parallel_size}"
                )
            tp_rank = _tp_rank()
            my_rank = rank + int(parallel.data_parallel_index)
        else:
            tp_rank = 0
            my_rank = (
                rank + int(parallel.data_parallel_index) * int(parallel.world_size) + int(getattr(self, "rank", 0))
            )
        backend = groups["backend"]
        pgs = []
        try:
            for g in range(int(groups["senders"])):
                host, port = groups["addresses"][g * tp + tp_rank]
                pgs.append(_init_group(host, int(port), my_rank, int(groups["worlds"][tp_rank]), backend))
        except BaseException:
            for pg in pgs:
                _shutdown(pg)
            raise
        self._rlc_sync_pgs = pgs
        self._rlc_sync_groups = dict(groups)
        self._rlc_sync_backend = backend
        return my_rank

    def sync_shards(self, names_shapes_dtypes: Sequence[TensorMeta]) -> dict[str, Any]:
        """This worker's TP rank and size, what it would receive of each announced tensor under tp slicing (the
        senders' cut, `tp_slices.WireSpec`), and how many tensors arrive as shards, replicated, whole (vLLM's own
        loader) or not at all (tied aliases), with the names of the whole ones."""
        meta = [(n, tuple(s), str(d)) for n, s, d in names_shapes_dtypes]
        shards = self._rlc_shards(meta)
        counts = {kind: sum(s.kind == kind for s in shards) for kind in ("slice", "replicated", "whole", "skip")}
        return {
            "tp_rank": _tp_rank(),
            "tp_size": int(self.vllm_config.parallel_config.tensor_parallel_size),  # type: ignore[attr-defined]
            "slices": [s.wire() for s in shards],
            "counts": counts,
            "whole": [name for (name, _, _), s in zip(meta, shards, strict=True) if s.kind == "whole"],
        }

    def _rlc_shards(self, meta: list[TensorMeta]) -> list[Any]:
        from .tp_slices import plan_shards

        cached = getattr(self, "_rlc_shard_plan", None)
        if cached is None or cached[0] != meta:
            cached = (meta, plan_shards(self.model_runner.model, meta))  # type: ignore[attr-defined]
            self._rlc_shard_plan = cached
        return cached[1]

    def receive_broadcast(
        self, names_shapes_dtypes: Sequence[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> int:
        """Receive the tensors the senders broadcast, bucket by bucket in announced order, and load them.

        Every sender's next ``IN_FLIGHT`` buckets are posted at once, so the senders overlap; buckets are consumed
        in order while the reload (or, under tp slicing, the in-place copy of each shard) takes them, so at most
        ``IN_FLIGHT`` buckets per sender beyond the model itself are alive. Returns the number of tensors loaded.
        """
        pgs = getattr(self, "_rlc_sync_pgs", None)
        if not pgs:
            raise RuntimeError("receive_broadcast before init_sync_group")
        groups = self._rlc_sync_groups
        meta = [(n, tuple(s), str(d)) for n, s, d in names_shapes_dtypes]
        device = torch.device("cpu") if self._rlc_sync_backend == "gloo" else self.device
        sliced = groups["slicing"] == "tp"
        shards = self._rlc_shards(meta) if sliced else None
        specs: list[WireSpec] = [s.wire() for s in shards] if shards is not None else [None] * len(meta)
        if sliced and groups.get("slices") is not None and groups["slices"][_tp_rank()] != specs:
            raise RuntimeError("the senders cut other shards than this worker serves (engines of another layout?)")
        stats = {"bytes": 0, "tensors": 0, "slice": 0, "replicated": 0, "whole": 0, "skip": 0}
        self._rlc_sync_stats = stats
        pieces = _received(pgs, meta, specs, bucket_bytes, device, stats)
        if shards is None:
            self._rlc_reload((meta[i][0], piece) for i, piece in pieces)
        else:
            self._rlc_load_shards(meta, shards, pieces, stats)
        return stats["tensors"]

    def sync_stats(self) -> dict[str, int]:
        """What the last broadcast sync brought this worker: bytes received, tensors, tensors by how they arrived
        (``slice``, ``replicated``, ``whole``, ``skip``), and under tp slicing whether shards were copied straight into
        the parameters (``in_place`` 1) or placed for vLLM's reload (0)."""
        return dict(getattr(self, "_rlc_sync_stats", {}))

    def _rlc_load_shards(
        self,
        meta: list[TensorMeta],
        shards: list[Any],
        pieces: Iterator[tuple[int, torch.Tensor]],
        stats: dict[str, int],
    ) -> None:
        """tp slicing: load each received piece where vLLM's loader would put it.

        Where the layers keep their weights (``cpu_gemm``) each shard and replicated tensor is copied straight into
        its parameter (the fused one's q/k/v or gate/up rows), whole tensors go through vLLM's loader, and every
        parameter must have been written. Elsewhere (weights repacked after loading, accelerator kernels) vLLM's
        reload re-processes what it loads, so each shard is placed at its own rows of an uninitialised tensor of
        the full shape and handed to that reload: its loader reads exactly those rows (the slice is what that
        loader narrows, `tp_slices`), and the rest is never read.
        """
        from .cpu_gemm import keeps_weights
        from .tp_slices import load_shard

        model = self.model_runner.model  # type: ignore[attr-defined]
        stats["in_place"] = int(keeps_weights(model))
        if not stats["in_place"]:
            # The reload restores the parameters untied, so a tied alias is handed its parameter's tensor again.
            aliased = {s.param for s in shards if s.kind == "skip"}
            held: dict[str, torch.Tensor] = {}
            later: list[tuple[str, str]] = []

            def placed() -> Iterator[tuple[str, torch.Tensor]]:
                for i, piece in pieces:
                    shard = shards[i]
                    stats[shard.kind] += 1
                    if shard.kind == "skip":
                        if shard.param in held:
                            yield meta[i][0], held[shard.param]
                        else:
                            later.append((meta[i][0], shard.param))
                        continue
                    tensor = piece
                    if shard.kind == "slice":
                        tensor = torch.empty(meta[i][1], dtype=piece.dtype, device=piece.device)
                        tensor.narrow(shard.dim, shard.start, shard.length).copy_(piece)
                    if shard.param in aliased:
                        held[shard.param] = tensor
                    yield meta[i][0], tensor
                for name, param in later:
                    if param in held:
                        yield name, held[param]

            self._rlc_reload(placed())
            return
        params = dict(model.named_parameters(remove_duplicate=False))
        written = set()

        def whole() -> Iterator[tuple[str, torch.Tensor]]:
            for i, piece in pieces:
                shard = shards[i]
                stats[shard.kind] += 1
                if shard.kind == "whole":
                    yield meta[i][0], piece
                elif shard.kind != "skip":
                    load_shard(params, shard, piece)
                    written.add(shard.param)

        loaded = model.load_weights(whole())
        written.update(loaded or ())
        canonical = {name for name, _ in model.named_parameters()}
        missing = sorted(canonical - written)
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} weight(s) unchanged, e.g. {missing[:5]}")
        repack_cpu_experts(model)

    def close_sync_group(self) -> None:
        """Leave the weight-sync groups (idempotent), e.g. before re-forming them with new members."""
        pgs = getattr(self, "_rlc_sync_pgs", None) or []
        self._rlc_sync_pgs = []
        for pg in pgs:
            _shutdown(pg)

    def _rlc_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from rlc.runtime.rollout.cpu_gemm import keeps_weights

        model = self.model_runner.model  # type: ignore[attr-defined]
        if not keeps_weights(model):
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        else:
            # Every weight is in place in checkpoint layout (cpu_gemm): copy into them; nothing to re-process.
            expected = {name for name, _ in model.named_parameters()}
            loaded = model.load_weights(weights)
            missing = sorted(expected - set(loaded)) if loaded is not None else []
            if missing:
                raise RuntimeError(f"weight update left {len(missing)} weight(s) unchanged, e.g. {missing[:5]}")
        repack_cpu_experts(model)


#: Fault injection for testing the post-sync check (`runtime/sync_check`): "1" leaves the CPU expert kernels on
#: their start-up weights, as vLLM does by itself. Never set in a real run.
SKIP_REPACK_ENV = "RLC_FAULT_SKIP_EXPERT_REPACK"


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Re-prepare every fused-MoE layer's expert kernel from its freshly loaded weights; returns how many.

    vLLM sets a fused-MoE layer's kernel up once: on a weight update it copies the new expert weights into the
    parameters but skips the kernel's own ``process_weights_after_loading``. On CPU that kernel computes with a
    prepacked copy of the experts made at start-up, so without this every update after the first load leaves the
    engine computing with the start-up experts, silently (measured on a tiny Qwen3-MoE: 2.3 nats off the trainer
    after reloading the same checkpoint, 1e-6 with this). Accelerator kernels read the parameters and are left as
    they are.
    """
    if not _on_cpu(model) or os.environ.get(SKIP_REPACK_ENV) == "1":
        return 0
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def _on_cpu(model: torch.nn.Module) -> bool:
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "cpu"


class SyncSender:
    """A sending trainer rank's end of the weight-sync groups: rank 0 of its own groups (`SyncGroups`).

    ``SyncSender(host, port, world_size)`` is today's single sender (`one_group`); `SyncSender.of` is sender
    ``index`` of a formation. A sync is ``start`` (the announcement), ``push`` of every tensor of the buckets this
    sender owns, in announced order (each full bucket goes on the wire at once, while the caller gathers the next),
    and ``finish``; ``broadcast`` does all three from a state dict.
    """

    def __init__(self, host: str, port: int, world_size: int, backend: str = "gloo") -> None:
        """Blocks until every engine worker has joined (they call ``init_sync_group`` concurrently)."""
        self._join(one_group(host, port, world_size, backend), 0)

    @classmethod
    def of(cls, groups: SyncGroups, index: int) -> SyncSender:
        """Sender ``index`` of ``groups``: joins its groups (one per TP rank), each as rank 0."""
        sender = cls.__new__(cls)
        sender._join(groups, index)
        return sender

    def _join(self, groups: SyncGroups, index: int) -> None:
        if not 0 <= index < int(groups["senders"]):
            raise ValueError(f"sender {index} of {groups['senders']}")
        self.groups, self.index = groups, index
        self.backend = groups["backend"]
        self.world_size = int(groups["worlds"][0])
        tp = int(groups["tp"])
        self.pgs: list[Any] = []
        try:
            for r in range(tp):
                host, port = groups["addresses"][index * tp + r]
                self.pgs.append(_init_group(host, int(port), 0, int(groups["worlds"][r]), self.backend))
        except BaseException:
            self.close()
            raise
        self.pg = self.pgs[0]
        self.bytes_sent = 0

    def start(
        self,
        meta: Sequence[TensorMeta],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",
    ) -> None:
        """Begin a sync of ``meta``; receivers call ``receive_broadcast`` with the same ``meta``, ``bucket_bytes``."""
        self.meta = [(n, tuple(s), str(d)) for n, s, d in meta]
        self.dev = torch.device("cpu") if self.backend == "gloo" else torch.device(device)
        self.buckets = plan_buckets(self.meta, bucket_bytes)
        owners = assign_buckets(self.meta, self.buckets, int(self.groups["senders"]))
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) if owners[b] == self.index for i in bucket}
        slices = self.groups.get("slices")
        self.specs: list[list[WireSpec]] = (
            [list(row) for row in slices] if slices is not None else [[None] * len(self.meta)]
        )
        if len(self.specs) != len(self.pgs) or any(len(row) != len(self.meta) for row in self.specs):
            raise ValueError("the sync groups' slices do not match the announced tensors")
        self.sizes = [_bucket_sizes(self.meta, self.buckets, row) for row in self.specs]
        self._parts: dict[int, torch.Tensor] = {}
        self._inflight: deque[list[Any]] = deque()
        self._sent: set[int] = set()
        self.bytes_sent = 0

    def owns(self, index: int) -> bool:
        """Whether tensor ``index`` of the announcement is in one of this sender's buckets."""
        return index in self.bucket_of

    def push(self, index: int, tensor: torch.Tensor) -> None:
        """Hand over tensor ``index`` (an owned one, whole, any dtype or device); once its bucket is complete the
        bucket goes on the wire, after the oldest of ``IN_FLIGHT`` buckets still travelling has arrived."""
        name, shape, _ = self.meta[index]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from announced {shape}")
        b = self.bucket_of[index]
        self._parts[index] = tensor.detach()
        bucket = self.buckets[b]
        if all(i in self._parts for i in bucket):
            self._send(b, [self._parts.pop(i) for i in bucket])

    def _send(self, b: int, tensors: list[torch.Tensor]) -> None:
        self._sent.add(b)
        dtype = dtype_from_str(self.meta[self.buckets[b][0]][2])
        while len(self._inflight) >= IN_FLIGHT:
            for work in self._inflight.popleft()[1:]:
                work.wait()
        flats: list[Any] = []
        works: list[Any] = []
        for r, pg in enumerate(self.pgs):
            if not sum(self.sizes[r][b]):
                continue
            parts = [
                cut(t, self.specs[r][i]).reshape(-1).to(device=self.dev, dtype=dtype)
                for i, t in zip(self.buckets[b], tensors, strict=True)
            ]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            flats.append(flat)
            works.append(pg.broadcast(flat, 0))
            self.bytes_sent += flat.numel() * flat.element_size()
        self._inflight.append([flats, *works])

    def finish(self) -> None:
        """Wait until every bucket this sender owns has arrived."""
        unsent = set(self.bucket_of.values()) - self._sent
        if unsent:
            raise RuntimeError(f"sync ended with {len(unsent)} of this sender's buckets not pushed whole")
        while self._inflight:
            for work in self._inflight.popleft()[1:]:
                work.wait()

    def broadcast(
        self,
        state_dict: Mapping[str, torch.Tensor],
        meta: Sequence[TensorMeta] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",
    ) -> list[TensorMeta]:
        """Send this sender's buckets of ``state_dict`` in the order of ``meta`` (default: ``tensor_meta(state_dict)``).

        Receivers must call ``receive_broadcast`` with the same ``meta`` and ``bucket_bytes``.
        Tensors are cast to the announced dtype, so a fp32 trainer can feed a bf16 engine.
        """
        meta = list(meta) if meta is not None else tensor_meta(state_dict)
        self.start(meta, bucket_bytes, device)
        for i, (name, _, _) in enumerate(meta):
            if self.owns(i):
                self.push(i, state_dict[name])
        self.finish()
        return meta

    def close(self) -> None:
        """Leave the groups (idempotent)."""
        pgs, self.pgs = getattr(self, "pgs", []), []
        self.pg = None
        for pg in pgs:
            _shutdown(pg)
