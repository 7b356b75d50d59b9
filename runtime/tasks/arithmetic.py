"""The built-in ``arithmetic`` task: seeded ``a+b=`` prompts whose answer a rule reward can check.

It needs no data files, fits the character tokenizer, and is learnable by a 2-layer model within
minutes on CPU, which is what the embedded quickstart needs to show reward rising.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .datasets import Example

__all__ = ["ArithmeticTask", "all_one_digit_additions"]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticTask:
    """Prompts ``"{a}{op}{b}="`` with operands of exactly ``digits`` digits (0–9 when ``digits`` is 1).

    With ``shots`` > 0 each prompt first lists that many solved examples (``"3+5=8 1+2=3 ... 4+4="``): the
    same question, in a long context, for long-context runs.
    """

    digits: int = 1
    ops: Sequence[str] = ("+",)
    seed: int = 0
    shots: int = 0

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")
        unknown = [op for op in self.ops if op not in _OPS]
        if unknown or not self.ops:
            raise ValueError(f"unsupported ops {unknown or list(self.ops)}; choose from {sorted(_OPS)}")

    def _operand_range(self) -> tuple[int, int]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return low, 10**self.digits - 1

    def make(self, a: int, b: int, op: str = "+") -> Example:
        """The example for one operand pair."""
        return Example(prompt=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)), domain="arithmetic")

    def sample(self, n: int, seed: int | None = None) -> list[Example]:
        """``n`` examples drawn with ``seed`` (default: the task's seed); same seed, same list."""
        rng = random.Random(self.seed if seed is None else seed)
        low, high = self._operand_range()
        return [self.make(rng.randint(low, high), rng.randint(low, high), rng.choice(list(self.ops))) for _ in range(n)]

    def stream(self) -> Iterator[Example]:
        """An endless seeded stream of examples (for the rollout side's prompt iterator)."""
        rng = random.Random(self.seed)
        low, high = self._operand_range()
        ops = list(self.ops)
        while True:
            solved = []
            for _ in range(self.shots):
                shot = self.make(rng.randint(low, high), rng.randint(low, high), rng.choice(ops))
                solved.append(shot.prompt + shot.answer + " ")
            question = self.make(rng.randint(low, high), rng.randint(low, high), rng.choice(ops))
            yield Example("".join(solved) + question.prompt, question.answer, question.domain)


def all_one_digit_additions() -> list[Example]:
    """All 100 one-digit additions in a fixed order (evaluation and the warm-up set)."""
    task = ArithmeticTask()
    return [task.make(a, b) for a in range(10) for b in range(10)]
