"""Per-token log-probs and entropy from hidden states without materialising [T, V] fp32 logits.

For a 150k vocabulary and a 32k-token micro-batch the fp32 logits alone are ~19 GB, more than the
rest of the activations. ``chunked_logprobs_entropy`` computes them ``chunk_size`` tokens at a time
inside a custom autograd function whose backward recomputes each chunk's logits, so at most one
chunk of logits is alive in forward or backward. Logits are divided by ``temperature`` so the
log-probs match what vLLM reports for sampling at that temperature.
"""

from __future__ import annotations

import torch

__all__ = [
    "chunked_logprobs_entropy",
    "entropy_from_logits",
    "logprobs_entropy_reference",
    "logprobs_from_logits",
]


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of ``targets`` under ``softmax(logits / temperature)``, computed in fp32."""
    z = logits.float() / temperature
    return z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last axis, in fp32.

    ``−Σ p·log p`` rather than ``logsumexp − E[z]``: the latter cancels catastrophically in fp32
    when the distribution is peaked, which is exactly when RL policies end up.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def logprobs_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unchunked reference: full logits, then log-probs and entropy. For tests and small inputs."""
    logits = hidden @ weight.t()
    return logprobs_from_logits(logits, targets, temperature), entropy_from_logits(logits, temperature)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # Matmul in the model dtype (as the HF lm_head and vLLM do), softmax maths in fp32.
    return (h @ weight.t()).float() / temperature


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Forward and backward over token chunks; saves only inputs and per-token logsumexp."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):  # type: ignore[override]
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, n, chunk_size):
            sl = slice(start, min(start + chunk_size, n))
            z = _chunk_logits(hidden[sl], weight, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            logp_all = z - lse_c.unsqueeze(-1)
            lse[sl] = lse_c
            logp[sl] = logp_all.gather(-1, targets[sl].unsqueeze(-1)).squeeze(-1)
            ent[sl] = -(logp_all.exp() * logp_all).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulate the weight gradient in fp32: many bf16 partial sums would lose mass.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if grad_ent is None:
            grad_ent = torch.zeros_like(lse)
        n = hidden.shape[0]
        for start in range(0, n, chunk_size):
            sl = slice(start, min(start + chunk_size, n))
            z = _chunk_logits(hidden[sl], weight, temperature)
            logp_all = z - lse[sl].unsqueeze(-1)
            p = logp_all.exp()
            ent = -(p * logp_all).sum(dim=-1, keepdim=True)
            # d logp_t/dz = onehot(target) − p ;  d H/dz = −p (log p + H)
            g = -p * (grad_logp[sl].unsqueeze(-1) + grad_ent[sl].unsqueeze(-1) * (logp_all + ent))
            g.scatter_add_(-1, targets[sl].unsqueeze(-1), grad_logp[sl].unsqueeze(-1))
            g = g / temperature
            if need_h:
                grad_h[sl] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(g.t(), hidden[sl].float())
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``targets`` and entropy, ``chunk_size`` tokens at a time.

    ``hidden`` is ``[T, H]`` (or ``[..., H]``, flattened and restored), ``weight`` the lm-head
    ``[V, H]`` (tied or not), ``targets`` integer ids shaped like ``hidden[..., 0]``. Returns fp32
    ``(logprobs, entropy)``. Gradients flow to ``hidden`` and ``weight``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden {tuple(lead)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    logp, ent = _ChunkedLogprobEntropy.apply(h, weight, t, float(temperature), int(chunk_size))
    return logp.reshape(lead), ent.reshape(lead)
