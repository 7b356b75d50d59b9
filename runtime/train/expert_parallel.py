"""Expert parallelism on the FSDP2 trainer: each rank of an EP group holds 1/ep of every MoE layer's experts.

The pattern is torchtitan's (`torchtitan/distributed/expert_parallel.py`), on transformers' fused expert weights
(`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`):

* **Weights.** Both expert tensors become DTensors sharded on the expert dimension over the mesh's ``ep``
  dimension; FSDP2 then shards each rank's experts over the ``efsdp`` ranks (those holding the same experts), so
  they live on the 2-D (efsdp, ep) mesh and everything that reads DTensors (the state dict for weight sync and
  export, the gradient-norm clip, checkpoints) sees whole experts.
* **Dispatch.** A layer's (token, expert) pairs are sorted by expert; one all-to-all of the counts tells every
  rank how many rows it will receive per local expert; an all-to-all of the rows (torch's differentiable
  functional collective) sends each to the rank holding its expert; the local experts run on their contiguous
  rows; the reverse all-to-all brings the outputs home, where they are weighted by the router and summed per token,
  as transformers' own loop does on one rank.
* **With TP.** Where TP divides EP the experts are split over the TP ranks first (Megatron's EP groups take the
  TP ranks at expert TP 1): TP peers hold the same tokens, so each serves only its own experts, dispatching by
  all-to-all within its TP column, and the outputs are summed over TP. Backward sums the gradients of the input
  and of the router's weights over TP (`CopyToTP`), each rank having seen only its experts' share.
* **Gradients.** The trainer scales its loss by the dp·cp rank count and FSDP2 averages over its mesh; an expert
  weight is reduced over its efsdp ranks only, having already received the gradients of every EP peer's tokens
  through the backward all-to-all, so its divide factor is set to the whole dp·cp count, as for the other weights.

Expert compute goes through one seam (`ExpertKernel`, chosen per platform by `expert_kernel_for` from the names in
`schemas.layout.PLATFORM_KERNELS`): torch's per-expert GEMM loop on cpu, torch's grouped GEMM on CUDA
(``torch._grouped_mm``, bfloat16), torch_npu's ``npu_grouped_matmul`` on Ascend. `install_expert_kernel` gives a
model's experts that seam on one rank too, so the kernel the dry run names runs with and without expert parallelism.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlc.schemas.layout import (
    GROUPED_MM_EXPERT_KERNEL,
    NPU_GROUPED_MATMUL_EXPERT_KERNEL,
    TORCH_EXPERT_KERNEL_NAME,
)

__all__ = [
    "GROUPED_MM_EXPERT_KERNEL_IMPL",
    "TORCH_EXPERT_KERNEL",
    "CopyToTP",
    "ExpertKernel",
    "expert_kernel_for",
    "expert_modules",
    "install_expert_kernel",
    "install_expert_parallel",
]


@dataclass(frozen=True)
class ExpertKernel:
    """How a rank computes its local experts on rows already grouped by expert: the platform seam."""

    name: str
    run: Callable[[torch.Tensor, list[int], torch.Tensor, torch.Tensor, Callable[..., Any]], torch.Tensor]


def _per_expert_gemms(
    rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act: Callable[..., Any]
) -> torch.Tensor:
    """SwiGLU expert e on its ``counts[e]`` consecutive rows: ``down_e(act(gate_e x) * up_e x)``, as transformers."""
    outs = []
    for e, part in enumerate(torch.split(rows, counts)):
        gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs) if outs else rows.new_zeros((0, down.shape[1]))


TORCH_EXPERT_KERNEL = ExpertKernel(TORCH_EXPERT_KERNEL_NAME, _per_expert_gemms)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``torch._grouped_mm``'s backward rejects the
    stride-0 gradients that a sum or an expand hands it (measured on torch 2.13)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


#: Set when ``torch._grouped_mm`` raised in a forward: this process's experts run on the loop from then on. (A
#: failure in its backward is not caught: it raises there.)
_grouped_mm_failed = False


def _grouped_gemms(
    rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act: Callable[..., Any]
) -> torch.Tensor:
    """The SwiGLU experts as two grouped GEMMs (``torch._grouped_mm``, ``offs`` = running row counts), bfloat16 only:
    the dtype every torch build's grouped GEMM takes; other dtypes take the loop."""
    global _grouped_mm_failed
    if _grouped_mm_failed or rows.dtype != torch.bfloat16 or gate_up.dtype != torch.bfloat16 or not counts:
        return _per_expert_gemms(rows, counts, gate_up, down, act)
    try:
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        hidden = _ContiguousGrad.apply(torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs))
        gate, up = hidden.chunk(2, dim=-1)
        return _ContiguousGrad.apply(
            torch._grouped_mm((act(gate) * up).contiguous(), down.transpose(-2, -1), offs=offs)
        )
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:  # a build whose grouped GEMM does not run on this GPU or these shapes
        _grouped_mm_failed = True
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"rlc: warning: torch._grouped_mm failed ({first}); the experts run on the per-expert GEMM loop "
            "from now on",
            file=sys.stderr,
            flush=True,
        )
        return _per_expert_gemms(rows, counts, gate_up, down, act)


