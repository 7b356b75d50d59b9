"""The calculator tool-use task of the agentic demonstrator: two-digit addition through a tool call.

An episode is a chat: the user asks ``47+38=``, the model calls the calculator by writing ``[47+38]``, the tool
answers ``(85)``, and the model copies the result: ``85``. Two-digit addition is beyond the tiny model, copying
is not, so a policy that learns to use the tool earns reward a policy answering directly cannot. The tool's
reply is environment text: the trainer must never learn to produce it (it carries loss mask 0).

The character tokenizer gains the tool brackets and a chat template that renders a conversation as the bare
characters with ``<eos>`` closing each assistant turn, so what the server renders for the next call starts
with exactly the tokens the model sampled (the recorder's prefix rule then holds on every turn).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from rlc.agents.calculator import calculate, parse_tool_call

from .tokenizer import CHARACTERS

__all__ = [
    "AGENT_CHARACTERS",
    "CHAT_TEMPLATE",
    "Episode",
    "calculate",
    "episode_turns",
    "parse_tool_call",
    "warmup_episodes",
]

#: The quickstart characters, the tool brackets, and letters filling the tiny model's 32 ids: every id the model
#: can sample decodes to a character that re-encodes to the same id.
AGENT_CHARACTERS: tuple[str, ...] = (*CHARACTERS, "[", "]", "(", ")", *"abcdefghi")

#: Messages rendered as their bare text; an assistant turn ends with <eos>, which is what the model samples to
#: stop, so a rendered conversation holds the sampled ids unchanged. No generation prompt is added.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class Episode:
    """A correct episode's turns, for the supervised warm-up: (role, text) in order."""

    prompt: str
    answer: str

    def turns(self) -> list[tuple[str, str]]:
        return episode_turns(self.prompt, self.answer)


def episode_turns(prompt: str, answer: str) -> list[tuple[str, str]]:
    """``a+b=`` → user ``a+b=``, assistant ``[a+b]``, tool ``(answer)``, assistant ``answer``."""
    call = "[" + prompt.rstrip("=") + "]"
    return [("user", prompt), ("assistant", call), ("tool", f"({answer})"), ("assistant", answer)]


def warmup_episodes(count: int, seed: int, digits: Sequence[int] = (2,)) -> list[Episode]:
    """Seeded correct episodes of additions with the given operand widths."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        width = rng.choice(list(digits))
        low = 0 if width == 1 else 10 ** (width - 1)
        a, b = rng.randint(low, 10**width - 1), rng.randint(low, 10**width - 1)
        out.append(Episode(f"{a}+{b}=", str(a + b)))
    return out
