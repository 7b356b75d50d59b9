"""Memory model: formulas against hand-computed figures and published anchors."""

from __future__ import annotations

from rlc.compiler import memory
from rlc.compiler.memory import GIB, RolloutLayout
from rlc.schemas.layout import BF16, TrainLayout
from rlc.schemas.registry import load_arch, load_target

A2 = load_target("a2")
QWEN3_8B = memory.model_sizes(load_arch("qwen3-8b"))


def L(world_size: int, backend: str = "fsdp2", **kw) -> TrainLayout:
    """An accelerator layout (bf16 compute, fp32 params and reduction) unless the test says otherwise."""
    return TrainLayout(world_size=world_size, backend=backend, **{"precision": BF16, **kw})


def test_activation_per_token_matches_reference_anchor() -> None:
    """Research notes §7.2: Qwen3-8B keeps ≈ 124 KiB per token per layer, ≈ 4.4 GiB per 1K tokens."""
    per_token_layer = QWEN3_8B.act["none"] * 2
    assert abs(per_token_layer / 1024 - 124) < 2
    assert abs(per_token_layer * 36 * 1024 / GIB - 4.36) < 0.05
    assert QWEN3_8B.act["full"] < QWEN3_8B.act["selective"] < QWEN3_8B.act["none"]


def test_zero_accounting_fsdp2() -> None:
    """FSDP2 as the trainer runs it: fp32 sharded params (4), fp32 grads (4), AdamW moments (8), over all devices;
    the same 16 bytes per parameter as mixed-precision ZeRO-3's 2 + 2 + 12."""
    m = memory.train_memory(QWEN3_8B, L(8, micro_batch_tokens=4096), A2, logprob_chunk_tokens=1024)
    psi = QWEN3_8B.total / 8
    assert abs(m.items["weights"] - 4 * psi / GIB) < 1e-6
    assert abs(m.items["grads"] - 4 * psi / GIB) < 1e-6
    assert abs(m.items["optimizer"] - 8 * psi / GIB) < 1e-6
    assert m.items["reserve"] == A2.reserve_gib
    # Two decoder layers and the root unit (embedding; Qwen3-8B's head is separate) gathered in bf16.
    gathered = 2 * QWEN3_8B.max_layer + QWEN3_8B.embedding + QWEN3_8B.head
    assert abs(m.items["gather"] - 2 * gathered / GIB) < 1e-6


def test_fsdp2_tensor_parallel_splits_heads_and_ffn_not_norms() -> None:
    kwargs = {"logprob_chunk_tokens": 1024}
    two = memory.train_memory(QWEN3_8B, L(8, tp=2, micro_batch_tokens=8192), A2, **kwargs)
    one = memory.train_memory(QWEN3_8B, L(8, micro_batch_tokens=8192), A2, **kwargs)
    arch, h = QWEN3_8B.arch, QWEN3_8B.arch.hidden_size
    kept = memory.replicated_activation_elements(arch, "none")
    layer = kept + (QWEN3_8B.act_hf - kept) / 2
    expected = (layer * arch.num_layers + 2 * h) * 8192 * 2  # bf16
    assert abs(two.items["activations"] - expected / GIB) < 1e-9
    assert two.items["logits"] == one.items["logits"]  # the LM head is not tensor-parallel on fsdp2
    # Embeddings are not tensor-parallel: TP 2 over the same 8 devices shards them over 4 ranks, not 8.
    emb = QWEN3_8B.embedding + QWEN3_8B.head
    assert abs((two.items["weights"] - one.items["weights"]) * GIB - 4 * (emb / 4 - emb / 8)) < 1e3


