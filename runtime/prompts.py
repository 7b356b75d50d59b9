"""The prompt stream the controller feeds to rollout engines: built-in tasks or a JSONL dataset.

Each prompt has a cursor (its position in the stream) so that a resumed run continues with the next unseen
prompt, and a domain used to route MOPD teachers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from rlc.runtime.tasks.arithmetic import ArithmeticTask
from rlc.runtime.tasks.datasets import Example, load_jsonl
from rlc.schemas.plan import DataSettings


@dataclass(frozen=True)
class PromptItem:
    cursor: int
    prompt: str
    answer: str
    domain: str | None
    prompt_ids: tuple[int, ...]


def _examples(data: DataSettings, seed: int) -> Iterator[Example]:
    if data.builtin:
        if data.train != "arithmetic":
            raise ValueError(f"unknown built-in task {data.train!r}")
        yield from ArithmeticTask(digits=data.digits, seed=seed, shots=data.shots).stream()
        return
    examples = load_jsonl(data.train, data.prompt_key, data.answer_key, data.domain_key)
    if not examples:
        raise ValueError(f"dataset {data.train} has no examples")
    epoch = 0
    while True:
        order = list(range(len(examples)))
        random.Random(seed + epoch).shuffle(order)
        for index in order:
            yield examples[index]
        epoch += 1


class PromptStream:
    """An endless, seeded, resumable stream of tokenized prompts."""

    def __init__(self, data: DataSettings, tokenizer, seed: int, max_prompt_len: int, start: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self._source = islice(_examples(data, seed), start, None)
        self.cursor = start
        self._pending: list[PromptItem] = []
        #: Prompts cut to `max_prompt_len` so far (their first tokens dropped), and the notice for the first one.
        self.truncated = 0
        self._notice: str | None = None

    def check(self) -> None:
        """Fail early (before any actor starts) when the data cannot be read: read one prompt ahead."""
        self._pending = [self.next()]

    def next(self) -> PromptItem:
        if self._pending:
            return self._pending.pop()
        example = next(self._source)
        ids = self.tokenizer(example.prompt, add_special_tokens=True)["input_ids"]
        if len(ids) > self.max_prompt_len:
            if self.truncated == 0:
                self._notice = (
                    f"warning: prompt {self.cursor} of the data has {len(ids)} tokens, over the plan's max_prompt_len "
                    f"{self.max_prompt_len}: its first {len(ids) - self.max_prompt_len} tokens are dropped (so are "
                    "those of any later long prompt; metrics count them as data/truncated_prompts). Raise "
                    "rollout.max_prompt_len or shorten the data"
                )
            self.truncated += 1
            ids = ids[-self.max_prompt_len :]
        item = PromptItem(self.cursor, example.prompt, example.answer, example.domain, tuple(ids))
        self.cursor += 1
        return item

    def take(self, count: int) -> list[PromptItem]:
        return [self.next() for _ in range(count)]

    def pop_notice(self) -> str | None:
        """The first truncation's warning, once (the controller logs it)."""
        notice, self._notice = self._notice, None
        return notice
