"""The accelerator check: the trainer's kernel seams on one GPU, against the float32 reference and the plan's models.

Run on one CUDA GPU (trainer-only: torch, transformers and triton; fla-core for the hybrid's fused kernels):
    python benchmarks/accelerator_check.py
Run here on cpu, small shapes, in seconds (what CI runs):
    python benchmarks/accelerator_check.py --dry

Two tables:

1. **Numerics.** The tiny dense, MoE and hybrid models (`runtime/tasks/tiny_*_model.py` configs, seeded random
   weights): a packed row of mixed-length sequences in bfloat16 through the platform's kernels as the trainer
   installs them (`attention_kernel_for`, `install_packed_linear_attention`, `install_expert_kernel`), against each
   sequence run alone through transformers' own float32 forward. Reported: the worst per-token log-prob gap and the
   worst relative gradient error over the parameters, forward and backward, with the kernels that ran.
2. **A real-size layer stack.** A few decoder layers of Qwen3-8B's dimensions in bfloat16 (forward and backward of
   one packed micro-batch, no optimizer): peak device memory and step time against the plan's memory model
   (`compiler.memory.train_memory`: weights, gradients, activations) and time model (`compiler.cost.train`:
   `train_flops` at the target's `train_mfu`) for the `h100` target (`cpu` with --dry).

Figures are recorded in README ("The accelerator check") once it has run on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

#: Mixed lengths: under, at and over one 64-token delta-rule chunk; two share a length.
LENGTHS = (5, 70, 33, 130, 17, 17)
#: bfloat16 against float32: a token's log-prob moves by a few hundredths through 4 layers (bf16's 8 mantissa bits).
MAX_LOGPROB_GAP = 0.1
MAX_GRAD_ERROR = 0.1


def _tiny_model(kind: str):  # type: ignore[no-untyped-def]
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from rlc.runtime.tasks.tiny_hybrid_model import tiny_hybrid_config
    from rlc.runtime.tasks.tiny_model import tiny_config
    from rlc.runtime.tasks.tiny_moe_model import tiny_moe_config

    torch.manual_seed(0)
    build = {
        "dense": lambda: Qwen3ForCausalLM(tiny_config()),
        "moe": lambda: Qwen3MoeForCausalLM(tiny_moe_config()),
        "hybrid": lambda: Qwen3_5ForCausalLM(tiny_hybrid_config()),
    }[kind]
    return build().float()


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model: torch.nn.Module, seqs: Sequence[list[int]], device: torch.device):  # type: ignore[no-untyped-def]
    """Each sequence alone through transformers' float32 forward (sdpa, its own experts and Gated-DeltaNet)."""
    model.config._attn_implementation = "sdpa"
    if hasattr(model, "set_experts_implementation") and model.config.model_type.endswith("moe"):
        model.set_experts_implementation("eager")
    out = []
    for s in seqs:
        ids = torch.tensor(s, device=device)
        out.append(_logprobs(model(input_ids=ids[None], use_cache=False).logits[0], ids))
    torch.stack([x.sum() for x in out]).sum().backward()
    return [x.detach().cpu() for x in out], _grads(model)


def _packed(model: torch.nn.Module, seqs: Sequence[list[int]], platform: str, device: torch.device):  # type: ignore[no-untyped-def]
    """The sequences as one packed row through `platform`'s kernels, as the trainer installs them."""
    from rlc.runtime.packing import pack_sequences
    from rlc.runtime.platform import get_platform
    from rlc.runtime.train.expert_parallel import install_expert_kernel
    from rlc.runtime.train.linear_attention import install_packed_linear_attention
    from rlc.runtime.train.packed_forward import packed_attention_inputs
    from rlc.runtime.train.varlen_attention import attention_kernel_for

    implementation, attention = attention_kernel_for(platform)
    model.config._attn_implementation = implementation
    linear = install_packed_linear_attention(model, platform)
    experts = install_expert_kernel(model, platform)
    row = pack_sequences(list(seqs))
    kwargs = packed_attention_inputs(row, get_platform(platform), device, "varlen")
    ids = row.input_ids.to(device)
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
    out, start = [], 0
    for s in seqs:
        out.append(_logprobs(logits[start : start + len(s)], ids[0, start : start + len(s)]))
        start += len(s)
    torch.stack([x.sum() for x in out]).sum().backward()
    kernels = {"attention": attention}
    if linear is not None:
        kernels["gated_deltanet"] = linear.name
    if experts is not None:
        kernels["experts"] = experts.name
    return [x.detach().cpu() for x in out], _grads(model), kernels


