"""What a role search returns: the fitting options for one role and device count, and the closest miss.

Candidates that do not fit memory are kept as the closest miss so that the plan can say why a layout lost,
and so that an infeasible spec gets the closest breakdown in its diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlc.compiler import cost
from rlc.compiler.memory import MemoryBreakdown, RolloutLayout
from rlc.schemas.layout import TrainLayout


@dataclass(frozen=True)
class TrainOption:
    """A trainer layout that fits, with its memory and time; `switch_s` is its colocated phase switch."""

    layout: TrainLayout
    memory: MemoryBreakdown
    time: cost.TrainTime
    switch_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.time.total_s

    @property
    def score(self) -> float:
        """What the trainer adds to a step: its time, plus the state it moves when it shares devices."""
        return self.time.total_s + self.switch_s


@dataclass(frozen=True)
class RolloutOption:
    layout: RolloutLayout
    memory: MemoryBreakdown
    seqs: int
    time: cost.RolloutTime


@dataclass(frozen=True)
class TeacherOption:
    name: str
    layout: RolloutLayout
    memory: MemoryBreakdown
    seqs: int
    seconds: float


@dataclass
class RoleSearch:
    """Fitting options for one role and device count, best first, and the closest miss."""

    options: list = field(default_factory=list)
    closest: MemoryBreakdown | None = None
    closest_layout: object | None = None
    reason: str = ""
    #: What the search tried (the trainer's degree tuples), for a refusal to name.
    tried: str = ""

    def miss(self, breakdown: MemoryBreakdown, layout: object) -> None:
        """Remember the layout closest to fitting (device overflow; host-memory misses rank last)."""
        if self.closest is None or overflow(breakdown) < overflow(self.closest):
            self.closest, self.closest_layout = breakdown, layout


def overflow(b: MemoryBreakdown) -> float:
    """GiB over capacity, with host-memory problems ranked after every device overflow."""
    return b.total_gib - b.capacity_gib + (1e6 if b.problems else 0.0)


def record(failures: dict[str, RoleSearch], role: str, found: RoleSearch) -> None:
    """Keep, per role, the closest miss over every device count tried."""
    held = failures.get(role)
    if (
        held is None
        or held.closest is None
        or (found.closest is not None and overflow(found.closest) < overflow(held.closest))
    ):
        failures[role] = found
