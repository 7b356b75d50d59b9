"""Packed rows against their sequences run alone, for the model-kind numerics tests (hybrid, latent attention).

`alone` runs each sequence through transformers' own forward; `packed` runs them as one packed row with rlc's
packed-attention inputs. Both return per-sequence token log-probs and the summed loss's gradients.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["alone", "packed", "random_sequences", "worst", "worst_relative_grad"]


def random_sequences(lengths: Sequence[int]) -> list[list[int]]:
    """Seeded token ids of the given lengths (ids 3-31: the character tokenizer without its specials)."""
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 32, (n,), generator=g).tolist() for n in lengths]


def _token_logprobs(logits, ids):  # type: ignore[no-untyped-def]
    return logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def _grads(model) -> dict:  # type: ignore[no-untyped-def]
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def alone(model, seqs):  # type: ignore[no-untyped-def]
    """Each sequence on its own through transformers' forward: log-probs and the summed loss's gradients."""
    import torch

    model.zero_grad(set_to_none=True)
    model.config._attn_implementation = "sdpa"
    out = []
    for s in seqs:
        ids = torch.tensor(s)
        out.append(_token_logprobs(model(input_ids=ids[None]).logits[0], ids))
    torch.stack([x.sum() for x in out]).sum().backward()
    return [x.detach() for x in out], _grads(model)


def packed(model, seqs, mode: str, drop: Sequence[str] = ()):  # type: ignore[no-untyped-def]
    """The sequences as one packed row with rlc's packed-attention inputs (`mode`: varlen or mask, less the
    inputs named in `drop`); ``"none"`` passes none, so the row runs as one sequence."""
    import torch

    from rlc.runtime.packing import pack_sequences
    from rlc.runtime.platform import get_platform
    from rlc.runtime.train.packed_forward import VARLEN_SDPA, packed_attention_inputs

    model.zero_grad(set_to_none=True)
    model.config._attn_implementation = VARLEN_SDPA if mode == "varlen" else "sdpa"
    row = pack_sequences(seqs)
    kwargs = {}
    if mode != "none":
        kwargs = packed_attention_inputs(row, get_platform("cpu"), torch.device("cpu"), mode)  # type: ignore[arg-type]
        for name in drop:
            kwargs.pop(name, None)
    logits = model(input_ids=row.input_ids, **kwargs).logits[0]
    bounds = row.cu_seqlens.tolist()
    out = [_token_logprobs(logits[a:b], row.input_ids[0, a:b]) for a, b in itertools.pairwise(bounds)]
    torch.stack([x.sum() for x in out]).sum().backward()
    return [x.detach() for x in out], _grads(model)


def worst(a, b) -> float:  # type: ignore[no-untyped-def]
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def worst_relative_grad(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)
