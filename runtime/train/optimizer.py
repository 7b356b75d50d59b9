"""The trainer's AdamW, one per FSDP unit, with the layout's optimizer offload and a mesh-aware gradient clip.

One optimizer per FSDP unit (each decoder layer, then the root's embeddings/norm/head) lets optimizer offload
keep AdamW's moments in host memory and bring one unit's moments to the device for its update, so the
device's extra peak is one unit's moments, as the planner's memory model prices it. Without offload the
split changes nothing: AdamW updates each parameter independently.

Gradient clipping: `clip_grad_norm_` cannot combine DTensor gradients that live on different meshes (TP
weights on the 2-D dp·cp × tp mesh, embeddings and norms on the dp·cp mesh), so the norm is computed per
mesh and the parts are combined: sqrt(Σ_mesh ‖g_mesh‖²).

The update is one fused kernel per parameter group (``fused=True`` where torch has one for the device, else
``foreach``): torch's default on cpu is a Python loop over tensors, which took 9.4 ms of a 2-layer model's
step against 1.1 ms fused (same model, one thread). Fused and foreach kernels take tensors of one mesh at a
time, so each unit's parameters are grouped by the mesh they live on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["FUSED_ADAMW_DEVICES", "UnitOptimizer", "clip_grad_norm", "grad_square_norm", "scale_grads"]

#: Device types with a fused AdamW kernel in torch (elsewhere the multi-tensor ``foreach`` path runs).
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda"})


class UnitOptimizer:
    """AdamW over parameter groups (FSDP units), optionally with host-resident moments between steps."""

    def __init__(
        self,
        units: Sequence[Sequence[torch.nn.Parameter]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        device: torch.device,
        offload: bool,
    ) -> None:
        kernel = {"fused": True} if device.type in FUSED_ADAMW_DEVICES else {"foreach": True}
        self.optimizers = [
            torch.optim.AdamW(_groups_by_mesh(params), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kernel)
            for params in units
            if params
        ]
        self.device = device
        self.offload = offload
        self.on_host = False  # moments moved away by a colocated phase switch

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        for opt in self.optimizers:
            if self.offload:
                _move_state(opt, self.device)
            opt.step()
            if self.offload:
                _move_state(opt, torch.device("cpu"))

    @property
    def lr(self) -> float:
        return float(self.optimizers[0].param_groups[0]["lr"])

    def move_state(self, device: torch.device) -> None:
        """Move every moment to `device` (colocated phase switches)."""
        for opt in self.optimizers:
            _move_state(opt, device)

    def state_tensors(self) -> Iterable[torch.Tensor]:
        for opt in self.optimizers:
            for state in opt.state.values():
                yield from (v for k, v in state.items() if torch.is_tensor(v) and k != "step")


def _groups_by_mesh(params: Sequence[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """Parameter groups of one mesh each (plain tensors form their own group), in first-seen order."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    return [{"params": group} for group in groups.values()]


def _move_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step" and value.device != device:
                state[key] = value.to(device, non_blocking=device.type != "cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The storage a DTensor gradient writes to (``to_local()`` may hand back a copy)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def grad_square_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Σ‖g‖² of the parameters' whole gradients, over every mesh they live on (collective over those meshes)."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = getattr(p.grad, "device_mesh", None)
            by_mesh.setdefault(key, []).append(p.grad)
    squares = 0.0
    for mesh, grads in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if mesh is not None and hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    return squares


def scale_grads(params: Iterable[torch.nn.Parameter], coef: float) -> None:
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip gradients to a global norm `max_norm` across every mesh they live on; returns the norm before.

    A non-finite norm (a NaN or infinite gradient, or squares past float32) is returned as it is and nothing is
    scaled: the caller must skip the optimizer step (`TrainerWorker._nonfinite`). NaN compares False with any
    bound, so an unguarded clip would pass NaN gradients to AdamW, and scaling by max_norm/inf zeroes finite ones.
    """
    params = list(params)
    total = grad_square_norm(params) ** 0.5
    if max_norm > 0 and math.isfinite(total) and total > max_norm:
        scale_grads(params, max_norm / (total + 1e-6))
    return total
