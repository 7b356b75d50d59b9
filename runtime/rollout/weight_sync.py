"""Moving trainer weights into running vLLM engines: by safetensors file or by collective broadcast.

Two halves of one protocol live here so they cannot drift apart:

* ``WeightSyncExtension`` is mixed into every vLLM worker (``LLM(worker_extension_cls=
  "rlc.runtime.rollout.weight_sync.WeightSyncExtension")``) and is driven by ``collective_rpc``.
  Every path ends in the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``:
  plain ``model.load_weights`` breaks on CPU because vLLM repacks weights after loading, and the
  reload re-runs that processing; a cpu engine whose layers keep their weights (``cpu_gemm``) copies in place.
* ``SyncSender`` (trainer rank 0) and ``write_safetensors`` are the trainer's side.

Tensors cannot be ``collective_rpc`` arguments (they do not serialise), so the control message is
a path or a list of ``(name, shape, dtype)``; the data travels over a stateless process group that
vLLM's own groups never see. Both sides group tensors into the same flat buckets (``plan_buckets``),
which turns hundreds of small broadcasts into a few large ones.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .routing_capture import RoutingCaptureExtension

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SyncSender",
    "TensorMeta",
    "WeightSyncExtension",
    "dtype_from_str",
    "iter_safetensors",
    "plan_buckets",
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


def dtype_from_str(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` → ``torch.bfloat16``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


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


class WeightSyncExtension(RoutingCaptureExtension):
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
        """Join the trainer's weight-sync group; ``rank`` is this engine's first rank in it.

        A tensor-parallel engine has several workers, and a data-parallel one several engine cores of them (vLLM
        sends a collective call to every core); each worker takes ``rank + its core's DP rank x workers per core +
        its worker rank`` (a worker's own rank counts within its core), so one call covers the whole engine.
        Blocks until all ``world_size`` members have joined, so the caller issues it concurrently with the
        trainer's ``SyncSender``. Returns the rank taken.
        """
        self.close_sync_group()
        # A core's DP rank is `data_parallel_index` (vLLM resets `data_parallel_rank` to 0 in the cores of a dense
        # model's DP, which it runs as independent engines).
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        core = int(parallel.data_parallel_index) * int(parallel.world_size)
        my_rank = rank + core + int(getattr(self, "rank", 0))
        self._rlc_sync_pg = _init_group(host, port, my_rank, world_size, backend)
        self._rlc_sync_backend = backend
        return my_rank

    def receive_broadcast(
        self, names_shapes_dtypes: Sequence[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> int:
        """Receive tensors broadcast by the group's rank 0 in announced order, then reload them.

        Buckets are received while ``reload_weights`` consumes them, so at most one bucket beyond
        the model itself is alive. Returns the number of tensors loaded.
        """
        pg = getattr(self, "_rlc_sync_pg", None)
        if pg is None:
            raise RuntimeError("receive_broadcast before init_sync_group")
        meta = [(n, tuple(s), str(d)) for n, s, d in names_shapes_dtypes]
        device = torch.device("cpu") if self._rlc_sync_backend == "gloo" else self.device
        count = 0

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for bucket in plan_buckets(meta, bucket_bytes):
                sizes = [_numel(meta[i][1]) for i in bucket]
                flat = torch.empty(sum(sizes), dtype=dtype_from_str(meta[bucket[0]][2]), device=device)
                pg.broadcast(flat, 0).wait()
                for i, piece in zip(bucket, flat.split(sizes), strict=True):
                    count += 1
                    yield meta[i][0], piece.view(meta[i][1])

        self._rlc_reload(received())
        return count

    def close_sync_group(self) -> None:
        """Leave the weight-sync group (idempotent), e.g. before re-forming it with new members."""
        pg = getattr(self, "_rlc_sync_pg", None)
        self._rlc_sync_pg = None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()

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
    """Trainer rank 0's end of the weight-sync group: joins as rank 0 and broadcasts state dicts."""

    def __init__(self, host: str, port: int, world_size: int, backend: str = "gloo") -> None:
        """Blocks until every engine worker has joined (they call ``init_sync_group`` concurrently)."""
        self.backend = backend
        self.world_size = world_size
        self.pg = _init_group(host, port, 0, world_size, backend)

    def broadcast(
        self,
        state_dict: Mapping[str, torch.Tensor],
        meta: Sequence[TensorMeta] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",
    ) -> list[TensorMeta]:
        """Broadcast ``state_dict`` in the order of ``meta`` (default: ``tensor_meta(state_dict)``).

        Receivers must call ``receive_broadcast`` with the same ``meta`` and ``bucket_bytes``.
        Tensors are cast to the announced dtype, so a fp32 trainer can feed a bf16 engine.
        """
        meta = list(meta) if meta is not None else tensor_meta(state_dict)
        dev = torch.device("cpu") if self.backend == "gloo" else torch.device(device)
        for bucket in plan_buckets(meta, bucket_bytes):
            dtype = dtype_from_str(meta[bucket[0]][2])
            parts = []
            for i in bucket:
                name, shape, _ = meta[i]
                t = state_dict[name]
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} differs from announced {shape}")
                parts.append(t.detach().reshape(-1).to(device=dev, dtype=dtype))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            self.pg.broadcast(flat, 0).wait()
        return meta

    def close(self) -> None:
        """Leave the group (idempotent)."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
