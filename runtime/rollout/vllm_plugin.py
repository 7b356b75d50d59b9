"""rlc's vLLM plugin: lets vLLM's Qwen3.5/3.6 model load where torchvision is absent (the cpu extra).

vLLM's ``qwen3_5`` module imports its Qwen3-VL siblings, and those import two transformers processor modules
(``qwen2_vl``'s image and video processors) that import torchvision at module level. The cpu extra cannot have
torchvision: PyPI's wheels are built against the CUDA torch and break every transformers model import beside the CPU
torch (DESIGN.md). A text-only policy never runs those processors, so this plugin imports the two modules with a
placeholder torchvision that raises on first use, then removes the placeholder: the rest of the process still sees
torchvision as absent (transformers' own availability check is evaluated first, so it stays false).

vLLM calls ``register`` in every process it starts (its ``vllm.general_plugins`` entry point), including the
subprocess that inspects a model class, which no code of rlc's runs in. Where torchvision imports, it does nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["TORCHVISION_IMPORTERS", "register"]

#: The transformers modules on vLLM's Qwen3.5 import path that import torchvision unconditionally.
TORCHVISION_IMPORTERS = (
    "transformers.models.qwen2_vl.image_processing_qwen2_vl",
    "transformers.models.qwen2_vl.video_processing_qwen2_vl",
)
_PLACEHOLDER_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


class _AbsentTorchvision(types.ModuleType):
    """Stands in for torchvision while the processor modules import; any use says what is missing."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"torchvision.{name}: torchvision is not installed, so images and videos cannot be processed "
            "(rlc's engines serve text)"
        )


def _torchvision_installed() -> bool:
    try:
        return importlib.util.find_spec("torchvision") is not None
    except ValueError:  # a module without a spec is in sys.modules: someone placed one; leave it be
        return True


def register() -> None:
    """Import the torchvision-only processor modules against a placeholder, where torchvision is absent."""
    if _torchvision_installed() or all(name in sys.modules for name in TORCHVISION_IMPORTERS):
        return
    try:
        from transformers.utils import import_utils
    except ImportError:  # no transformers, no Qwen3.5 model: nothing to prepare
        return
    import_utils.is_torchvision_available()  # cached as false before the placeholder exists
    placeholders = {name: _AbsentTorchvision(name) for name in _PLACEHOLDER_MODULES}
    for name, module in placeholders.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(placeholders[parent], child, module)
    sys.modules.update(placeholders)
    try:
        for name in TORCHVISION_IMPORTERS:
            try:
                importlib.import_module(name)
            except ImportError:  # another transformers release: vLLM reports its own import error later
                sys.modules.pop(name, None)
    finally:
        for name in _PLACEHOLDER_MODULES:
            sys.modules.pop(name, None)
