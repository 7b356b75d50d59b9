"""rlc's vLLM plugin: vLLM's Qwen3.5 model module imports where torchvision is absent, and torchvision stays absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="needs the cpu extra (vllm)"
)

PROBE = textwrap.dedent(
    """
    import importlib, importlib.util, sys
    assert importlib.util.find_spec("torchvision") is None, "this test needs an environment without torchvision"
    from rlc.runtime.rollout.vllm_plugin import register
    if sys.argv[1] == "with":
        register()
        register()  # vLLM may call it more than once in a process
    try:
        importlib.import_module("vllm.model_executor.models.qwen3_5")
    except ImportError as exc:
        print("import failed:", exc)
        sys.exit(3)
    from transformers.utils.import_utils import is_torchvision_available
    assert "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None
    assert not is_torchvision_available()
    from transformers.models.qwen2_vl import image_processing_qwen2_vl as images
    try:
        images.tvF.resize
    except ImportError as exc:
        print("use refused:", exc)
    """
)


def _probe(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300)


def test_without_the_plugin_vllms_qwen3_5_needs_torchvision() -> None:
    """The failure the plugin exists for (if vLLM stops importing torchvision, the plugin can go)."""
    result = _probe("without")
    assert result.returncode == 3 and "torchvision" in result.stdout, result.stdout + result.stderr


def test_with_the_plugin_it_imports_and_torchvision_stays_absent() -> None:
    result = _probe("with")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "use refused: torchvision.resize: torchvision is not installed" in result.stdout


def test_vllm_finds_the_plugin_through_its_entry_point() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("rlc_text_only_processors") == "rlc.runtime.rollout.vllm_plugin:register"
