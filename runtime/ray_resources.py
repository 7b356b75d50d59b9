"""Ray actor options from a plan's resource shares.

A plan names its device resource as the target's Ray resource: `NPU` on Ascend, `GPU` on H100/H20 targets. Ray
counts GPUs and CPUs as built-in resources, which actor options (and `ray.init`) take as `num_gpus` / `num_cpus`
and refuse inside `resources`; every other name (`NPU`, the plan's node resources) stays there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["BUILT_IN", "ray_options"]

#: Ray's built-in resources and the keyword each is given by.
BUILT_IN = {"GPU": "num_gpus", "CPU": "num_cpus"}


def ray_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` (Ray's actor or `ray.init` keywords) with any built-in resource in `resources` moved to its own
    keyword (a share of a GPU stays fractional); an explicit keyword for the same resource is replaced."""
    out = dict(options)
    resources = dict(out.pop("resources", None) or {})
    for name, keyword in BUILT_IN.items():
        if name in resources:
            out[keyword] = resources.pop(name)
    if resources:
        out["resources"] = resources
    return out
