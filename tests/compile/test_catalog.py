"""Model catalog data files: shapes match published sizes, cache formulas match hand calculations."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlc.schemas.arch import AttentionArch, ModelArch, MoeArch
from rlc.schemas.registry import UnknownNameError, load_arch, model_ids, resolve_model_id
from rlc.schemas.target import numeric_field_names

EXPECTED = {
    "qwen2-7b",
    "qwen2-72b",
    *(f"qwen2.5-{s}" for s in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")),
    *(f"qwen3-{s}" for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b", "30b-a3b", "235b-a22b")),
    "qwen3.5-27b",
    "qwen3.6-27b",
    "deepseek-v3",
    "llama3.1-8b",
    "llama3.1-70b",
    "rlc-tiny",
}


def test_all_expected_models_ship() -> None:
    assert set(model_ids()) >= EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_model_loads_with_sources(name: str) -> None:
    arch = load_arch(name)
    assert arch.id == name
    for field in numeric_field_names(ModelArch, nested=False):
        assert arch.sources.get(field, "").strip(), f"{name}: no source for {field}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_param_counts_match_published(name: str) -> None:
    arch = load_arch(name)
    assert arch.total_params() / 1e9 == pytest.approx(arch.params_b, rel=0.05)
    assert arch.active_params() / 1e9 == pytest.approx(arch.active_params_b, rel=0.05)


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        ("qwen3-0.6b", 0.60, 0.60),
        ("qwen3-8b", 8.19, 8.19),
        ("qwen3-32b", 32.76, 32.76),
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("qwen3-235b-a22b", 235.1, 22.2),
        ("qwen2.5-7b", 7.62, 7.62),
        ("qwen2.5-72b", 72.7, 72.7),
        ("qwen3.6-27b", 26.9, 26.9),
        ("deepseek-v3", 671.0, 37.5),
    ],
)
def test_param_counts_against_hand_calculation(name: str, total_b: float, active_b: float) -> None:
    arch = load_arch(name)
    assert arch.total_params() / 1e9 == pytest.approx(total_b, rel=0.01)
    assert arch.active_params() / 1e9 == pytest.approx(active_b, rel=0.02)


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("qwen3-8b", 36 * 2 * 8 * 128 * 2),  # 147,456
        ("qwen3-0.6b", 114_688),
        ("qwen3-14b", 163_840),
        ("qwen3-30b-a3b", 98_304),
        ("qwen3-235b-a22b", 192_512),
        ("qwen3.6-27b", 16 * 2 * 4 * 256 * 2),  # only the 16 full-attention layers
        ("deepseek-v3", 61 * (512 + 64) * 2),  # 70,272: MLA latent + rope key
        ("rlc-tiny", 2 * 2 * 2 * 32 * 2),
    ],
)
def test_kv_bytes_per_token(name: str, kv_bytes: int) -> None:
    assert load_arch(name).kv_bytes_per_token() == kv_bytes


def test_kv_bytes_scale_with_dtype_and_mtp() -> None:
    arch = load_arch("qwen3-8b")
    assert arch.kv_bytes_per_token(dtype_bytes=1) * 2 == arch.kv_bytes_per_token()
    ds = load_arch("deepseek-v3")
    assert ds.kv_bytes_per_token(include_mtp=True) == 62 * 576 * 2


def test_hybrid_linear_state() -> None:
    arch = load_arch("qwen3.6-27b")
    assert arch.num_full_attention_layers() == 16 and arch.num_linear_attention_layers() == 48
    assert [arch.layer_kind(i) for i in range(4)] == ["linear", "linear", "linear", "full"]
    per_layer = 48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2
    assert arch.linear_state_bytes_per_sequence() == 48 * per_layer
    assert arch.linear_state_bytes_per_sequence() / 2**20 == pytest.approx(147, abs=1)
    assert load_arch("qwen3-8b").linear_state_bytes_per_sequence() == 0


def test_mtp_and_moe_structure() -> None:
    ds = load_arch("deepseek-v3")
    assert ds.is_moe and ds.mtp_layers == 1
    assert ds.moe is not None and (ds.moe.num_experts, ds.moe.experts_per_token, ds.moe.first_dense_layers) == (
        256,
        8,
        3,
    )
    assert not ds.layer_is_moe(2) and ds.layer_is_moe(3)
    assert ds.mtp_params() / 1e9 == pytest.approx(11.6, rel=0.03)
    assert load_arch("qwen3.6-27b").mtp_layers == 1
    assert load_arch("qwen3-8b").mtp_layers == 0 and load_arch("qwen3-8b").mtp_params() == 0
    assert not load_arch("qwen3-8b").is_moe


def test_largest_tensor_is_the_embedding() -> None:
    arch = load_arch("qwen3-8b")
    assert arch.largest_param_numel() == 151_936 * 4096  # fp32: ~2.3 GiB, over verl's 2 GiB default bucket


def test_rope_scaling_context() -> None:
    assert load_arch("qwen3-8b").max_scaled_context() == 131_072
    assert load_arch("deepseek-v3").max_scaled_context() == 163_840
    assert load_arch("rlc-tiny").max_scaled_context() == 512


def test_tiny_model_matches_the_quickstart_contract() -> None:
    tiny = load_arch("rlc-tiny")
    assert tiny.hf_architecture == "Qwen3ForCausalLM"
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.num_kv_heads) == (2, 128, 4, 2)
    assert (tiny.head_dim, tiny.intermediate_size, tiny.vocab_size) == (32, 256, 32)
    assert tiny.tie_word_embeddings and tiny.max_position_embeddings == 512


def test_vocabularies_separate_families() -> None:
    assert load_arch("qwen3-8b").vocab_size == 151_936
    assert load_arch("qwen3.6-27b").vocab_size == 248_320
    assert load_arch("deepseek-v3").vocab_size == 129_280


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen3-8B-Instruct", "qwen3-8b"),
        ("Qwen/Qwen3-8B", "qwen3-8b"),
        ("qwen3_8b", "qwen3-8b"),
        ("QWEN3-8B-Base", "qwen3-8b"),
        ("Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("qwen25-32b", "qwen2.5-32b"),
        ("/models/Qwen2.5-0.5B-Instruct/", "qwen2.5-0.5b"),
        ("deepseek-r1", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-V3-Base", "deepseek-v3"),
        ("Qwen3.6-27B", "qwen3.6-27b"),
        ("qwen3-235b", "qwen3-235b-a22b"),
        ("rlc-tiny", "rlc-tiny"),
    ],
)
def test_name_resolution(name: str, expected: str) -> None:
    assert resolve_model_id(name) == expected
    assert load_arch(name).id == expected


def test_unknown_model_suggests_a_close_match() -> None:
    with pytest.raises(UnknownNameError) as info:
        load_arch("qwen3-8")
    err = info.value
    assert isinstance(err, LookupError) and not isinstance(err, KeyError)
    assert (err.name, err.kind) == ("qwen3-8", "model")
    assert "qwen3-8b" in err.suggestions
    assert "did you mean" in str(err)


def test_nothing_close_gives_no_suggestion() -> None:
    with pytest.raises(UnknownNameError) as info:
        load_arch("completely-unrelated-model-xyz")
    assert info.value.suggestions == []


def test_every_field_has_a_description() -> None:
    for model in (ModelArch, AttentionArch, MoeArch):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


def _raw(name: str) -> dict:
    return load_arch(name).model_dump()


def test_wrong_shape_fails_the_param_check() -> None:
    data = _raw("qwen3-8b")
    data["intermediate_size"] = 24576
    with pytest.raises(ValidationError, match="total parameters"):
        ModelArch.model_validate(data)


def test_missing_source_is_rejected() -> None:
    data = _raw("qwen3-8b")
    del data["sources"]["hidden_size"]
    with pytest.raises(ValidationError, match="hidden_size"):
        ModelArch.model_validate(data)


def test_attention_kind_needs_its_dims() -> None:
    with pytest.raises(ValidationError, match="kv_lora_rank"):
        AttentionArch(kind="mla")
    with pytest.raises(ValidationError, match="does not use"):
        AttentionArch(kind="full", kv_lora_rank=512)
    with pytest.raises(ValidationError, match="full_attention_interval"):
        AttentionArch(kind="linear-hybrid")


def test_unknown_keys_are_rejected() -> None:
    data = {**_raw("qwen3-8b"), "num_hidden_layers": 36}
    with pytest.raises(ValidationError, match="num_hidden_layers"):
        ModelArch.model_validate(data)


# --------------------------------------------------------------------------------------------- Qwen3.5/3.6 MoE

#: Hybrid (3 Gated-DeltaNet : 1 gated full attention) MoE models with one shared expert: id -> (layers, routed
#: experts, top-k, expert width, total B, active B, KV bytes/token), from the fields as the catalog files cite them.
QWEN35_MOE = {
    "qwen3.5-35b-a3b": (40, 256, 8, 512, 34.66, 3.455, 10 * 2 * 2 * 256 * 2),
    "qwen3.6-35b-a3b": (40, 256, 8, 512, 34.66, 3.455, 10 * 2 * 2 * 256 * 2),
    "qwen3.5-122b-a10b": (48, 256, 8, 1024, 122.11, 9.771, 12 * 2 * 2 * 256 * 2),
    "qwen3.5-397b-a17b": (60, 512, 10, 1024, 396.35, 17.35, 15 * 2 * 2 * 256 * 2),
}


def test_qwen35_moe_models_ship() -> None:
    assert set(model_ids()) >= set(QWEN35_MOE)


@pytest.mark.parametrize("name", sorted(QWEN35_MOE))
def test_qwen35_moe_loads_with_sources(name: str) -> None:
    arch = load_arch(name)
    assert arch.id == name
    for field in numeric_field_names(ModelArch, nested=False):
        assert arch.sources.get(field, "").strip(), f"{name}: no source for {field}"
    assert arch.sources.get("attention", "").strip() and arch.sources.get("moe", "").strip()
    assert arch.total_params() / 1e9 == pytest.approx(arch.params_b, rel=0.05)
    assert arch.active_params() / 1e9 == pytest.approx(arch.active_params_b, rel=0.05)


@pytest.mark.parametrize("name", sorted(QWEN35_MOE))
def test_qwen35_moe_shapes(name: str) -> None:
    layers, experts, top_k, width, total_b, active_b, kv_bytes = QWEN35_MOE[name]
    arch = load_arch(name)
    assert arch.family == "qwen3.5" and arch.hf_architecture == "Qwen3_5MoeForConditionalGeneration"
    assert arch.attention.kind == "linear-hybrid" and arch.attention.output_gate and arch.attention.qk_norm
    assert arch.num_layers == layers and arch.num_full_attention_layers() == layers // 4
    assert [arch.layer_kind(i) for i in range(4)] == ["linear", "linear", "linear", "full"]
    assert arch.moe is not None
    assert (arch.moe.num_experts, arch.moe.experts_per_token, arch.moe.expert_intermediate_size) == (
        experts,
        top_k,
        width,
    )
    assert arch.moe.num_shared_experts == 1 and arch.moe.shared_expert_intermediate_size == width
    assert all(arch.layer_is_moe(i) for i in range(layers))
    assert arch.vocab_size == 248_320 and not arch.tie_word_embeddings and arch.mtp_layers == 1
    assert arch.total_params() / 1e9 == pytest.approx(total_b, rel=0.01)
    assert arch.active_params() / 1e9 == pytest.approx(active_b, rel=0.01)
    assert arch.kv_bytes_per_token() == kv_bytes


def test_qwen35_35b_linear_state() -> None:
    arch = load_arch("qwen3.5-35b-a3b")
    per_layer = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2
    assert arch.linear_state_bytes_per_sequence() == 30 * per_layer


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen3.5-35B-A3B", "qwen3.5-35b-a3b"),
        ("Qwen3.6-35B-A3B", "qwen3.6-35b-a3b"),
        ("qwen3.5-122b", "qwen3.5-122b-a10b"),
        ("Qwen/Qwen3.5-397B-A17B", "qwen3.5-397b-a17b"),
    ],
)
def test_qwen35_moe_name_resolution(name: str, expected: str) -> None:
    assert resolve_model_id(name) == expected
