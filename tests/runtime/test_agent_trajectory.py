"""Recording rules of agent trajectories: continuation by token prefix, masks, retries, prefix breaks, export."""

from __future__ import annotations

import pytest

from rlc.runtime.agent.trajectory import Call, segment_calls, trajectory_rows, turn_rows


def call(prompt: list[int], out: list[int], version: int = 0, lp: float = -0.5) -> Call:
    return Call(tuple(prompt), tuple(out), tuple([lp] * len(out)), tuple([version] * len(out)))


def test_a_continued_conversation_is_one_row_with_environment_tokens_masked() -> None:
    # <bos>47+38= | [47+38]<eos> | (85) | 85<eos>
    first = call([1, 4, 7, 5], [20, 4, 7, 21, 2], version=3)
    second = call([1, 4, 7, 5, 20, 4, 7, 21, 2, 30, 8, 5, 31], [8, 5, 2], version=4, lp=-0.1)
    found = segment_calls([first, second])
    assert found.prefix_breaks == 0 and found.retries_dropped == 0
    (row,) = trajectory_rows(found)
    assert row.input_ids == [1, 4, 7, 5, 20, 4, 7, 21, 2, 30, 8, 5, 31, 8, 5, 2]
    assert row.loss_mask == [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    # The tool's reply (30, 8, 5, 31) never trains, and carries no log-prob or version.
    assert row.logprobs[9:13] == [0.0] * 4 and row.versions[9:13] == [-1] * 4
    assert row.versions[4:9] == [3] * 5 and row.versions[13:] == [4] * 3
    assert row.logprobs[13:] == [-0.1] * 3
    assert (row.sampled, row.masked, row.calls) == (8, 8, 2)


def test_a_call_that_does_not_extend_the_trajectory_starts_a_new_segment() -> None:
    first = call([1, 4], [5, 2])
    other = call([1, 9, 9], [6, 2])  # e.g. the agent re-tokenised text or summarised its history
    found = segment_calls([first, other])
    assert found.prefix_breaks == 1
    rows = trajectory_rows(found)
    assert [r.input_ids for r in rows] == [[1, 4, 5, 2], [1, 9, 9, 6, 2]]
    assert [r.loss_mask for r in rows] == [[0, 0, 1, 1], [0, 0, 0, 1, 1]]


def test_a_retried_call_drops_the_attempt_that_was_never_continued() -> None:
    first = call([1, 4], [5, 2])
    attempt = call([1, 4, 5, 2, 7], [8, 8])  # its result was thrown away by the agent
    retry = call([1, 4, 5, 2, 7], [9, 2])  # the same prompt again
    after = call([1, 4, 5, 2, 7, 9, 2, 6], [3, 2])
    found = segment_calls([first, attempt, retry, after])
    assert found.retries_dropped == 1 and found.prefix_breaks == 0
    (row,) = trajectory_rows(found)
    assert row.input_ids == [1, 4, 5, 2, 7, 9, 2, 6, 3, 2]
    assert 8 not in row.input_ids


def test_a_retry_of_the_first_call_replaces_it() -> None:
    found = segment_calls([call([1, 4], [5, 5]), call([1, 4], [6, 2])])
    assert found.retries_dropped == 1 and found.prefix_breaks == 0
    assert trajectory_rows(found)[0].input_ids == [1, 4, 6, 2]


def test_export_turns_is_one_row_per_call_with_discounted_weights() -> None:
    first = call([1, 4], [5, 2])
    second = call([1, 4, 5, 2, 7], [8, 2])
    rows = turn_rows(segment_calls([first, second]), turn_discount=0.5)
    assert [r.input_ids for r in rows] == [[1, 4, 5, 2], [1, 4, 5, 2, 7, 8, 2]]
    assert [r.loss_mask for r in rows] == [[0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
    assert [r.weight for r in rows] == [0.5, 1.0]


def test_no_calls_no_rows_and_empty_outputs_are_skipped() -> None:
    assert trajectory_rows(segment_calls([])) == []
    assert turn_rows(segment_calls([call([1, 2], [])])) == []


def test_a_call_whose_lengths_disagree_is_refused() -> None:
    with pytest.raises(ValueError, match="output ids"):
        Call((1,), (2, 3), (-0.1,), (0, 0))
