"""Pipeline parallelism on the FSDP2 trainer: each stage holds a contiguous run of decoder layers, 1F1B schedule.

The plan's ``pp`` stages split the decoder layers into contiguous runs (the first stages take one more when they
do not divide, as Megatron's even split). A stage keeps the model object whole but replaces the layers other
stages hold with `PassThrough` modules, so every weight keeps its Hugging Face name (checkpoints, the state dict
the weight sync gathers and the optimizer's sharded state never collide between stages), and runs transformers'
own model body on its layers: the first stage from the token ids, the others from the hidden states the previous
stage sent (``inputs_embeds``); only the last applies the final norm and the chunked log-prob head.

Every stage of a data-parallel share builds the same packed micro-batches from the same share (positions and
sequence boundaries included), so only hidden states travel between stages, as point-to-point messages of a
shape both sides know; nothing has to be padded to a fixed budget. The schedule is 1F1B (Narayanan et al. 2021)
in torch.distributed.pipelining's Schedule1F1B order: stage s runs min(P − s, M) forwards, then alternates one
backward and one forward, then drains the backwards, so at most P − s micro-batches' activations are alive on
it. Each send is posted in one batch with the receive from the same neighbour that follows it, so two stages
never wait on each other's sends (on NCCL/HCCL a large send waits for its receive).

The root weights (embeddings, final norm, tied or separate LM head) live on every stage and are used by the first
(embedding) and the last (norm, head); after backward their gradients are summed over the stages, so every
stage's copy takes the same step and stays identical (Megatron's embedding group, generalised). The gradient
norm counts each stage's own layers once and the root weights once. LoRA adapters live inside the layers, so
each stage trains its own (the frozen root weights then take no step); every stage disables its adapters for a
reference pass, and an adapter export gathers each stage's factors on rank 0 (`gather_to_first`), as full weights.
An MoE stage's routers know their decoder layers by name, so each reads its own layers' columns of the engine's
routing that every stage receives with the micro-batch, and its routing statistics are summed with the other
stages' over the stage group (`router.Routing.take_stats`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlc.schemas.layout import split_layers

__all__ = ["BODY_METHOD", "PassThrough", "Pipeline", "find_root", "split_model"]

BODY_METHOD = "rlc_stage_body"
_ACTIVATION, _GRADIENT = 1, 2  # message tags


class PassThrough(torch.nn.Module):
    """A decoder layer another pipeline stage holds: hidden states pass through unchanged."""

    attention_type = "full_attention"

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


@dataclass
class Pipeline:
    """One rank's stage: which layers it holds, its neighbours (global ranks) and the stage group."""

    stage: int
    stages: int
    layers: range
    group: Any  # the ranks of this data-parallel share's stages, in stage order
    ranks: list[int]  # their global ranks
    root: list[torch.nn.Parameter] = field(default_factory=list)  # replicated on every stage
    #: Per stage, the (name, shape, dtype) of its layers' state entries, in order (`merge_across_stages`).
    layer_meta: list[list[tuple[str, tuple[int, ...], str]]] = field(default_factory=list)
    _sends: list[Any] = field(default_factory=list)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    # ------------------------------------------------------------- messages

    def flush(self) -> None:
        """Wait for every send of this pass (their buffers stay alive until then)."""
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends = []

    # ------------------------------------------------------------- schedules

    def forward_only(
        self,
        count: int,
        shape_of: Callable[[int], Sequence[int]],
        dtype: torch.dtype,
        device: torch.device,
        run: Callable[[int, torch.Tensor | None], torch.Tensor | None],
    ) -> None:
        """Micro-batches 0..count-1 through the stages without gradients: `run(j, hidden_in)` returns the hidden
        states to pass on (ignored on the last stage, which keeps what it needs)."""
        for j in range(count):
            hidden = self.exchange([], None if self.first else (shape_of(j), dtype, True), device)
            out = run(j, hidden)
            if not self.last:
                assert out is not None
                self.exchange([(out, True)], None, device)
        self.flush()

    def one_f_one_b(
        self,
        count: int,
        shape_of: Callable[[int], Sequence[int]],
        dtype: torch.dtype,
        device: torch.device,
        run: Callable[[int, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]],
        around_backward: Callable[[int, bool], None] | None = None,
    ) -> None:
        """Forward and backward of micro-batches 0..count-1 in 1F1B order. `run(j, hidden_in)` returns (the hidden
        states to pass on, or the last stage's scaled loss; an extra scaled loss of this stage, e.g. the router's,
        or None). `around_backward(j, starting)` is called before and after micro-batch j's backward (whatever the
        recomputed forward needs from its first run)."""
        pending: dict[int, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = {}

        def forward(j: int, hidden: torch.Tensor | None) -> list[tuple[torch.Tensor, bool]]:
            """Micro-batch j's forward; returns its send to the next stage (not posted yet)."""
            if hidden is not None:
                hidden.requires_grad_()
            out, extra = run(j, hidden)
            pending[j] = (hidden, out, extra)
            return [] if self.last else [(out, True)]

        def grad_shape(j: int) -> tuple[Sequence[int], torch.dtype, bool] | None:
            """What micro-batch j's backward receives from the next stage (the last stage: nothing)."""
            out = pending[j][1]
            return None if self.last else (out.shape, out.dtype, False)

        def backward(j: int, grad: torch.Tensor | None) -> list[tuple[torch.Tensor, bool]]:
            """Micro-batch j's backward; returns its send to the previous stage (not posted yet)."""
            hidden, out, extra = pending.pop(j)
            if around_backward is not None:
                around_backward(j, True)
            # The last stage's output is its scaled loss; the others get their output's gradient from the next.
            tensors, grads = [out], [torch.ones_like(out) if grad is None else grad]
            if extra is not None:
                tensors.append(extra)
                grads.append(torch.ones_like(extra))
            torch.autograd.backward(tensors, grads)
            if around_backward is not None:
                around_backward(j, False)
            if self.first:
                return []
            assert hidden is not None and hidden.grad is not None
            return [(hidden.grad, False)]

        def activation(j: int) -> tuple[Sequence[int], torch.dtype, bool] | None:
            return None if self.first else (shape_of(j), dtype, True)

        # torch.distributed.pipelining's Schedule1F1B order: P − s warm-up forwards, then backward and forward in
        # turn, then the remaining backwards. Each send to a neighbour is posted in one batch with the receive
        # from that same neighbour that follows it, so on NCCL/HCCL (where a large send waits for its receive)
        # two stages never wait on each other's sends.
        warmup = min(self.stages - self.stage, count)
        sends: list[tuple[torch.Tensor, bool]] = []
        done_f = done_b = 0
        for _ in range(warmup):
            hidden = self.exchange([], activation(done_f), device)
            out_sends = forward(done_f, hidden)
            done_f += 1
            if done_f < warmup:
                self.exchange(out_sends, None, device)
            else:
                sends = out_sends  # posted with the first backward's receive
        while done_b < count:
            grad = self.exchange(sends, grad_shape(done_b), device)
            sends = backward(done_b, grad)
            done_b += 1
            if done_f < count:
                hidden = self.exchange(sends, activation(done_f), device)
                sends = forward(done_f, hidden)
                done_f += 1
        self.exchange(sends, None, device)
        self.flush()

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, bool]],
        receive: tuple[Sequence[int], torch.dtype, bool] | None,
        device: torch.device,
    ) -> torch.Tensor | None:
        """Post `sends` ((tensor, forward?)) and the receive ((shape, dtype, forward?)) as one batch; waits for the
        receive and returns its tensor (the sends complete by `flush`)."""
        ops, buf = [], None
        for tensor, forward in sends:
            data = tensor.detach().contiguous()
            dst = self.ranks[self.stage + (1 if forward else -1)]
            ops.append(dist.P2POp(dist.isend, data, dst, tag=_ACTIVATION if forward else _GRADIENT))
            self._sends.append((None, data))  # kept alive until flush
        if receive is not None:
            shape, dt, forward = receive
            buf = torch.empty(tuple(shape), dtype=dt, device=device)
            src = self.ranks[self.stage + (-1 if forward else 1)]
            ops.append(dist.P2POp(dist.irecv, buf, src, tag=_ACTIVATION if forward else _GRADIENT))
        if not ops:
            return None
        works = dist.batch_isend_irecv(ops)
        if receive is None:
            self._sends.extend((work, None) for work in works)
            return None
        for work in works:
            work.wait()
        return buf

    # ------------------------------------------------------------- the shared root weights

    def sum_root_grads(self) -> None:
        """Sum the root weights' gradient shards over the stages (a stage that did not use one adds zeros)."""
        for p in self.root:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
            dist.all_reduce(local, group=self.group)

    def merge_across_stages(self, local: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, Any]:
        """Every stage's {name: (shape, dtype)} as one dict in model order, on every stage (collective over the
        stages): the root entries before the layers, each stage's layers in stage order, the root entries after.
        Remembers each stage's layer entries for `gather_to_first`.

        Metadata only, exchanged once at start-up as a pickled object: torch's object collectives serialise into a
        byte tensor on the group's device (the current CUDA / NPU device under nccl / hccl, the host under gloo),
        so they run on every backend rlc uses. Weights never travel this way."""
        parts: list[Any] = [None] * self.stages
        dist.all_gather_object(parts, local, group=self.group)
        self.layer_meta = [
            [(k, tuple(shape), dtype) for k, (shape, dtype) in part.items() if ".layers." in k] for part in parts
        ]
        return _in_model_order(parts)

    def gather_to_first(
        self, local: dict[str, torch.Tensor], device: torch.device, only: Callable[[str], bool] | None = None
    ) -> dict[str, torch.Tensor] | None:
        """The whole model's tensors on the first stage, in model order (None on the others); collective over the
        stage leaders. Each later stage sends its layers' tensors point to point from `device` (the group's: nccl
        and hccl take device tensors only), and the first stage receives them into buffers of the shapes and
        dtypes `merge_across_stages` recorded, then keeps them on the host like its own. `only` picks the layer
        entries that travel (LoRA factors alone for an adapter); `local` then holds just those."""

        def wanted(stage: int) -> list[tuple[str, tuple[int, ...], str]]:
            return [m for m in self.layer_meta[stage] if only is None or only(m[0])]

        if not self.first:
            for name, _, _ in wanted(self.stage):
                dist.send(local[name].to(device), dst=self.ranks[0], group=self.group)
            return None
        parts: list[dict[str, torch.Tensor]] = [local]
        for stage in range(1, self.stages):
            part = {}
            for name, shape, dtype in wanted(stage):
                buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.recv(buf, src=self.ranks[stage], group=self.group)
                part[name] = buf.to("cpu")
            parts.append(part)
        return _in_model_order(parts)

    def sum_over_stages(self, value: float, device: torch.device) -> float:
        """`value` summed over the stages (a step's loss: the last stage's plus the earlier stages' router losses)."""
        box = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(box, group=self.group)
        return float(box.item())

    def broadcast_from_last(self, obj: Any) -> Any:
        """The last stage's `obj` on every stage (results only the last stage computes: a step's statistics, as an
        object; see `merge_across_stages`)."""
        box = [obj if self.last else None]
        dist.broadcast_object_list(box, src=self.ranks[-1], group=self.group)
        return box[0]


