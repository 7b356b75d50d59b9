"""Where tests find the repository's files, wherever in tests/ they live."""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLES", "GOLDEN", "REPO"]

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
GOLDEN = REPO / "tests" / "golden"
