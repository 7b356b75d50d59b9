"""The prompt stream cuts prompts over the plan's `max_prompt_len` only with a warning and a count."""

from __future__ import annotations

import json
from pathlib import Path

from rlc.runtime.prompts import PromptStream
from rlc.runtime.tasks.tokenizer import build_char_tokenizer
from rlc.schemas.plan import DataSettings


def _settings(path: Path) -> DataSettings:
    return DataSettings(
        train=str(path), builtin=False, prompt_key="prompt", answer_key="answer", domain_key=None, digits=1, reward="x"
    )


def test_a_long_prompt_is_cut_from_the_left_with_one_warning_and_a_count(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "1+2+3+4+5=", "answer": "15"},
        {"prompt": "9+9+9+9=", "answer": "36"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = build_char_tokenizer(64)
    stream = PromptStream(_settings(data), tokenizer, seed=0, max_prompt_len=6)
    items = stream.take(3)
    full = {item.prompt: tokenizer(item.prompt, add_special_tokens=True)["input_ids"] for item in items}
    for item in items:
        assert list(item.prompt_ids) == full[item.prompt][-6:]  # the end of the prompt, where the question is
    assert stream.truncated == sum(len(ids) > 6 for ids in full.values()) == 2
    notice = stream.pop_notice()
    assert notice is not None and "over the plan's max_prompt_len 6" in notice and "data/truncated_prompts" in notice
    assert stream.pop_notice() is None  # said once
