"""Which part of each checkpoint tensor a tensor-parallel vLLM worker serves, and how that part is loaded exactly.

With the plan's ``weight_sync_slicing: tp`` the trainer sends each engine worker only its tensor-parallel shard of
every weight vLLM splits across TP ranks, and full copies of the replicated ones. The worker describes its shards
(`plan_shards`, asked of its own layers), the trainer cuts them out of the gathered tensors (`cut`), and the worker
copies each one into its parameter where vLLM's own loader would have put it (`load_shard`), without handing vLLM the
full tensor; an engine that re-processes its weights after loading gets each shard placed at its own rows of a
full-shape tensor for vLLM's reload instead, whose loader reads exactly those rows.

The kinds below were checked against vLLM 0.32's loaders for Qwen3 (``linear.py``, ``parameter.py``,
``vocab_parallel_embedding.py``) and by a test that compares every parameter with a full-tensor reload:

* ``QKVParallelLinear`` weight, from ``q_proj``/``k_proj``/``v_proj``: the rank's heads (a K/V head replicated over
  ``tp // kv_heads`` ranks is the rank's ``rank // replicas``-th), into the fused parameter's q, k or v rows;
* ``MergedColumnParallelLinear`` weight, from ``gate_proj``/``up_proj``: the rank's rows of each, into its rows;
* ``ColumnParallelLinear`` weight and bias: the rank's rows; ``RowParallelLinear`` weight: the rank's columns (its
  bias is replicated);
* ``VocabParallelEmbedding``/``ParallelLMHead`` weight: the rank's rows of the original vocabulary; the rows that
  pad the vocabulary to the shard size are zero, as vLLM's loader leaves them; a tied head is not sent at all (vLLM
  skips it too: it is the embedding's parameter);
* parameters loaded by vLLM's default loader whose shape is the checkpoint's (norms): the whole tensor.

Everything else (another model family, quantized or packed parameters, experts, a name mapped to several shards) is
sent whole and goes through vLLM's loader; those tensors are counted (``whole``), so a plan that expected shards
learns where it got full copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["VERIFIED_MODELS", "Shard", "cut", "load_shard", "plan_shards", "shard_numel", "wire_specs"]

#: vLLM model classes whose ``load_weights`` is AutoWeightsLoader over its name mapper and nothing else, read and
#: tested; other classes get every tensor whole.
VERIFIED_MODELS = frozenset({"Qwen3ForCausalLM"})

#: What travels to the trainer per checkpoint tensor: ``[dim, start, length]`` of the slice it sends this worker, or
#: None for the whole tensor.
WireSpec = list[int] | None


@dataclass(frozen=True)
class Shard:
    """How one checkpoint tensor reaches this worker.

    ``kind``: ``slice`` (``length`` entries of ``dim`` from ``start``, copied into parameter ``param`` at ``offset``
    along the same dim), ``replicated`` (the whole tensor copied into ``param``), ``whole`` (sent whole, loaded by
    vLLM's loader), or ``skip`` (nothing sent: a tied alias vLLM does not load; ``param`` names the parameter it
    aliases, whose tensor a reload hands vLLM under this name too). ``zero_tail``: the parameter's
    rows past the slice are vocabulary padding, zeroed as vLLM's loader zeroes them.
    """

    kind: str
    param: str = ""
    dim: int = 0
    start: int = 0
    length: int = 0
    offset: int = 0
    zero_tail: bool = False

    def wire(self) -> WireSpec:
        if self.kind == "slice":
            return [self.dim, self.start, self.length]
        if self.kind == "skip":
            return [0, 0, 0]
        return None


WHOLE = Shard("whole")


def shard_numel(shape: Sequence[int], spec: WireSpec) -> int:
    """Elements of the piece ``spec`` cuts from a tensor of ``shape``."""
    n = 1
    for d, size in enumerate(shape):
        n *= int(spec[2]) if spec is not None and d == spec[0] else int(size)
    return n


def cut(tensor: torch.Tensor, spec: WireSpec) -> torch.Tensor:
    """The piece of ``tensor`` that ``spec`` names (the tensor itself for None)."""
    return tensor if spec is None else tensor.narrow(spec[0], spec[1], spec[2])


def wire_specs(shards: Sequence[Shard]) -> list[WireSpec]:
    """The sender's view of a worker's shards."""
    return [s.wire() for s in shards]


def plan_shards(model: torch.nn.Module, meta: Sequence[tuple[str, Sequence[int], str]]) -> list[Shard]:
    """This worker's `Shard` of each checkpoint tensor in ``meta`` (names in checkpoint format, global shapes).

    Shards are read off the layers (their class, quantization method and TP geometry), not off the live parameters:
    an engine that repacked its weights after loading (oneDNN on cpu) holds placeholders there, while vLLM's reload
    restores the parameters these layers made, whose loaders the kinds above describe.
    """
    mapper = getattr(type(model), "hf_to_vllm_mapper", None)
    if type(model).__name__ not in VERIFIED_MODELS or not hasattr(mapper, "_map_name_with_shard"):
        return [WHOLE] * len(meta)
    params = dict(model.named_parameters(remove_duplicate=False))
    canonical = {id(p): name for name, p in model.named_parameters()}
    shards = []
    for name, shape, _ in meta:
        mapped = mapper._map_name_with_shard(name)
        vname, shard_id = mapped if mapped is not None else (None, None)
        param = params.get(vname) if vname is not None else None
        if param is None or isinstance(shard_id, list):
            shards.append(WHOLE)
            continue
        module_name, _, attr = vname.rpartition(".")
        module = model.get_submodule(module_name)
        first = canonical.get(id(param), vname)
        if first != vname:
            # A tied alias (the head of a tied model): vLLM's loader skips it, the canonical name loads the parameter.
            shards.append(Shard("skip", first) if _vocab(module) else WHOLE)
            continue
        shards.append(_shard(module, attr, shard_id, param, vname, tuple(int(d) for d in shape)))
    return shards


def _vocab(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    kind = type(module)
    quant = type(getattr(module, "quant_method", None))
    return kind in (VocabParallelEmbedding, ParallelLMHead) and quant is UnquantizedEmbeddingMethod


def _shard(module: torch.nn.Module, attr: str, shard_id: Any, param: Any, vname: str, shape: tuple) -> Shard:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    kind = type(module)
    m: Any = module
    linear = (QKVParallelLinear, MergedColumnParallelLinear, ColumnParallelLinear, RowParallelLinear)
    if kind in linear and type(getattr(m, "quant_method", None)) is UnquantizedLinearMethod:
        tp_rank, tp = int(m.tp_rank), int(m.tp_size)
        if attr == "weight" and len(shape) == 2 and shape[1] == int(m.input_size):
            if kind is QKVParallelLinear and shard_id in ("q", "k", "v"):
                heads = int(m.total_num_heads if shard_id == "q" else m.total_num_kv_heads)
                if shape[0] != heads * int(m.v_head_size if shard_id == "v" else m.head_size):
                    return WHOLE
                size = int(m._get_shard_size_mapping(shard_id))
                rank = tp_rank if shard_id == "q" else tp_rank // int(m.num_kv_head_replicas)
                return _slice(vname, 0, rank * size, size, int(m._get_shard_offset_mapping(shard_id)), shape)
            if kind is MergedColumnParallelLinear and isinstance(shard_id, int) and not isinstance(shard_id, bool):
                sizes = [int(x) for x in m.output_sizes]
                if not 0 <= shard_id < len(sizes) or shape[0] != sizes[shard_id]:
                    return WHOLE
                size = sizes[shard_id] // tp
                return _slice(vname, 0, tp_rank * size, size, sum(sizes[:shard_id]) // tp, shape)
            if shard_id is None and shape[0] == int(m.output_size):
                if kind is ColumnParallelLinear:
                    rows = int(m.output_size_per_partition)
                    return _slice(vname, 0, tp_rank * rows, rows, 0, shape)
                if kind is RowParallelLinear:
                    cols = int(m.input_size_per_partition)
                    return _slice(vname, 1, tp_rank * cols, cols, 0, shape)
            return WHOLE
        if attr == "bias" and shard_id is None and shape == (int(m.output_size),):
            if kind is ColumnParallelLinear:
                rows = int(m.output_size_per_partition)
                return _slice(vname, 0, tp_rank * rows, rows, 0, shape)
            if kind is RowParallelLinear:  # its loader copies the whole bias on every rank
                return Shard("replicated", vname)
        return WHOLE
    if _vocab(module) and attr == "weight" and shard_id is None:
        if shape != (int(m.org_vocab_size), int(m.embedding_dim)):
            return WHOLE
        start = int(m.shard_indices.org_vocab_start_index)
        length = int(m.shard_indices.org_vocab_end_index) - start
        if length > int(m.num_embeddings_per_partition):
            return WHOLE
        return Shard("slice", vname, 0, start, length, 0, zero_tail=True)
    loader = getattr(param, "weight_loader", default_weight_loader)
    if kind is RMSNorm and shard_id is None and tuple(param.shape) == shape and loader is default_weight_loader:
        return Shard("replicated", vname)
    return WHOLE


def _slice(vname: str, dim: int, start: int, length: int, offset: int, shape: tuple) -> Shard:
    """A slice when it lies inside the checkpoint tensor, else whole."""
    if start < 0 or length < 0 or start + length > shape[dim]:
        return WHOLE
    return Shard("slice", vname, dim, start, length, offset)


def load_shard(params: Mapping[str, torch.Tensor], shard: Shard, piece: torch.Tensor) -> None:
    """Copy a received ``piece`` into its parameter where vLLM's loader would put it (``slice``/``replicated``)."""
    param = params[shard.param]
    data = param.data
    if shard.kind == "replicated":
        if tuple(data.shape) != tuple(piece.shape):
            raise ValueError(f"{shard.param}: received {tuple(piece.shape)} for a parameter of {tuple(data.shape)}")
        data.copy_(piece)
        return
    if shard.zero_tail:
        data.narrow(shard.dim, 0, shard.length).copy_(piece)
        data.narrow(shard.dim, shard.length, data.shape[shard.dim] - shard.length).zero_()
        return
    target = data.narrow(shard.dim, shard.offset, shard.length)
    if tuple(target.shape) != tuple(piece.shape):
        raise ValueError(f"{shard.param}: received {tuple(piece.shape)} for a shard of {tuple(target.shape)}")
    target.copy_(piece)