def test_fsdp2_tensor_parallel_keeps_latent_attention_down_projections_whole() -> None:
    """DeepSeek-V3 under TP: q_a_proj (7168 x 1536), kv_a_proj_with_mqa (7168 x (512 + 64)) and the two latent norms
    stay whole on each TP rank, in the weights, the gathered layer and the latents among the activations; a dense
    model keeps nothing of the kind."""
    ds = memory.model_sizes(load_arch("deepseek-v3"))
    per_layer = 7168 * 1536 + 1536 + 7168 * (512 + 64) + 512
    assert memory.tp_whole_params(ds.arch) == per_layer and ds.tp_whole == 61 * per_layer
    assert QWEN3_8B.tp_whole == 0
    layout = L(256, tp=4, ep=64)
    dense, _ = memory.train_param_shard(ds, layout)
    layers = ds.total - ds.embedding - ds.head
    naive = (layers / 4 + ds.embedding + ds.head) / layout.shard_group
    assert abs(dense - naive - 61 * per_layer * 3 / 4 / layout.shard_group) < 1e-3
    assert memory.train_param_shard(ds, L(256, ep=64))[0] == ds.total / 256
    experts = ds.expert / (61 - 3)  # the routed experts of one of the 58 MoE layers
    gathered = (ds.max_layer - experts - per_layer) / 4 + per_layer + experts / 64
    assert abs(memory.fsdp2_gathered_layer(ds, layout) - gathered) < 1e-3
    latents = 1536 + 512 + 64
    assert memory.replicated_activation_elements(ds.arch, "none") == 8 * 7168 + latents
    assert memory.replicated_activation_elements(ds.arch, "full") == 7168


def test_fsdp2_counts_what_hf_layers_keep() -> None:
    """Qwen3-8B: the RMSNorms' normalised values, QK-norm and rotary copies of q/k, the attention output's copy
    and SwiGLU's product come on top of the fused-kernel count: 6h + 5(n_q + n_kv)d + n_kv d + 2 n_q d + 4f
    elements per token per layer."""
    a = QWEN3_8B.arch
    d, q, kv = a.head_dim, a.num_attention_heads, a.num_kv_heads
    counted = 6 * a.hidden_size + 5 * (q + kv) * d + kv * d + 2 * q * d + 4 * a.intermediate_size
    assert QWEN3_8B.act_hf == counted


def test_optimizer_offload_streams_one_unit() -> None:
    kwargs = {"logprob_chunk_tokens": 1024}
    plain = memory.train_memory(QWEN3_8B, L(8), A2, **kwargs)
    off = memory.train_memory(QWEN3_8B, L(8, offload_optimizer=True), A2, **kwargs)
    # The largest unit is the root (embedding + head, 1.2B parameters of 8.2B).
    assert 0 < off.items["optimizer"] < plain.items["optimizer"] / 5
    assert abs(off.host_gib_per_node - plain.items["optimizer"] * 8) < 1e-6


def test_logits_are_chunked_not_full_vocab_per_token() -> None:
    small = memory.train_memory(QWEN3_8B, L(8, micro_batch_tokens=65536), A2, logprob_chunk_tokens=1024)
    assert abs(small.items["logits"] - 1024 * 151936 * 4 * 3 / GIB) < 1e-6
    big = memory.train_memory(QWEN3_8B, L(8, micro_batch_tokens=65536), A2, logprob_chunk_tokens=65536)
    assert big.items["logits"] > 100


def test_recompute_cp_and_offload_reduce_memory() -> None:
    base = L(8, micro_batch_tokens=32768)
    kwargs = {"logprob_chunk_tokens": 1024}
    none = memory.train_memory(QWEN3_8B, base, A2, **kwargs).items["activations"]
    full = memory.train_memory(QWEN3_8B, L(8, recompute="full", micro_batch_tokens=32768), A2, **kwargs)
    cp2 = memory.train_memory(QWEN3_8B, L(8, cp=2, micro_batch_tokens=32768), A2, **kwargs)
    assert full.items["activations"] < none / 5
    assert abs(cp2.items["activations"] - none / 2) < 1e-6
    off = memory.train_memory(QWEN3_8B, L(8, offload_params=True, offload_optimizer=True), A2, **kwargs)
    assert off.items["weights"] == off.items["grads"] == off.items["optimizer"] == 0.0
    assert off.host_gib_per_node > 0
    ring = memory.train_memory(QWEN3_8B, L(8, cp=2, cp_kind="ring", micro_batch_tokens=32768), A2, **kwargs)
    assert ring.items["activations"] == cp2.items["activations"]


