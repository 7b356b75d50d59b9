"""The README as a contract: every spec block in it validates and compiles as printed."""

from __future__ import annotations

import re

import pytest
from paths import REPO

from rlc.compiler.planner import build_plan
from rlc.compiler.validate import check_text

README = REPO / "README.md"
BLOCKS = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_spec_blocks() -> None:
    assert BLOCKS, "no ```yaml block found in README.md"


@pytest.mark.parametrize("text", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_spec_block_validates_and_compiles(text: str) -> None:
    checked = check_text(text, "README.md")
    assert checked.report.ok, [(d.code, d.path, d.message) for d in checked.report.errors]
    assert checked.problem is not None
    plan, found = build_plan(checked.problem, checked.lines, "README.md")
    assert plan is not None, [(d.code, d.message, d.hint) for d in found]
