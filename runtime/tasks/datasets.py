"""Prompt datasets: the ``Example`` record every task yields, and JSONL files of them.

User data arrives as JSON Lines with a prompt and a reference answer per line (plus an optional
domain used to route multi-teacher distillation or per-domain rewards). Mistakes in such files are
common, so every error names the file and the 1-based line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DatasetError", "Example", "load_jsonl"]


@dataclass(frozen=True)
class Example:
    """One prompt with the answer a rule reward checks against."""

    prompt: str
    answer: str
    domain: str | None = None


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message says where."""


def load_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    domain_key: str | None = "domain",
) -> list[Example]:
    """Read ``path`` (one JSON object per line, blank lines skipped) into ``Example`` records.

    Answers may be numbers in the file; they become strings. ``domain_key`` is optional per line.
    """
    p = Path(path)
    if not p.is_file():
        hint = " (it is a directory)" if p.is_dir() else ""
        raise DatasetError(f"dataset file not found: {p}{hint}")
    examples: list[Example] = []
    with p.open(encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{p}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in (prompt_key, answer_key):
                if key not in row:
                    raise DatasetError(
                        f"{p}:{lineno}: missing key {key!r} (keys present: {', '.join(sorted(row)) or 'none'})"
                    )
            prompt = row[prompt_key]
            if not isinstance(prompt, str):
                raise DatasetError(f"{p}:{lineno}: {prompt_key!r} must be a string, got {type(prompt).__name__}")
            domain = row.get(domain_key) if domain_key else None
            examples.append(
                Example(prompt=prompt, answer=str(row[answer_key]), domain=None if domain is None else str(domain))
            )
    if not examples:
        raise DatasetError(f"{p}: no examples (the file is empty)")
    return examples
