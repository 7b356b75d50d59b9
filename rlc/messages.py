"""Message text shared by the compiler, the runtime and the CLI."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of an exception's message (Ray's and pydantic's run to pages), else `default` or its type."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else (default or type(exc).__name__)
