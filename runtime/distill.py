"""Multi-teacher on-policy distillation (MOPD): forward-only teacher engines score the student's samples.

Each teacher role (``teacher-<name>``) is a pool of ``RolloutEngine`` actors on its own devices used only
through ``prompt_logprobs``: a full prompt + response goes in, log p_teacher(x_t | x_<t) comes back for every
token. The student's loss then adds ``coef`` × the per-token reverse-KL term (student − teacher log-prob of
the sampled token, ``reverse_kl_distill``) on the response tokens.

Routing (``plan.distill.routing``):
* ``domain``: a trajectory goes to the teacher whose ``domain`` equals its prompt's domain (the built-in
  arithmetic task's domain is ``arithmetic``); a sole teacher without a ``domain`` serves every trajectory;
  a trajectory no teacher serves gets no distillation term.
* ``mixture``: every teacher scores every trajectory, and the term is the *weighted sum of the per-token
  reverse-KL terms*, Σ_k w_k (log s − log t_k) with weights normalised to 1. That equals one reverse-KL
  term against Σ_k w_k log t_k (a weighted geometric mean of the teachers), which is what is sent to the
  trainer as ``teacher_logprobs``.

Teacher log-probs are raw model log-probs (temperature 1): the student is pulled towards the teacher's
own distribution whatever temperature rollout samples at.

A teacher engine that dies is restarted in place (teachers never change weights, so a new actor on the
same bundle is an exact replacement) and its share of the batch is scored again; the run only fails if
the same share fails ``MAX_SCORE_ATTEMPTS`` times in a row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlc.runtime.errors import RunError
from rlc.runtime.rollout.client import EngineClient
from rlc.schemas.plan import Plan, TeacherSettings

MAX_SCORE_ATTEMPTS = 3


@dataclass
class Scoring:
    """Teacher calls in flight for one batch: per teacher, the routed sequence indices and Ray refs."""

    routed: dict[str, list[int]]
    refs: dict[str, list[tuple[int, list[int], Any]]]  # (engine index, sequence indices, ref)


class TeacherPool:
    """The teachers' engine actors; ``score`` → ``collect`` gives the distillation inputs of a batch."""

    def __init__(self, plan: Plan, make_engine: Callable[[str, int], Any], log: Callable[[str], None] = print) -> None:
        """``make_engine(role_name, index)`` starts one teacher engine actor; ``log`` reports restarts."""
        if plan.distill is None:
            raise ValueError("TeacherPool without plan.distill")
        self._make = make_engine
        self.log = log
        self.restarts = 0
        self.settings = plan.distill
        self.teachers: list[TeacherSettings] = list(plan.distill.teachers)
        self.engines: dict[str, list[Any]] = {
            t.name: [EngineClient(make_engine(t.role, i)) for i in range(plan.role(t.role).replicas)]
            for t in self.teachers
        }

    def ready_refs(self) -> list[Any]:
        """One reference per teacher engine that resolves once it is serving."""
        return [e.ready() for engines in self.engines.values() for e in engines]

    def route(self, domains: Sequence[str | None]) -> dict[str, list[int]]:
        """Which sequences each teacher scores."""
        if self.settings.routing == "mixture":
            return {t.name: list(range(len(domains))) for t in self.teachers}
        # A teacher without a domain (allowed only when it is the sole teacher, RLC203) serves every
        # trajectory that no teacher's domain claims, whatever the data calls its domain.
        claimed = {t.domain for t in self.teachers if t.domain is not None}
        return {
            t.name: [i for i, d in enumerate(domains) if (d == t.domain if t.domain is not None else d not in claimed)]
            for t in self.teachers
        }

    def score(self, input_ids: Sequence[Sequence[int]], domains: Sequence[str | None]) -> Scoring:
        """Send each teacher its routed sequences, split evenly over its replicas; returns at once."""
        routed = self.route(domains)
        refs: dict[str, list[tuple[int, list[int], Any]]] = {}
        for name, indices in routed.items():
            engines = self.engines[name]
            refs[name] = []
            for r, engine in enumerate(engines):
                part = indices[r :: len(engines)]
                if part:
                    refs[name].append((r, part, engine.prompt_logprobs([input_ids[i] for i in part])))
        return Scoring(routed, refs)

    def _teacher(self, name: str) -> TeacherSettings:
        return next(t for t in self.teachers if t.name == name)

    def _restart(self, name: str, index: int) -> None:
        """Replace a dead teacher engine by a fresh actor on the same bundle (same weights: teachers are frozen)."""
        import ray

        from rlc.runtime.rollout.pool import ENGINE_START_TIMEOUT_S

        with contextlib.suppress(Exception):
            ray.kill(self.engines[name][index].actor, no_restart=True)
        self.engines[name][index] = EngineClient(self._make(self._teacher(name).role, index))
        try:
            ray.get(self.engines[name][index].ready(), timeout=ENGINE_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RunError(
                f"teacher {name} engine {index} did not start again within {ENGINE_START_TIMEOUT_S} s"
            ) from None
        self.restarts += 1

    def _get(
        self, name: str, index: int, part: list[int], ref: Any, input_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """The log-probs of one share, restarting the engine and re-scoring if it died."""
        import ray

        from rlc.runtime.rollout.failures import engine_is_dead

        for attempt in range(1, MAX_SCORE_ATTEMPTS + 1):
            try:
                if attempt > 1:
                    self._restart(name, index)
                    ref = self.engines[name][index].prompt_logprobs([input_ids[i] for i in part])
                return ray.get(ref)
            except Exception as exc:
                if not engine_is_dead(exc) or attempt == MAX_SCORE_ATTEMPTS:
                    raise
                self.log(f"teacher {name} engine {index} died; restarting it and re-scoring {len(part)} sequence(s)")
        raise AssertionError("unreachable")

    def collect(
        self, scoring: Scoring, input_ids: Sequence[Sequence[int]]
    ) -> tuple[dict[str, list[list[float]]], dict[str, Any]]:
        """Per teacher, rows aligned with ``input_ids`` (entry t = log p(x_t | x_<t), entry 0 = 0.0; empty
        for sequences it did not score); and the batch keys ``teacher_logprobs`` + ``distill_weights``."""
        rows: dict[str, list[list[float]]] = {}
        for name, parts in scoring.refs.items():
            rows[name] = [[] for _ in input_ids]
            for index, indices, ref in parts:
                for i, lps in zip(indices, self._get(name, index, indices, ref, input_ids), strict=True):
                    rows[name][i] = [0.0, *lps]
        return rows, self.combine(rows, input_ids)

    def combine(self, rows: dict[str, list[list[float]]], input_ids: Sequence[Sequence[int]]) -> dict[str, Any]:
        """The trainer's ``teacher_logprobs`` and ``distill_weights`` from each teacher's rows (see routing)."""
        teacher, weights = [], []
        total_w = sum(t.weight for t in self.teachers)
        for i, ids in enumerate(input_ids):
            scored = [t for t in self.teachers if rows[t.name][i]]
            if not scored:
                teacher.append([0.0] * len(ids))
                weights.append(0.0)
                continue
            if self.settings.routing == "mixture":
                combined = [0.0] * len(ids)
                for t in scored:
                    for j, v in enumerate(rows[t.name][i]):
                        combined[j] += t.weight / total_w * v
                teacher.append(combined)
            else:
                teacher.append(rows[scored[0].name][i])
            weights.append(1.0)
        return {"teacher_logprobs": teacher, "distill_weights": weights}

    def shutdown(self) -> None:
        import ray

        for engines in self.engines.values():
            for engine in engines:
                with contextlib.suppress(Exception):
                    ray.kill(engine, no_restart=True)
        self.engines = {}


def teacher_metrics(
    rows: dict[str, list[list[float]]], student: Sequence[Sequence[float]], loss_mask: Sequence[Sequence[int]]
) -> dict[str, float]:
    """``distill/<name>/reverse_kl`` (mean student − teacher log-prob over the response tokens it scored,
    the k1 estimate of KL(student ‖ teacher)) and ``distill/<name>/tokens`` for each teacher."""
    out: dict[str, float] = {}
    for name, teacher_rows in rows.items():
        total, count = 0.0, 0
        for t_row, s_row, m_row in zip(teacher_rows, student, loss_mask, strict=True):
            if not t_row:
                continue
            for j in range(1, len(m_row)):
                if m_row[j]:
                    total += s_row[j] - t_row[j]
                    count += 1
        out[f"distill/{name}/reverse_kl"] = total / count if count else 0.0
        out[f"distill/{name}/tokens"] = float(count)
    return out