GROUPED_MM_EXPERT_KERNEL_IMPL = ExpertKernel(GROUPED_MM_EXPERT_KERNEL, _grouped_gemms)
#: Some torch builds' ``_grouped_mm`` runs on sm90+ GPUs only; older GPUs take the loop.
GROUPED_MM_MIN_CAPABILITY = (9, 0)


class _NpuGroupedMatmul(torch.autograd.Function):
    """``x [M, K] @ w[e] [K, N]`` per group of consecutive rows on torch_npu's grouped matmul, with its backward:
    the input gradient is the same grouped matmul on the transposed weights, the weight gradient one split on K
    (``group_type`` 2). ``counts`` are per-group row counts (``group_list_type`` 1)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import torch_npu

        ctx.save_for_backward(x, weight, counts)
        return torch_npu.npu_grouped_matmul(
            [x], [weight], group_list=counts, split_item=2, group_type=0, group_list_type=1
        )[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        import torch_npu

        x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch_npu.npu_grouped_matmul(
            [grad], [weight.transpose(1, 2)], group_list=counts, split_item=2, group_type=0, group_list_type=1
        )[0]
        grad_w = torch_npu.npu_grouped_matmul(
            [x.T], [grad], group_list=counts, split_item=3, group_type=2, group_list_type=1
        )[0]
        return grad_x, grad_w, None


def _npu_grouped_gemms(
    rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor, act: Callable[..., Any]
) -> torch.Tensor:
    """The SwiGLU experts as two of torch_npu's grouped matmuls."""
    if not counts:
        return _per_expert_gemms(rows, counts, gate_up, down, act)
    per_group = torch.tensor(counts, dtype=torch.int64, device=rows.device)
    gate, up = _NpuGroupedMatmul.apply(rows, gate_up.transpose(-2, -1), per_group).chunk(2, dim=-1)
    return _NpuGroupedMatmul.apply(act(gate) * up, down.transpose(-2, -1), per_group)


NPU_GROUPED_MATMUL_KERNEL = ExpertKernel(NPU_GROUPED_MATMUL_EXPERT_KERNEL, _npu_grouped_gemms)


def _grouped_mm_runs_here() -> bool:
    """Whether this torch has ``_grouped_mm`` and the GPU is one every build of it runs on (sm90+)."""
    return (
        hasattr(torch, "_grouped_mm")
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= GROUPED_MM_MIN_CAPABILITY
    )


