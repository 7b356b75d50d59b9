"""From a trajectory's recorded calls to training rows: token ids as the engine saw them, never re-tokenised text.

A call continues the trajectory when its prompt ids start with everything so far (the previous calls' prompts
and outputs); the ids in between (tool results, user turns, the template's glue) are environment tokens and
carry loss mask 0. Only the ids the policy sampled carry mask 1, with their behaviour log-probs and the policy
version of each. A call whose prompt branches from an earlier point of the trajectory is a retry: the calls
after that point were never continued and are dropped. A call that continues nothing starts a new segment (a
prefix break, counted): each segment is its own row. Pure Python, so it is tested without engines.

Routing (rollout routing replay): a call made on an engine that captures its routers' choices carries
`routed_experts`, one `[len(tokens) - 1, layers, top_k]` array of expert ids per input position of that call
(the dtype's max value where the engine did not capture the position, e.g. one served from its prefix cache).
A row gets one such array over its own positions, merged from its calls (`row_routing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Call", "Row", "Segments", "row_routing", "segment_calls", "trajectory_rows", "turn_rows"]


@dataclass(frozen=True)
class Call:
    """One model call as the engine ran it."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # behaviour log-prob of each output id
    versions: tuple[int, ...]  # policy version that sampled each output id
    finish_reason: str | None = None
    model_s: float = 0.0  # seconds the call spent in the engine
    # The engine's experts per input position ([len(tokens) - 1, layers, top_k]), or None where it captures none.
    routed_experts: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.output_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"a call has {len(self.output_ids)} output ids, {len(self.logprobs)} log-probs and "
                f"{len(self.versions)} versions"
            )

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt_ids + self.output_ids


@dataclass(frozen=True)
class Row:
    """One training row: ids, loss mask, behaviour log-probs and versions aligned position by position."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # 0.0 where the mask is 0
    versions: list[int]  # -1 where the mask is 0
    calls: int  # model calls in the row
    weight: float = 1.0  # multiplies the trajectory's advantage (export turns: turn_discount^k)
    # The engine's experts per position ([len(input_ids) - 1, layers, top_k]), or None where no call carries any.
    routed_experts: Any = field(default=None, compare=False, repr=False)

    @property
    def sampled(self) -> int:
        return sum(self.loss_mask)

    @property
    def masked(self) -> int:
        return len(self.loss_mask) - self.sampled


@dataclass
class Segments:
    """A trajectory's calls grouped into segments, with what grouping them found."""

    segments: list[list[Call]] = field(default_factory=list)
    prefix_breaks: int = 0
    retries_dropped: int = 0


def _starts_with(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(ids) >= len(prefix) and tuple(ids[: len(prefix)]) == tuple(prefix)


def segment_calls(calls: Sequence[Call]) -> Segments:
    """Group calls (in the order they were made) into segments; see the module docstring for the rules."""
    out = Segments()
    current: list[Call] = []
    for call in calls:
        if not current:
            current = [call]
            continue
        if _starts_with(call.prompt_ids, current[-1].tokens):
            current.append(call)
            continue
        # A retry: the prompt extends an earlier call of this segment, or re-sends the segment's first prompt.
        branch = next(
            (k for k in range(len(current) - 2, -1, -1) if _starts_with(call.prompt_ids, current[k].tokens)), None
        )
        if branch is not None:
            out.retries_dropped += len(current) - branch - 1
            current = [*current[: branch + 1], call]
        elif _starts_with(call.prompt_ids, current[0].prompt_ids):
            out.retries_dropped += len(current)
            current = [call]
        else:
            out.segments.append(current)
            out.prefix_breaks += 1
            current = [call]
    if current:
        out.segments.append(current)
    return out


def row_routing(calls: Sequence[Call], length: int) -> np.ndarray | None:
    """The routing of a row of `length` ids whose calls' tokens are each a prefix of it: position by position
    (entry by entry), from the first call of `calls` that captured it; None where no call carries routing.

    A call's array covers the row's positions 0..len(call.tokens)-2, since a continuing call's prompt starts with
    everything so far. The order of `calls` says whose routing computed a position's behaviour log-probs:
    `trajectory_rows` passes a segment's calls earliest first, because an earlier output token's log-prob was
    computed with the earlier call's routing, and, with prefix caching, a later call does not compute that
    position again at all (it is not captured there, and is taken from the call that did). A position no call
    captured stays the dtype's max value: the trainer routes it itself.
    """
    arrays = [(np.asarray(c.routed_experts), len(c.tokens)) for c in calls if c.routed_experts is not None]
    if not arrays or length < 2:
        return None
    shapes = {a.shape[1:] for a, _ in arrays}
    if len(shapes) != 1 or any(a.ndim != 3 for a, _ in arrays):
        shown = [a.shape for a, _ in arrays]
        raise ValueError(f"the calls of one row carry routing of different shapes: {shown}")
    dtype = np.dtype(np.uint16) if any(a.dtype.itemsize > 1 for a, _ in arrays) else np.dtype(np.uint8)
    missing = np.iinfo(dtype).max
    out = np.full((length - 1, *shapes.pop()), missing, dtype)
    for array, n_tokens in arrays:
        rows = min(len(array), n_tokens - 1, length - 1)
        src = array[:rows]
        absent = src == np.iinfo(src.dtype).max
        take = (out[:rows] == missing) & ~absent
        out[:rows][take] = src[take]
    return out


def _segment_row(segment: Sequence[Call]) -> Row:
    first = segment[0]
    ids = list(first.prompt_ids)
    mask = [0] * len(ids)
    lps = [0.0] * len(ids)
    versions = [-1] * len(ids)
    for call in segment:
        glue = list(call.prompt_ids[len(ids) :])
        ids += glue
        mask += [0] * len(glue)
        lps += [0.0] * len(glue)
        versions += [-1] * len(glue)
        ids += call.output_ids
        mask += [1] * len(call.output_ids)
        lps += call.logprobs
        versions += call.versions
    return Row(ids, mask, lps, versions, len(segment), routed_experts=row_routing(segment, len(ids)))


def trajectory_rows(found: Segments) -> list[Row]:
    """export trajectory: one row per segment, environment tokens masked."""
    return [_segment_row(s) for s in found.segments if any(c.output_ids for c in s)]


def turn_rows(found: Segments, turn_discount: float = 1.0) -> list[Row]:
    """export turns: one row per call (its prompt masked); a call k calls before its segment's end is weighted
    turn_discount^k. A call's row takes its routing from the call itself first, then from the calls before it,
    latest first: only that call's output ids train there, and their log-probs were computed with its own routing
    and, for the positions it served from the prefix cache, with that of the last earlier call that computed them."""
    rows = []
    for segment in found.segments:
        for index, call in enumerate(segment):
            if not call.output_ids:
                continue
            n_prompt, n_out = len(call.prompt_ids), len(call.output_ids)
            rows.append(
                Row(
                    list(call.tokens),
                    [0] * n_prompt + [1] * n_out,
                    [0.0] * n_prompt + list(call.logprobs),
                    [-1] * n_prompt + list(call.versions),
                    1,
                    turn_discount ** (len(segment) - 1 - index),
                    row_routing(segment[index::-1], n_prompt + n_out),
                )
            )
    return rows