def _in_model_order(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    first = list(parts[0].items())
    split = next((i for i, (k, _) in enumerate(first) if ".layers." in k), len(first))
    rest = [(k, v) for k, v in first[split:] if ".layers." not in k]
    layers = [(k, v) for part in parts for k, v in part.items() if ".layers." in k]
    return dict(first[:split] + layers + rest)


def split_model(model: torch.nn.Module, pp_mesh: Any) -> Pipeline:
    """Keep this rank's stage of `model` in place (see the module docstring); call before FSDP2 wraps it."""
    from .parallelize import decoder_layers

    stages, stage = pp_mesh.size(), pp_mesh.get_local_rank()
    inner = getattr(model, "model", model)
    layers = decoder_layers(model)
    mine = split_layers(len(layers), stages)[stage]
    for i in range(len(layers)):
        if i not in mine:
            inner.layers[i] = PassThrough()
    if stage != stages - 1:  # the final norm belongs to the last stage; its weight stays (a root weight)
        inner.norm.forward = types.MethodType(lambda _self, x: x, inner.norm)
    ranks = [int(r) for r in pp_mesh.mesh.tolist()]
    pipe = Pipeline(stage, stages, mine, pp_mesh.get_group(), ranks)
    setattr(model, BODY_METHOD, types.MethodType(_stage_body, model))
    return pipe


def find_root(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights outside the decoder layers (embeddings, final norm, head): every stage holds them. Call after
    FSDP2 has replaced the parameters with sharded ones."""
    return [p for name, p in model.named_parameters() if ".layers." not in name and p.requires_grad]


def _stage_body(
    model: torch.nn.Module, input_ids: torch.Tensor, body_kwargs: dict[str, Any], inputs_embeds: torch.Tensor | None
) -> torch.Tensor:
    """This stage's layers: from the token ids (first stage) or the previous stage's hidden states."""
    if inputs_embeds is None:
        return model.model(input_ids=input_ids, **body_kwargs).last_hidden_state
    return model.model(inputs_embeds=inputs_embeds, **body_kwargs).last_hidden_state