def expert_kernel_for(platform: str) -> ExpertKernel:
    """The experts' GEMMs for `platform` (`schemas.layout.PLATFORM_KERNELS`): the loop on cpu; torch's grouped GEMM
    on CUDA where this torch has one and the GPU is sm90+ (the loop from the first call it fails, said once on
    stderr); torch_npu's grouped matmul on Ascend where torch_npu ships it; else the loop."""
    if platform == "cuda" and _grouped_mm_runs_here():
        return GROUPED_MM_EXPERT_KERNEL_IMPL
    if platform == "npu":
        try:
            import torch_npu
        except ImportError:
            return TORCH_EXPERT_KERNEL
        if hasattr(torch_npu, "npu_grouped_matmul"):
            return NPU_GROUPED_MATMUL_KERNEL
    return TORCH_EXPERT_KERNEL


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The fused expert containers of an MoE model: 3-D ``gate_up_proj`` and ``down_proj`` and ``num_experts``."""
    found = []
    for module in model.modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
            found.append(module)
    return found


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group. For a tensor replicated over TP that each
    TP rank uses only in part (the MoE input feeding the rank's own experts, latent attention's rotary key feeding
    its own heads), each rank's gradient of it is a part of the whole."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over the TP group forward (each rank adds its experts' outputs); identity backward, the gradient of the
    replicated output being each rank's whole gradient of its part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _column_experts(self: torch.nn.Module, flat: torch.Tensor, local: int) -> tuple[torch.Tensor, int]:
    """Expert ids in this rank's TP column: where the experts are split over TP too (`_rlc_tp_size` > 1), global
    expert e lives on split rank r = e // local (tp fastest), so this TP rank serves those with r % tp == its TP
    rank, as column expert (r // tp) · local + e % local; the others (and transformers' dropped slots, id ≥ E) get
    the column's expert count, which the dispatch drops."""
    tp, column = self._rlc_tp_size, self._rlc_ep_size
    experts = local * column * tp
    if tp == 1:
        return torch.where(flat < experts, flat, experts), local * column
    owner = flat // local
    mine = (flat < experts) & (owner % tp == self._rlc_tp_rank)
    return torch.where(mine, (owner // tp) * local + flat % local, local * column), local * column


def _ep_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' expert forward (same arguments, same result) with the experts spread over the EP group."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    tp_group = self._rlc_tp_group
    if tp_group is not None:
        hidden_states = CopyToTP.apply(hidden_states, tp_group)
        top_k_weights = CopyToTP.apply(top_k_weights, tp_group)
    group, size = self._rlc_ep_group, self._rlc_ep_size
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    local_experts = gate_up.shape[0]
    k = top_k_index.shape[-1]
    flat, experts = _column_experts(self, top_k_index.reshape(-1), local_experts)
    weights = top_k_weights.reshape(-1)
    keep = flat < experts
    order = torch.argsort(flat, stable=True)[: int(keep.sum())]
    token_of = order // k
    counts = torch.bincount(flat[order], minlength=experts)
    # counts[r·El + e]: rows this rank sends to local expert e of rank r; after the exchange, got[s, e]: rows
    # rank s sends to my local expert e.
    if size > 1:
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
    else:
        got = counts.clone()
    got = got.view(size, local_experts)
    send_splits = counts.view(size, local_experts).sum(1).tolist()
    recv_splits = got.sum(1).tolist()
    rows = hidden_states[token_of]
    if size > 1:
        rows = wait_tensor(all_to_all_single_autograd(rows, recv_splits, send_splits, group))
    # Received rows are grouped by source rank, then expert; the kernel wants them by expert, then source.
    block = torch.repeat_interleave(torch.arange(size * local_experts, device=got.device), got.reshape(-1))
    by_expert = torch.argsort((block % local_experts) * size + block // local_experts, stable=True)
    out = self._rlc_expert_kernel.run(rows[by_expert], got.sum(0).tolist(), gate_up, down, self.act_fn)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    home = out[back]
    if size > 1:
        home = wait_tensor(all_to_all_single_autograd(home, send_splits, recv_splits, group))
    weighted = home * weights[order, None].to(home.dtype)
    combined = torch.zeros_like(hidden_states).index_add(0, token_of, weighted.to(hidden_states.dtype))
    return _ReduceFromTP.apply(combined, tp_group) if tp_group is not None else combined


def install_expert_parallel(
    model: torch.nn.Module,
    ep_mesh: Any,
    device: torch.device,
    dispatch_mesh: Any = None,
    tp_group: Any = None,
    kernel: ExpertKernel | None = None,
) -> list[torch.nn.Module]:
    """Shard every expert container's weights over `ep_mesh` (this rank keeps its 1/ep, moved to `device`, the
    mesh's) and give it the EP forward: tokens are dispatched over `dispatch_mesh` (a TP column's EP ranks; None
    when the experts are split over TP alone), and with `tp_group` each TP rank serves its own experts and the
    outputs are summed over the TP ranks.

    Call on the loaded, unsharded model (on the host) before FSDP2 wraps it; returns the expert containers (each
    to become its own FSDP unit over the ranks holding the same experts). `kernel` defaults to the one
    `install_expert_kernel` gave the experts, else `device`'s platform's.
    """
    from torch.distributed.tensor import DTensor, Shard

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = expert_modules(model)
    for module in modules:
        experts = int(module.gate_up_proj.shape[0])
        if experts % size:
            raise ValueError(f"expert parallel {size} does not divide the {experts} experts of a MoE layer")
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            shard = full.detach().chunk(size, dim=0)[rank].to(device, copy=True)
            dtensor = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
            setattr(module, name, torch.nn.Parameter(dtensor, requires_grad=full.requires_grad))
        module._rlc_ep_group = dispatch_mesh.get_group() if dispatch_mesh is not None else None
        module._rlc_ep_size = dispatch_mesh.size() if dispatch_mesh is not None else 1
        module._rlc_tp_group = tp_group
        module._rlc_tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        module._rlc_tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        installed = getattr(module, "_rlc_expert_kernel", None)
        module._rlc_expert_kernel = kernel or installed or expert_kernel_for(device.type)
        module.forward = types.MethodType(_ep_forward, module)
    return modules


def install_expert_kernel(model: torch.nn.Module, platform: str) -> ExpertKernel | None:
    """Give every expert container of `model` the platform's expert kernel on one rank (rlc's expert forward with a
    dispatch group of one), in place of transformers' own experts implementation; `install_expert_parallel` later
    spreads the same kernel over an EP group. Returns the kernel (None for a model without routed experts)."""
    modules = expert_modules(model)
    if not modules:
        return None
    kernel = expert_kernel_for(platform)
    for module in modules:
        module._rlc_ep_group, module._rlc_ep_size = None, 1
        module._rlc_tp_group, module._rlc_tp_size, module._rlc_tp_rank = None, 1, 0
        module._rlc_expert_kernel = kernel
        module.forward = types.MethodType(_ep_forward, module)
    return kernel