def numerics_row(kind: str, platform: str, device: torch.device) -> dict:
    """One tiny model: bf16 packed row on the platform's kernels against the per-sequence float32 reference."""
    import copy

    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 32, (n,), generator=g).tolist() for n in LENGTHS]
    base = _tiny_model(kind)
    ref_lp, ref_grads = _reference(copy.deepcopy(base).to(device), seqs, device)
    lp, grads, kernels = _packed(base.to(device=device, dtype=torch.bfloat16), seqs, platform, device)
    gap = max(float((a - b).abs().max()) for a, b in zip(lp, ref_lp, strict=True))
    # The whole gradient's relative error: one expert's share can move wholesale when bf16 flips a router's top-k.
    diff = torch.stack([(grads[n] - r).square().sum() for n, r in ref_grads.items()]).sum().sqrt()
    error = float(diff / torch.stack([r.square().sum() for r in ref_grads.values()]).sum().sqrt())
    return {
        "model": kind,
        "logprob_gap": gap,
        "grad_error": error,
        "ok": gap <= MAX_LOGPROB_GAP and error <= MAX_GRAD_ERROR and grads.keys() == ref_grads.keys(),
        "kernels": kernels,
    }


# --------------------------------------------------------------------------------------------- layer stack


@dataclasses.dataclass(frozen=True)
class StackShape:
    layers: int
    tokens: int
    sequence: int
    shrink: int  # divide Qwen3-8B's widths by this (1 on a GPU; --dry shrinks)