def test_megatron_shards_by_tp_pp_and_distributed_optimizer() -> None:
    layout = L(16, "megatron", tp=4, pp=2, micro_batch_tokens=4096)
    dense, expert = memory.train_param_shard(QWEN3_8B, layout)
    assert expert == 0
    assert QWEN3_8B.total / 8 < dense < QWEN3_8B.total / 8 * 1.2
    m = memory.train_memory(QWEN3_8B, layout, A2, logprob_chunk_tokens=1024)
    assert abs(m.items["grads"] - 2 * m.items["weights"]) < 1e-6  # fp32 main grads
    assert abs(m.items["optimizer"] - 12 * dense / 2 / GIB) < 1e-6  # sharded over dp=2


def test_lora_only_adapters_carry_states() -> None:
    m = memory.train_memory(QWEN3_8B, L(4), A2, logprob_chunk_tokens=1024, lora_rank=64)
    assert m.items["grads"] == m.items["optimizer"] == 0.0
    adapters = memory.lora_params(QWEN3_8B.arch, 64, "all-linear")
    assert 0.1e9 < adapters < 0.25e9  # research notes §7.4: ≈ 0.17B for all-linear r=64
    assert m.items["lora"] < 1.0


def test_cpu_target_is_fp32() -> None:
    cpu = load_target("cpu")
    tiny = memory.model_sizes(load_arch("rlc-tiny"))
    m = memory.train_memory(tiny, TrainLayout(world_size=2), cpu, logprob_chunk_tokens=64)
    assert abs(m.items["weights"] - 4 * tiny.total / 2 / GIB) < 1e-9
    assert memory.dtype_bytes(cpu) == 4


def test_kv_heads_replicate_beyond_kv_count() -> None:
    arch = QWEN3_8B.arch  # 8 KV heads
    full = arch.kv_bytes_per_token(2)
    assert memory.kv_bytes_per_token_device(arch, 8, 2) == full / 8
    assert memory.kv_bytes_per_token_device(arch, 16, 2) == full / 8  # one head per rank at TP 16
    mla = load_arch("deepseek-v3")
    assert memory.kv_bytes_per_token_device(mla, 8, 2) == mla.kv_bytes_per_token(2) == 70272


def test_rollout_kv_fills_the_fraction() -> None:
    layout = RolloutLayout(8, tp=1, memory_fraction=0.9)
    m, seqs = memory.rollout_memory(QWEN3_8B, layout, A2, max_model_len=10240)
    owned = 0.9 * A2.usable_hbm_gib
    inside = {k: v for k, v in m.items.items() if k not in ("reserve", "graph", "prefill")}
    assert abs(sum(inside.values()) - owned) < 1e-6
    assert m.fits and seqs == int(m.items["kv_cache"] * GIB // (147456 * 10240))


def test_rollout_that_cannot_hold_weights_fails() -> None:
    big = memory.model_sizes(load_arch("qwen2.5-72b"))
    m, _ = memory.rollout_memory(big, RolloutLayout(8, tp=1, memory_fraction=0.9), A2, max_model_len=4096)
    assert not m.fits and "> 61.0 GiB" in m.verdict() and "exceed" in m.problems[0]


def test_teacher_prompt_logprobs_sit_outside_the_fraction() -> None:
    layout = RolloutLayout(8, tp=1, memory_fraction=0.9, max_num_batched_tokens=8192)
    m, _ = memory.rollout_memory(QWEN3_8B, layout, A2, max_model_len=4096, prompt_logprobs=True)
    assert not m.fits  # 0.9 x 61 + 9.3 GiB of fp32 log-softmax + reserve > 61 GiB
