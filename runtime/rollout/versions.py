"""Per-token policy versions of a vLLM completion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["token_versions"]


def token_versions(spans: Sequence[Any] | None, count: int, default: int) -> list[int]:
    """Per-token policy versions from vLLM's `WeightVersionSpan`s (the labels are rlc's integers)."""
    out = [default] * count
    for span in spans or []:
        try:
            version = int(span.version)
        except (TypeError, ValueError):
            continue  # "default": set before rlc labelled the engine
        for i in range(max(0, span.start), min(count, span.end)):
            out[i] = version
    return out


def version_spans(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of equal versions as (version, start, end): [3, 3, 4] → [(3, 0, 2), (4, 2, 3)]."""
    spans: list[tuple[int, int, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1], i + 1)
        else:
            spans.append((v, i, i + 1))
    return spans
