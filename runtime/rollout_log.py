"""RUN/rollouts.jsonl: what an asynchronous run decided by timing, written so that the run can be replayed.

Two kinds of line, in the order they happened:

- ``{"kind": "request", "id": 7, "cursors": [16, 17, ...], "version": 2, "admitted_at": 1, "engine": 0}``: a
  generate request that came back: its prompts (stream cursors, in request order), the oldest policy version
  among its tokens, the trainer version when the controller admitted it, and the engine. A request that a
  weight update interrupted (`schedule.weight_update: interrupt`) also lists, per interrupted sample, the
  versions of its tokens as spans: ``"interrupted": [[prompt, sample, [[version, start, end], ...]], ...]``.
  Ids count submissions, so a request lost with its engine leaves a gap.
- ``{"kind": "batch", "step": 3, "groups": [[7, 16], [7, 17], ...]}``: the groups that step trained on, in
  batch order, each as (request id, cursor).

Everything else a sample depends on is fixed by the plan: its prompt by the cursor, its randomness by the
per-request seed (`seeds.request_seed`), its weights by the version. `ReplaySchedule` reads the file back
for `rlc run --replay`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rlc.runtime.checkpoint import close_log, fsync_dir, write_durably
from rlc.runtime.errors import RunError

__all__ = ["LOG_FILE", "RecordedRequest", "ReplaySchedule", "RolloutLog", "read_lines"]

LOG_FILE = "rollouts.jsonl"


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The log's lines; a torn last line (the run was killed mid-write) is left out, any other bad line is an
    error that names it."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RunError(f"{path}: not text; the rollout log was edited or damaged") from None
    raw = [line for line in text.splitlines() if line.strip()]
    lines: list[dict[str, Any]] = []
    for number, line in enumerate(raw, 1):
        try:
            lines.append(json.loads(line))
        except ValueError:
            if number == len(raw):
                break
            raise RunError(f"{path}:{number}: not a JSON line; the rollout log was edited or damaged") from None
    return lines


class RolloutLog:
    """Appends request and batch lines; on resume, keeps only what the checkpoint's steps used.

    A step's batch line is fsynced as it is written, with the request lines before it (once a step, not once
    a request): `--replay` trusts the file, so the steps a checkpoint holds must be in it after a power loss.
    """

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        self.path = run_dir / LOG_FILE
        self.next_id = 0
        if start_step == 0:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            self.next_id = self._truncate_after(start_step)
        self._file: TextIO | None = self.path.open("a")
        fsync_dir(run_dir)  # the file's entry, when this created it

    def _truncate_after(self, step: int) -> int:
        """Drop batches after `step` and requests no kept batch uses; returns the next free request id.

        Requests in flight or unused at the checkpoint are generated again after the resume, under new ids.
        """
        lines = read_lines(self.path)
        batches = [x for x in lines if x.get("kind") == "batch" and x["step"] <= step]
        used = {request for x in batches for request, _ in x["groups"]}
        kept = [x for x in lines if x in batches or (x.get("kind") == "request" and x["id"] in used)]
        write_durably(self.path, "".join(json.dumps(x, sort_keys=True) + "\n" for x in kept))
        return 1 + max((x["id"] for x in lines if x.get("kind") == "request"), default=-1)

    def new_id(self) -> int:
        """The id of the next request the controller submits."""
        self.next_id += 1
        return self.next_id - 1

    def request(
        self,
        request_id: int,
        cursors: list[int],
        version: int,
        admitted_at: int,
        engine: int,
        interrupted: list[tuple[int, int, list[tuple[int, int, int]]]] | None = None,
    ) -> None:
        record: dict[str, Any] = {
            "kind": "request",
            "id": request_id,
            "cursors": cursors,
            "version": version,
            "admitted_at": admitted_at,
            "engine": engine,
        }
        if interrupted:
            record["interrupted"] = [[p, s, [list(span) for span in spans]] for p, s, spans in interrupted]
        self._write(record)

    def batch(self, step: int, groups: list[tuple[int, int]]) -> None:
        self._write({"kind": "batch", "step": step, "groups": [list(g) for g in groups]}, sync=True)

    def _write(self, record: dict[str, Any], sync: bool = False) -> None:
        """Append one line; `sync` (a step's batch line) also makes it and every line before it durable."""
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
            if sync:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            handle, self._file = self._file, None
            close_log(handle)


@dataclass(frozen=True)
class RecordedRequest:
    id: int
    cursors: tuple[int, ...]
    version: int
    interrupted: bool = False


@dataclass
class ReplaySchedule:
    """A recorded run's requests and batches, checked for what a replay needs.

    A replay submits every request a recorded batch used, with the same prompts in the same order, while its
    engines hold the recorded version, and trains each step on the recorded groups in the recorded order.
    """

    requests: dict[int, RecordedRequest]
    batches: list[list[tuple[int, int]]]  # batches[s - 1]: step s's (request id, cursor) groups

    @property
    def steps(self) -> int:
        return len(self.batches)

    @classmethod
    def load(cls, run_dir: Path, batch_prompts: int) -> ReplaySchedule:
        path = run_dir / LOG_FILE
        if not path.is_file():
            raise RunError(f"--replay: {path} does not exist; replay needs a run made by an rlc that records it")
        requests: dict[int, RecordedRequest] = {}
        batches: dict[int, list[tuple[int, int]]] = {}
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RunError(f"--replay: {path} cannot be read ({exc})") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if record["kind"] == "request":
                    rid = int(record["id"])
                    cursors = tuple(int(c) for c in record["cursors"])
                    interrupted = bool(record.get("interrupted"))
                    requests[rid] = RecordedRequest(rid, cursors, int(record["version"]), interrupted)
                elif record["kind"] == "batch":
                    batches[int(record["step"])] = [(int(r), int(c)) for r, c in record["groups"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise RunError(f"--replay: {path}:{number} is not a rollout record ({exc})") from None
        schedule = cls(requests, [batches[s] for s in sorted(batches)])
        schedule._check(sorted(batches), batch_prompts, path)
        return schedule

    def _check(self, steps: list[int], batch_prompts: int, path: Path) -> None:
        if not steps:
            raise RunError(f"--replay: {path} records no completed step")
        if steps != list(range(1, len(steps) + 1)):
            raise RunError(f"--replay: {path} records steps {steps[0]}..{steps[-1]} with gaps; it must start at 1")
        for step, groups in enumerate(self.batches, 1):
            if len(groups) != batch_prompts:
                raise RunError(
                    f"--replay: step {step} of {path} trained on {len(groups)} prompts, this plan's batch is "
                    f"{batch_prompts}: replay it with the plan that made the run"
                )
            for rid, cursor in groups:
                request = self.requests.get(rid)
                if request is None or cursor not in request.cursors:
                    raise RunError(f"--replay: step {step} of {path} uses prompt {cursor} of unrecorded request {rid}")
                if request.interrupted:
                    raise RunError(
                        f"--replay: step {step} trained on request {rid}, which a weight update interrupted: when "
                        "it landed depended on timing, so replay cannot generate it again; runs meant for replay "
                        "set rollout.weight_update: wait"
                    )
                if request.version < 0:
                    raise RunError(
                        f"--replay: step {step} trained on request {rid}, generated by a restarted engine before it "
                        "had the run's weights; replay cannot generate it again"
                    )

    def needed(self) -> list[RecordedRequest]:
        """The requests some batch used, in submission order."""
        used = {rid for groups in self.batches for rid, _ in groups}
        return [self.requests[rid] for rid in sorted(used)]

    def max_cursor(self) -> int:
        return max(c for r in self.needed() for c in r.cursors)
