"""Model-owned THD packing for linear-attention layers (Gated DeltaNet, the Qwen3.5/3.6 hybrid family).

A packed micro-batch is one row of several sequences. Attention layers are kept apart by ``cu_seqlens``
(`packed_forward`), but a Gated-DeltaNet layer mixes tokens two more ways: a causal depthwise convolution over
the last few tokens, and a recurrence whose state runs along the whole row. transformers' torch fallbacks see
neither boundary (its chunked delta rule swallows ``cu_seqlens`` in ``**kwargs``, its convolution takes none),
so every sequence but the first would start from its neighbour's state: measured 1.5e-2 off per token on a tiny
model. The trainer therefore owns this layer's forward (`gated_deltanet_forward`, installed per module at load)
and hands the packed boundaries to both token mixers through one seam per platform (`LinearKernels`):

- cpu: plain torch, split at the boundaries: the convolution pads each sequence on the left with its own zeros
  (one call for the row), and the delta rule runs transformers' chunked torch kernel over the sequences
  right-padded to their length bucket (the kernel pads to 64-token chunks anyway, so a bucket of 64 costs
  nothing the kernel would not spend; right padding never reaches a real token).
- cuda: flash-linear-attention's (fla-core) varlen Triton kernels, ``chunk_gated_delta_rule(cu_seqlens=...)`` and
  its own causal convolution with ``cu_seqlens``; refused with the package to install when fla does not import.
- npu: the same fla-core kernels on its Triton-Ascend backends where fla and triton-ascend import, else the torch
  path (`kernels_for`). rlc itself imports neither the causal-conv1d CUDA extension nor fla's CUDA backends; fla's
  own ``fla.modules.causal_conv1d`` tries ``causal_conv1d`` when imported, so an image with that package installed
  would load it through fla.

Under Ulysses context parallelism (`context_parallel`) each rank holds a slice of the row's tokens. The layer's
projections are per token, so they run on the slice; an all-to-all then gives each rank all tokens of its share
of the heads (the convolution is per channel and the recurrence per head), the token mixers run over the whole
row with the global boundaries, and a second all-to-all returns the slice. Ring context parallelism would need
the recurrent state passed between ranks, which is not built (`schemas/layout.runtime_gaps` refuses it).
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlc.schemas.layout import FLA_ASCEND_LINEAR_KERNELS, FLA_LINEAR_KERNELS, TORCH_LINEAR_KERNELS

from ..platform import Platform
from .context_parallel import CpShard, all_to_all_autograd

__all__ = [
    "LINEAR_ATTENTION_CLASSES",
    "LinearKernels",
    "gated_deltanet_forward",
    "install_packed_linear_attention",
    "kernels_for",
    "linear_attention_modules",
    "torch_kernels",
]

#: Gated-DeltaNet token mixers whose forward rlc owns (same parameters and maths in each family).
LINEAR_ATTENTION_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
#: The chunked delta rule's chunk: sequences are bucketed by how many chunks they fill.
DELTA_RULE_CHUNK = 64

#: ``conv(x [1, C, L], weight [C, K], activation, bounds) -> [1, C, L]`` per packed sequence.
Conv = Callable[[torch.Tensor, torch.Tensor, str | None, Sequence[int]], torch.Tensor]
#: ``delta_rule(q, k [1, L, H, Dk], v [1, L, H, Dv], g, beta [1, L, H], bounds) -> [1, L, H, Dv]``, q/k l2-normed.
DeltaRule = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor
]


@dataclass(frozen=True)
class LinearKernels:
    """The platform's token mixers for packed rows: the seam a platform's fused kernels plug into."""

    name: str
    conv: Conv
    delta_rule: DeltaRule


# --------------------------------------------------------------------------------------------- torch (cpu)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in (None, "identity"):
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported convolution activation {activation!r}")


def torch_conv(x: torch.Tensor, weight: torch.Tensor, activation: str | None, bounds: Sequence[int]) -> torch.Tensor:
    """Causal depthwise convolution of each packed sequence on its own: K-1 zeros before every sequence.

    One gather builds ``[zeros, seq 0, zeros, seq 1, ...]`` and one unpadded convolution runs over it; output j
    is the window ending at padded position j + K - 1, which holds only its own sequence's tokens and zeros.
    """
    channels, width = weight.shape
    starts, lengths = bounds[:-1], [b - a for a, b in itertools.pairwise(bounds)]
    zero = x.shape[-1]  # index of an appended zero column
    gather = []
    for start, length in zip(starts, lengths, strict=True):
        gather.extend([zero] * (width - 1))
        gather.extend(range(start, start + length))
    padded = F.pad(x, (0, 1)).index_select(-1, torch.tensor(gather, device=x.device))
    out = F.conv1d(padded.to(weight.dtype), weight.unsqueeze(1), groups=channels)
    keep = []
    offset = 0
    for length in lengths:
        keep.extend(range(offset, offset + length))
        offset += length + width - 1
    out = out.index_select(-1, torch.tensor(keep, device=x.device))
    return _activate(out, activation).to(x.dtype)


def torch_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, bounds: Sequence[int]
) -> torch.Tensor:
    """transformers' chunked torch delta rule per packed sequence, sequences batched by length bucket.

    Each bucket holds the sequences that fill the same number of 64-token chunks; they are right-padded to the
    bucket's longest (zeros: the kernel's own padding) and run as one batch from a zero state.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    starts, lengths = bounds[:-1], [b - a for a, b in itertools.pairwise(bounds)]
    buckets: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        buckets.setdefault(-(-length // DELTA_RULE_CHUNK), []).append(i)
    outs, order = [], []
    for members in buckets.values():
        width = max(lengths[i] for i in members)
        offsets = torch.arange(width)
        real = offsets[None, :] < torch.tensor([lengths[i] for i in members])[:, None]
        first = torch.tensor([starts[i] for i in members])[:, None]
        index = torch.where(real, first + offsets[None, :], 0).reshape(-1).to(q.device)
        mask = real.reshape(-1).to(q.device)

        def rows(t: torch.Tensor, index: torch.Tensor = index, mask: torch.Tensor = mask, n: int = len(members)):
            picked = t[0].index_select(0, index)
            picked = picked * mask.view(-1, *([1] * (picked.dim() - 1))).to(picked.dtype)
            return picked.unflatten(0, (n, -1))

        out, _ = torch_chunk_gated_delta_rule(
            rows(q), rows(k), rows(v), g=rows(g), beta=rows(beta), chunk_size=DELTA_RULE_CHUNK
        )
        outs.append(out.flatten(0, 1)[mask])
        order.append(index[mask])
    packed = torch.cat(outs) if len(outs) > 1 else outs[0]
    inverse = torch.argsort(torch.cat(order))
    return packed.index_select(0, inverse).unsqueeze(0)


def torch_kernels() -> LinearKernels:
    return LinearKernels(TORCH_LINEAR_KERNELS, torch_conv, torch_delta_rule)


# --------------------------------------------------------------------------------------------- fused (cuda, npu)


def _fla_kernels(name: str) -> LinearKernels:
    """flash-linear-attention's (fla-core 0.6) varlen delta rule and its own Triton causal convolution.

    fla dispatches both to its Triton-Ascend backends on an NPU (triton-ascend's driver reports ``npu``) and to its
    Triton kernels on CUDA. The convolution is called through `CausalConv1dFunction` (the path of fla's
    ``causal_conv1d(backend="triton")``), never the entry point that also imports fla's CUDA-extension backend, so
    neither platform imports the causal-conv1d package.
    """
    from fla.modules.causal_conv1d import CausalConv1dFunction
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def cumulative(bounds: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cpu = torch.tensor(bounds, dtype=torch.long)
        return cpu.to(device), cpu

    def conv(x: torch.Tensor, weight: torch.Tensor, activation: str | None, bounds: Sequence[int]) -> torch.Tensor:
        cu, cu_cpu = cumulative(bounds, x.device)
        # fla takes [B, T, D]; the seam's [1, C, L] is the same row channels-first.
        out, _ = CausalConv1dFunction.apply(
            x.transpose(1, 2), weight, None, None, None, False, activation, cu, cu_cpu, None
        )
        return out.transpose(1, 2)

    def delta_rule(q, k, v, g, beta, bounds):  # type: ignore[no-untyped-def]
        cu, cu_cpu = cumulative(bounds, q.device)
        out, _ = chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=False
        )
        return out

    return LinearKernels(name, conv, delta_rule)


def _fla_on_ascend() -> bool:
    """Whether fla-core imports on triton-ascend (its device probe reports an NPU); False without either."""
    try:
        from fla.utils import IS_NPU
    except (ImportError, RuntimeError):  # fla or triton missing, or a triton without a driver for this machine
        return False
    return bool(IS_NPU)


def kernels_for(platform: Platform | str) -> LinearKernels:
    """The packed token mixers for `platform` (`schemas.layout.PLATFORM_KERNELS`, which the dry run prints).

    cpu: torch. cuda: fla-core's Triton kernels, or a refusal naming the package (the torch path is exact there too,
    but a python loop over 64-token chunks is no way to train 64K contexts). npu: fla-core's Triton-Ascend kernels
    where fla and its kernel modules import (fla-core 0.6's layout), else the torch path (with a warning line when
    fla imports but its kernels do not), which runs on any torch device; a stock Ascend image
    has neither, and no other Ascend package ships a training Gated-DeltaNet with a stable API (MindSpeed's are
    not installable from an index).
    """
    name = platform if isinstance(platform, str) else platform.name
    if name == "cpu":
        return torch_kernels()
    if name == "npu":
        if not _fla_on_ascend():
            return torch_kernels()
        try:
            return _fla_kernels(FLA_ASCEND_LINEAR_KERNELS)
        except ImportError as exc:  # an fla other than 0.6's layout, or one whose kernel modules fail to import
            print(
                f"rlc: warning: fla imports on this NPU but not its Gated-DeltaNet kernels ({exc}; rlc calls fla-core "
                "0.6's fla.modules.causal_conv1d and fla.ops.gated_delta_rule): they run on the torch path",
                file=sys.stderr,
                flush=True,
            )
            return torch_kernels()
    try:
        return _fla_kernels(FLA_LINEAR_KERNELS)
    except ImportError as exc:
        raise RuntimeError(
            f"Gated-DeltaNet layers on {name} need flash-linear-attention's varlen kernels, which are not importable "
            f"({exc}): install fla-core 0.6 (import fla) with triton"
        ) from exc


# --------------------------------------------------------------------------------------------- the layer


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """q/k normalisation as transformers' and fla's kernels do it (fp32, eps 1e-6 under the root)."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _tokens_to_heads(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[c, size, w]`` (my tokens, every rank's head share) → ``[size·c, w]`` (every token, my head share)."""
    got = all_to_all_autograd(x.transpose(0, 1), group)  # [size (source rank = token slice), c, w]
    return got.reshape(-1, x.shape[-1])


def _heads_to_tokens(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[size·c, w]`` (every token, my head share) → ``[c, size·w]`` (my tokens, every head, in head order)."""
    parts = x.unflatten(0, (size, -1))  # token slice i goes to rank i
    got = all_to_all_autograd(parts, group)  # [size (source rank = head share), c, w]
    return got.transpose(0, 1).reshape(got.shape[1], -1)


def _by_head_share(t: torch.Tensor, size: int) -> torch.Tensor:
    """``[c, H·d]`` → ``[c, size, H/size·d]``: contiguous head shares, one per cp rank."""
    return t.unflatten(-1, (size, -1))


def gated_deltanet_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """A Gated-DeltaNet layer's training forward with the packed row's boundaries (and Ulysses CP) honoured.

    Bound to each linear-attention module by `install_packed_linear_attention`. Calls without packed boundaries
    (generation, unpacked padded batches) go to transformers' own forward unchanged.
    """
    shard: CpShard | None = kwargs.get("rlc_cp")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        cu = kwargs.get("rlc_seq_bounds")
    if shard is None and cu is None:
        return self._rlc_hf_forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    if cache_params is not None:
        raise ValueError("a packed row is a training forward: call the model with use_cache=False")
    if hidden_states.shape[0] != 1:
        raise ValueError("packed linear attention takes one packed row")
    kernels: LinearKernels = self._rlc_kernels
    size = shard.size if shard is not None else 1
    if shard is not None and shard.kind != "ulysses":
        raise NotImplementedError(f"{shard.kind} context parallelism is not built for linear-attention layers")
    bounds = [int(b) for b in (shard.cu_seqlens if shard is not None else cu).tolist()]
    hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
    if hk % size or hv % size:
        raise ValueError(f"Ulysses context parallelism: {hk} key / {hv} value heads do not split over cp {size}")
    x = hidden_states[0]  # [c, hidden]: this rank's tokens
    mixed = self.in_proj_qkv(x)  # [c, 2·Hk·dk + Hv·dv]
    z = self.in_proj_z(x).unflatten(-1, (hv, dv))
    beta = self.in_proj_b(x).sigmoid()  # [c, Hv]
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [c, Hv], fp32
    weight = self.conv1d.weight.squeeze(1)  # [conv_dim, K]
    q_w, k_w, v_w = weight.split([self.key_dim, self.key_dim, self.value_dim])
    if size > 1:
        q_in, k_in, v_in = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        share = torch.cat([_by_head_share(t, size) for t in (q_in, k_in, v_in)], dim=-1)  # [c, size, w]
        rank = shard.rank  # type: ignore[union-attr]
        mixed = _tokens_to_heads(share, size, shard.group)  # type: ignore[union-attr]
        beta = _tokens_to_heads(_by_head_share(beta, size), size, shard.group)  # type: ignore[union-attr]
        g = _tokens_to_heads(_by_head_share(g, size), size, shard.group)  # type: ignore[union-attr]
        q_w, k_w, v_w = (w.unflatten(0, (size, -1))[rank] for w in (q_w, k_w, v_w))
        hk, hv = hk // size, hv // size
    conv_out = kernels.conv(mixed.T.unsqueeze(0), torch.cat([q_w, k_w, v_w]), self.activation, bounds)
    query, key, value = conv_out[0].T.split([hk * dk, hk * dk, hv * dv], dim=-1)
    query, key = (_l2norm(t.unflatten(-1, (hk, dk))) for t in (query, key))
    value = value.unflatten(-1, (hv, dv))
    if hv // hk > 1:
        query, key = (t.repeat_interleave(hv // hk, dim=1) for t in (query, key))
    core = kernels.delta_rule(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), bounds
    )[0]  # [L or c·size, Hv_local, dv]
    if size > 1:
        core = _heads_to_tokens(core.flatten(1), size, shard.group).unflatten(-1, (-1, dv))  # type: ignore[union-attr]
    core = core.to(z.dtype)
    out = self.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(core.shape[0], -1)
    return self.out_proj(out).unsqueeze(0)


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every Gated-DeltaNet token mixer in `model`, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in LINEAR_ATTENTION_CLASSES]


def install_packed_linear_attention(model: torch.nn.Module, platform: Platform | str) -> LinearKernels | None:
    """Give every linear-attention module of `model` rlc's packed forward with `platform`'s kernels.

    Returns the kernels (None when the model has no such layers). Refuses, before training starts, a platform
    whose kernels are missing.
    """
    modules = linear_attention_modules(model)
    if not modules:
        return None
    kernels = kernels_for(platform)
    for module in modules:
        module._rlc_hf_forward = module.forward
        module._rlc_kernels = kernels
        module.forward = types.MethodType(gated_deltanet_forward, module)
    return kernels