def _stack_arch(shape: StackShape):  # type: ignore[no-untyped-def]
    from rlc.schemas.registry import load_arch

    arch = load_arch("qwen3-8b")
    s = shape.shrink
    return arch.model_copy(
        update={
            "num_layers": shape.layers,
            "hidden_size": arch.hidden_size // s,
            "num_attention_heads": arch.num_attention_heads // s,
            "num_kv_heads": max(1, arch.num_kv_heads // s),
            "intermediate_size": arch.intermediate_size // s,
        }
    )


def predicted(shape: StackShape, target_name: str) -> tuple[float, float]:
    """(GiB, seconds) the plan's models give the stack's forward and backward: weights + gradients + activations
    (`train_memory`, one rank, bf16, no recompute) and `train_flops` at the target's training MFU."""
    from rlc.compiler.cost.train import train_flops, train_mfu
    from rlc.compiler.cost.workload import Workload
    from rlc.compiler.memory import model_sizes, train_memory
    from rlc.schemas.layout import Precision, TrainLayout
    from rlc.schemas.registry import load_target

    arch = _stack_arch(shape)
    target = load_target(target_name)
    layer_params = sum(arch.layer_param_count(i) for i in range(arch.num_layers))
    sizes = dataclasses.replace(model_sizes(arch), active=layer_params)  # the stack has no embedding or head
    bf16 = Precision(param_dtype="bfloat16", reduce_dtype="bfloat16")
    layout = TrainLayout(world_size=1, micro_batch_tokens=shape.tokens, precision=bf16)
    memory = train_memory(sizes, layout, target, logprob_chunk_tokens=1)
    stack_gib = 2 * layer_params * 2 / 2**30 + memory.items["activations"]  # bf16 weights and gradients
    seqs = shape.tokens // shape.sequence
    work = Workload(
        samples=seqs,
        prompt_tokens=0,
        response_tokens=shape.sequence,
        max_prompt=0,
        max_response=shape.sequence,
        staleness=0,
        decoupled=False,
        reference=False,
        lora=False,
    )
    seconds = train_flops(sizes, work, "none") / (target.bf16_tflops * 1e12 * train_mfu(sizes, target))
    return stack_gib, seconds


def measured(shape: StackShape, platform: str, device: torch.device, repeats: int) -> tuple[float, float]:
    """(peak GiB above the empty device, median seconds) of the stack's packed forward and backward in bf16."""
    from transformers import Qwen3Config, Qwen3Model

    from rlc.runtime.train.varlen_attention import attention_kernel_for

    arch = _stack_arch(shape)
    config = Qwen3Config(
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size,
        vocab_size=8,
        max_position_embeddings=shape.sequence,
    )
    config._attn_implementation = attention_kernel_for(platform)[0]
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model = Qwen3Model(config).to(device=device, dtype=torch.bfloat16)
    seqs = shape.tokens // shape.sequence
    cu = torch.arange(0, seqs + 1, device=device, dtype=torch.int32) * shape.sequence
    kwargs = {
        "position_ids": torch.arange(shape.sequence, device=device).repeat(seqs)[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": shape.sequence,
        "max_length_k": shape.sequence,
    }
    x = torch.randn(1, seqs * shape.sequence, arch.hidden_size, device=device, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=False)
        sync()
        t0 = time.perf_counter()
        out = model(inputs_embeds=x, use_cache=False, **kwargs).last_hidden_state
        out.float().square().mean().backward()
        sync()
        times.append(time.perf_counter() - t0)
        del out
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else float("nan")
    return peak, sorted(times[1:])[len(times[1:]) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="cpu, small shapes: check the script runs (CI)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the real-size stack")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the stack's packed micro-batch")
    args = parser.parse_args(argv)
    if args.dry:
        platform, device, target = "cpu", torch.device("cpu"), "cpu"
        shape, repeats = StackShape(layers=2, tokens=256, sequence=64, shrink=32), 1
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("accelerator_check: no CUDA device here; run with --dry for the cpu check")
        platform, device, target = "cuda", torch.device("cuda"), "h100"
        shape, repeats = StackShape(layers=args.layers, tokens=args.tokens, sequence=4096, shrink=1), 5
    print(f"accelerator check on {platform} ({torch.cuda.get_device_name() if platform == 'cuda' else 'cpu'})")
    print(f"{'model':<8} {'logprob gap':>12} {'grad error':>11}  ok   kernels")
    failed = 0
    for kind in ("dense", "moe", "hybrid"):
        try:
            row = numerics_row(kind, platform, device)
        except RuntimeError as exc:  # a kernel package missing on this image: say which, check the others
            print(f"{kind:<8} {'-':>12} {'-':>11}  --   {exc}")
            failed += 1
            continue
        failed += not row["ok"]
        kernels = "; ".join(f"{k}: {v}" for k, v in row["kernels"].items())
        verdict = "yes" if row["ok"] else "NO"
        print(f"{kind:<8} {row['logprob_gap']:>12.2e} {row['grad_error']:>11.2e}  {verdict:<4} {kernels}")
    gib, seconds = predicted(shape, target)
    peak, took = measured(shape, platform, device, repeats)
    print(
        f"layer stack: {shape.layers} Qwen3-8B layers (widths / {shape.shrink}), {shape.tokens} tokens in sequences "
        f"of {shape.sequence}, bf16, forward + backward, against the {target} plan models"
    )
    print(f"{'':<14} {'measured':>10} {'model':>10} {'ratio':>7}")
    print(f"{'peak GiB':<14} {peak:>10.3f} {gib:>10.3f} {peak / gib:>7.2f}")
    print(f"{'step s':<14} {took:>10.4f} {seconds:>10.4f} {took / seconds:>7.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
