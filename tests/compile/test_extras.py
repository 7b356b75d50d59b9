"""The install extras: an Ascend host's `rlc[npu]` may not resolve to a library older than the one the runtime is
built and tested against (`rlc[cpu]`), or the trainer would fail on import there and nowhere here."""

from __future__ import annotations

import re
import tomllib

from paths import REPO

_REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(==|>=)\s*(\d+)(?:\.\d+)*")


def _floors(extra: str) -> dict[str, tuple[str, int]]:
    """Each package of an extra: (operator, major version of its lowest allowed release)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = {}
    for requirement in extras[extra]:
        match = _REQUIREMENT.match(requirement)
        assert match, f"{extra}: {requirement!r} names no lower bound"
        found[match.group(1).lower()] = (match.group(2), int(match.group(3)))
    return found


def test_the_npu_extra_allows_no_older_major_release_than_the_runtime_runs_on() -> None:
    cpu, npu = _floors("cpu"), _floors("npu")
    shared = sorted(set(cpu) & set(npu))
    assert "transformers" in shared
    older = [
        f"{name}: npu allows {npu[name][1]}.x, cpu needs {cpu[name][1]}.x"
        for name in shared
        if npu[name][1] < cpu[name][1]
    ]
    assert older == []
