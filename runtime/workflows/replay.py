"""`rlc run PLAN --replay RUN`: run a plan again with the admission a recorded run's timing decided.

What a replay guarantees: every generate request the recorded run trained on is sent again with the same
prompts in the same order, and runs while the engines hold the policy version the recorded request was
generated with; every step trains on the recorded groups in the recorded order. Sampling is seeded per
prompt (`seeds.request_seed`), so with the same plan, software and hardware and deterministic kernels (the
cpu target; `plan.reproducibility.deterministic_kernels` elsewhere) the replay's samples, and so its
per-step metrics, equal the recorded run's exactly. Without deterministic kernels it reproduces the
schedule (versions, batches) while kernel noise may still move the numbers. It replays the recorded steps
only, and runs less overlapped than the original: a version's weights stay in the engines until every
request recorded under that version has been generated.
"""

from __future__ import annotations

from typing import Any

from rlc.runtime.errors import RunError
from rlc.runtime.prompts import PromptItem, PromptStream
from rlc.runtime.rollout_log import RecordedRequest, ReplaySchedule
from rlc.runtime.workflows import Loop
from rlc.runtime.workflows.generate import Chunk, GenerateWorkflow, Group

__all__ = ["ReplayWorkflow"]


class ReplayWorkflow(GenerateWorkflow):
    """Generate-and-score with admission and batches taken from a `ReplaySchedule` instead of timing."""

    def __init__(self, loop: Loop, schedule: ReplaySchedule) -> None:
        super().__init__(loop)
        self.schedule = schedule
        loop.total_steps = min(loop.total_steps, schedule.steps)
        self._items = _items_by_cursor(loop.prompts, schedule.max_cursor())
        self._wanted = {g for groups in schedule.batches[: loop.total_steps] for g in groups}
        needed = [r for r in schedule.needed() if any((r.id, c) in self._wanted for c in r.cursors)]
        self._recorded = {r.id: r for r in needed}
        self._unsent: dict[int, list[RecordedRequest]] = {}
        for request in needed:
            self._unsent.setdefault(request.version, []).append(request)
        self._outstanding: dict[int, int] = {v: len(rs) for v, rs in self._unsent.items()}  # not yet collected
        self._done: dict[tuple[int, int], Group] = {}

    def fill(self) -> None:
        """Send the requests recorded under the version the engines hold now, as engine slots free up."""
        loop = self.loop
        if not loop.may_admit():
            return
        queue = self._unsent.get(loop.version, [])
        per_engine = self.engine_slots()
        for engine in sorted(per_engine, key=per_engine.get):  # type: ignore[arg-type]
            while queue and per_engine[engine] < self.chunks_per_engine:
                request = queue.pop(0)
                self.submit(engine, [self._items[c] for c in request.cursors], request.id)
                per_engine[engine] += 1

    def on_request(self, chunk: Chunk, results: list[Any]) -> None:
        """Check the request ran under its recorded version, log it, and count it as collected."""
        super().on_request(chunk, results)
        versions = {v for samples in results for s in samples for v in s.versions}
        recorded = self._recorded[chunk.id].version
        if versions != {recorded}:
            raise RunError(
                f"replay diverged: request {chunk.id} was generated under policy version(s) {sorted(versions)}, "
                f"the recorded run under {recorded}"
            )
        self._outstanding[recorded] -= 1

    def requeue(self, lost: list[Chunk]) -> None:
        """The lost requests go back to the front of their version's queue, under their recorded ids."""
        for c in reversed(lost):
            request = self._recorded[c.id]
            self._unsent.setdefault(request.version, []).insert(0, request)

    def keep(self, group: Group) -> None:
        """Every recorded group is used as recorded; groups no batch needs are simply not kept."""
        key = (group.request, group.item.cursor)
        if key in self._wanted:
            self._done[key] = group

    def has_batch(self) -> bool:
        loop = self.loop
        if loop.step >= loop.total_steps or self._outstanding.get(loop.version, 0) > 0:
            return False
        return all(key in self._done for key in self.schedule.batches[loop.step])

    def next_batch(self) -> list[Group] | None:
        """The recorded groups of the next step, once they and every request of the current version are in:
        the sync that ends this step replaces the engines' weights."""
        if not self.has_batch():
            return None
        return [self._done.pop(key) for key in self.schedule.batches[self.loop.step]]


def _items_by_cursor(prompts: PromptStream, last: int) -> dict[int, PromptItem]:
    """The prompt stream up to cursor `last` (tokenized once), so recorded requests can name any prompt."""
    items: dict[int, PromptItem] = {}
    while prompts.cursor <= last:
        item = prompts.next()
        items[item.cursor] = item
    return items
