"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

#: The folders tests live in, each also a marker (`pytest -m runtime`); see tests/README.md.
AREAS = ("compile", "plan", "golden", "runtime", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its area and with `ray` when it starts a Ray cluster; then order the files with slow
    tests first, each file kept whole (its module fixtures are set up once): with parallel workers the longest files
    start early instead of last."""
    for item in items:
        if item.path.parent.name in AREAS:
            item.add_marker(item.path.parent.name)
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker("ray")
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)


# ---------------------------------------------------------------------------------------------
# Runtime fixtures (tiny quickstart model). torch/transformers are imported lazily so the
# compile-path tests never pay for them.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart model (seed 0, default warm-up), built once per test session (~1 s)."""
    from rlc.runtime.tasks.model_builder import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5-architecture hybrid model (3 Gated-DeltaNet + 1 attention layer), once per session.

    Randomly initialised (no warm-up): the numerics tests compare layouts to 1e-5, and a warmed-up model's larger
    activations turn fp32 rounding of differently shaped matmuls into ~1e-5 by the last layer by themselves.
    """
    from rlc.runtime.tasks.model_builder import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-hybrid") / "model"
    return build_tiny_model(out, seed=0, warmup_steps=0, architecture="hybrid")


@pytest.fixture(scope="session")
def tiny_hybrid_mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rlc-tiny-hybrid-mtp as `rlc run` builds it (warmed up, MTP head distilled), once per session (~30 s)."""
    from rlc.runtime.tasks.model_builder import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-hybrid-mtp") / "model", seed=0, architecture="hybrid-mtp")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE (the quickstart's sizes, 8 experts, top-2), randomly initialised, once per session: its
    routers send the tokens of a short batch to every expert, which the expert-parallel tests need."""
    from rlc.runtime.tasks.model_builder import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-moe") / "model", seed=0, warmup_steps=0, architecture="moe")


@pytest.fixture(scope="session")
def tiny_shared_moe_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny MoE models with a shared expert, randomly initialised: Qwen2-MoE, and the Qwen3.5/3.6 MoE text model
    (Gated-DeltaNet hybrid), built on first use."""
    from rlc.runtime.tasks.tiny_moe_model import build_tiny_shared_moe_model

    root = tmp_path_factory.mktemp("tiny-shared-moe")
    return {
        "qwen2_moe": build_tiny_shared_moe_model(root / "qwen2_moe", hybrid=False),
        "qwen3_5_moe_text": build_tiny_shared_moe_model(root / "qwen3_5_moe_text", hybrid=True),
    }


@pytest.fixture(scope="session")
def tiny_mla_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V3 (latent attention, 8 grouped experts top-2, a shared expert), randomly initialised, once
    per session."""
    from rlc.runtime.tasks.model_builder import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-mla") / "model", seed=0, warmup_steps=0, architecture="mla")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):
    """The quickstart model loaded in float32, eval mode, with sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


# Module scope: the next test file may need a Ray of its own shape (e.g. `rlc run` in-process starts one
# with the plan's logical devices), so each module that uses this gets, and then releases, its own.
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for actor tests: two real cores, logical CPUs so one engine and two trainer ranks fit."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
