"""Character tokenizer, the tiny quickstart model, the arithmetic task, rewards, JSONL datasets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rlc.runtime.tasks.arithmetic import ArithmeticTask, all_one_digit_additions  # noqa: E402
from rlc.runtime.tasks.datasets import DatasetError, Example, load_jsonl  # noqa: E402
from rlc.runtime.tasks.model_builder import build_tiny_model  # noqa: E402
from rlc.runtime.tasks.rewards import (  # noqa: E402
    RewardLoadError,
    exact_match,
    extract_answer,
    load_reward,
    math_exact,
)
from rlc.runtime.tasks.tiny_model import MARKER, greedy_accuracy  # noqa: E402
from rlc.runtime.tasks.tokenizer import BOS_ID, EOS_ID, VOCAB, save_char_tokenizer  # noqa: E402

torch.set_num_threads(2)


# --- tokenizer --------------------------------------------------------------------------------


def test_tokenizer_roundtrip_with_auto_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    save_char_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == len(VOCAB) <= 32
    ids = tok("12+ 34=46").input_ids
    assert ids[0] == BOS_ID and len(ids) == 10
    assert tok.decode(ids, skip_special_tokens=True) == "12+ 34=46"
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == 0
    assert tok.decode([*tok("7", add_special_tokens=False).input_ids, EOS_ID], skip_special_tokens=True) == "7"
    assert tok.convert_ids_to_tokens(tok("x").input_ids) == ["<bos>", "<unk>"]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


# --- tiny model -------------------------------------------------------------------------------


def test_tiny_model_loads_with_expected_architecture(tiny_model_dir: Path, tiny_model) -> None:
    cfg = tiny_model.config
    assert cfg.model_type == "qwen3"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 128, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (2, 32, 256, 32)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 512
    assert tiny_model.lm_head.weight.data_ptr() == tiny_model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters())
    assert {p.name for p in tiny_model_dir.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", MARKER}
    assert not [p for p in tiny_model_dir.parent.iterdir() if p.name.startswith(".")], "temp dir left behind"


def test_tiny_model_warmup_beats_chance(tiny_model_dir: Path, tiny_model) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    acc = greedy_accuracy(tiny_model, tok, all_one_digit_additions())
    recorded = json.loads((tiny_model_dir / MARKER).read_text())["warmup_greedy_accuracy"]
    assert acc == pytest.approx(recorded)
    assert acc > 3 / 19  # chance is ~1/19 (19 possible sums); the warm-up must clearly beat it


def test_tiny_model_deterministic_and_idempotent(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    # A short warm-up runs the same code as the quickstart's 40 steps (and takes a fraction of the time).
    first = build_tiny_model(tmp_path / "a", seed=0, warmup_steps=3)
    again = build_tiny_model(tmp_path / "b", seed=0, warmup_steps=3)
    other = build_tiny_model(tmp_path / "c", seed=1, warmup_steps=3)
    ref = load_file(first / "model.safetensors")
    same = load_file(again / "model.safetensors")
    diff = load_file(other / "model.safetensors")
    assert ref.keys() == same.keys()
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    assert not all(torch.equal(ref[k], diff[k]) for k in ref)
    # Idempotent: a complete folder is reused untouched; a different recipe is refused.
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(again, seed=0, warmup_steps=3) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="different recipe"):
        build_tiny_model(again, seed=3, warmup_steps=3)
    with pytest.raises(ValueError, match="different recipe"):
        build_tiny_model(again, seed=0)  # the default warm-up is another recipe too
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a complete tiny model"):
        build_tiny_model(junk)


# --- arithmetic task --------------------------------------------------------------------------


def test_arithmetic_task_is_seeded_and_correct() -> None:
    task = ArithmeticTask(digits=2, seed=5)
    a, b = task.sample(20), task.sample(20)
    assert a == b and task.sample(20, seed=6) != a
    for ex in a:
        x, y = ex.prompt.rstrip("=").split("+")
        assert len(x) == len(y) == 2 and int(ex.answer) == int(x) + int(y)
    assert ArithmeticTask().make(3, 4) == Example("3+4=", "7", "arithmetic")
    stream = ArithmeticTask(digits=1, ops=("-", "*"), seed=1).stream()
    for _ in range(10):
        ex = next(stream)
        assert ex.answer == str(eval(ex.prompt.rstrip("=")))
    assert len(all_one_digit_additions()) == 100
    with pytest.raises(ValueError, match="unsupported ops"):
        ArithmeticTask(ops=("/",))


# --- rewards ----------------------------------------------------------------------------------


def test_exact_match() -> None:
    assert exact_match(" 7\n", "7") == 1.0
    assert exact_match("17", "7") == 0.0
    assert exact_match("", "7") == 0.0


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
        ("We get 3, then 5, finally 1,234.", "1234", 1.0),
        ("The total is $7.0$", "7", 1.0),
        ("first 7 then 8", "7", 0.0),
        ("no number here", "7", 0.0),
        ("\\boxed{-3}", "-3", 1.0),
        ("\\boxed{\\text{yes}}", "yes", 1.0),
    ],
)
def test_math_exact(completion: str, answer: str, reward: float) -> None:
    assert math_exact(completion, answer) == reward


def test_extract_answer_prefers_last_boxed() -> None:
    assert extract_answer("\\boxed{1} no wait \\boxed{2} and 9") == "2"
    assert extract_answer("x = 3/4") == "3/4"


def test_load_reward_builtin_and_custom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_reward("exact_match") is exact_match
    pkg = tmp_path / "myrewards.py"
    pkg.write_text("def score(completion, answer, **kw):\n    return 0.5\nNOT_CALLABLE = 3\n")
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("myrewards:score")("a", "b") == 0.5
    cases = {
        "exact_mach": "did you mean 'exact_match'",
        "myrewards:scor": "did you mean 'score'",
        "myrewards:NOT_CALLABLE": "not a callable",
        "no_such_module_xyz:f": "cannot import module 'no_such_module_xyz'",
        "broken_rewards:f": "RuntimeError: boom",
        ":f": "both parts",
    }
    for path, message in cases.items():
        with pytest.raises(RewardLoadError, match=message):
            load_reward(path)
    sys.modules.pop("myrewards", None)


# --- datasets ---------------------------------------------------------------------------------


def test_load_jsonl(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": 2}\n\n{"prompt": "p", "answer": "a", "domain": "math"}\n')
    assert load_jsonl(f) == [Example("1+1=", "2", None), Example("p", "a", "math")]
    g = tmp_path / "q.jsonl"
    g.write_text('{"question": "q", "solution": "s"}\n')
    assert load_jsonl(g, prompt_key="question", answer_key="solution") == [Example("q", "s")]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": \n', r"bad\.jsonl:2: invalid JSON"),
        ('{"prompt": "a", "answer": "b"}\n\n{"prompt": "c"}\n', r":3: missing key 'answer' \(keys present: prompt\)"),
        ("[1, 2]\n", r":1: expected a JSON object, got list"),
        ('{"prompt": 5, "answer": "b"}\n', r":1: 'prompt' must be a string"),
        ("\n\n", "no examples"),
    ],
)
def test_load_jsonl_errors(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_jsonl(f)


def test_load_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"dataset file not found: .*nope\.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="directory"):
        load_jsonl(tmp_path)
