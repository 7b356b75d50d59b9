"""The names the trainer's weights take outside it: the base checkpoint's own.

transformers loads the text model of a multimodal checkpoint (Qwen3.5/3.6 are ``Qwen3_5ForConditionalGeneration``,
whose text weights are ``model.language_model.*``) into a causal LM whose modules are ``model.*``, and drops what
the text model does not hold (the vision tower, the MTP head). The engines were started from the base folder and
expect its names; an export must be a drop-in replacement for the base folder, so an engine restarted from it
still has its vision tower and still speculates with the MTP head. So every name that leaves the trainer (a
broadcast, a sync folder, a checkpoint) is turned into the base's, every name coming back (a resumed
checkpoint) into the module's, and exports carry the base's tensors the trainer never held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..preflight import safetensors_keys

__all__ = ["MODULE_PREFIX", "CheckpointNames"]

#: Where a causal LM's decoder lives in its module names.
MODULE_PREFIX = "model."
#: Where a multimodal checkpoint keeps the same decoder.
LANGUAGE_MODEL_PREFIX = "model.language_model."


@dataclass(frozen=True)
class CheckpointNames:
    """The base checkpoint's prefix for the decoder and the keys it holds that the trainer does not."""

    prefix: str
    extra: tuple[str, ...]

    @classmethod
    def of(cls, base: Path, module_names: Iterable[str]) -> CheckpointNames:
        keys = safetensors_keys(base)
        prefix = LANGUAGE_MODEL_PREFIX if any(k.startswith(LANGUAGE_MODEL_PREFIX) for k in keys) else MODULE_PREFIX
        names = cls(prefix, ())
        held = {names.outward(n) for n in module_names}
        return cls(prefix, tuple(sorted(k for k in keys if k not in held)))

    def outward(self, name: str) -> str:
        """A module name as the base checkpoint spells it."""
        if self.prefix != MODULE_PREFIX and name.startswith(MODULE_PREFIX):
            return self.prefix + name[len(MODULE_PREFIX) :]
        return name

    def inward(self, name: str) -> str:
        """A base-checkpoint name as the trainer's module spells it."""
        if self.prefix != MODULE_PREFIX and name.startswith(self.prefix):
            return MODULE_PREFIX + name[len(self.prefix) :]
        return name

    def outward_dict(self, state: Mapping[str, object]) -> dict[str, object]:
        return {self.outward(k): v for k, v in state.items()}

    def inward_dict(self, state: Mapping[str, object]) -> dict[str, object]:
        """Module-named entries of a checkpoint (the base's extra tensors, which the module lacks, dropped)."""
        extra = set(self.extra)
        return {self.inward(k): v for k, v in state.items() if k not in extra}
