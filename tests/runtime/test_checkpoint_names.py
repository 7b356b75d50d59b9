"""The real Qwen3.5/3.6 checkpoint format: a multimodal folder (``Qwen3_5ForConditionalGeneration``: text weights
under ``model.language_model.``, a vision tower, an MTP head the text model drops). What leaves the trainer
(broadcast names, sync folders, checkpoints) uses the folder's own names, a checkpoint is a drop-in replacement
for the folder (config, vision tower and MTP head included, so an engine restarted from it still speculates),
and resuming from it restores the trainer's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny hybrid saved the way the published checkpoints are, plus an MTP tensor and its config key."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from rlc.runtime.tasks.tiny_hybrid_model import tiny_hybrid_config
    from rlc.runtime.tasks.tokenizer import save_char_tokenizer

    out = tmp_path_factory.mktemp("qwen3_5-multimodal")
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128}
    text = {**tiny_hybrid_config().to_dict(), "mtp_num_hidden_layers": 1}
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    ).save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    weights["mtp.fc.weight"] = torch.randn(128, 256)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    save_char_tokenizer(out, 512)
    return out


def _base(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_names_leave_and_come_back_in_the_checkpoints_format(multimodal_dir: Path, tmp_path: Path) -> None:
    from rlc.runtime.train.trainer import TrainerWorker

    base = _base(multimodal_dir)
    w = TrainerWorker(0, 1, None, 0, str(multimodal_dir), "cpu", {"packing": True})
    try:
        names = w.checkpoint_names
        assert names.prefix == "model.language_model."
        assert "mtp.fc.weight" in names.extra and any(k.startswith("model.visual.") for k in names.extra)
        meta = w.weight_meta()
        # Every name a sync announces is the base's (a tied head is sent under both names; the file keeps one).
        assert meta and {name for name, _, _ in meta} - base.keys() == {"lm_head.weight"}
        sync = w.sync_state_dict()
        assert sync.keys() == {name for name, _, _ in meta}
        tied = base["model.language_model.embed_tokens.weight"]
        assert all(torch.equal(v, base.get(k, tied)) for k, v in sync.items())  # untrained: the base's own values
        assert not any(k.startswith(("mtp.", "model.visual.")) for k in sync)  # the frozen head is never synced

        w.save_checkpoint(str(tmp_path / "ckpt"))
        exported = _base(tmp_path / "ckpt" / "hf")
        assert exported.keys() - {"lm_head.weight"} == base.keys()  # a drop-in: vision tower and MTP head included
        assert torch.equal(exported["mtp.fc.weight"], base["mtp.fc.weight"])
        config = json.loads((tmp_path / "ckpt" / "hf" / "config.json").read_text())
        assert config == json.loads((multimodal_dir / "config.json").read_text())
        assert config["text_config"]["mtp_num_hidden_layers"] == 1  # what vLLM needs to build the MTP drafter

        with torch.no_grad():  # resume restores what the checkpoint holds, through the name mapping
            for p in w.model.parameters():
                p.zero_()
        w.load_checkpoint(str(tmp_path / "ckpt"))
        restored = w.sync_state_dict()
        assert all(torch.equal(v, base.get(k, tied)) for k, v in restored.items())
    finally:
        w.shutdown()


def test_a_text_checkpoint_keeps_its_names(tiny_model_dir: Path) -> None:
    from rlc.runtime.train.trainer import TrainerWorker

    w = TrainerWorker(0, 1, None, 0, str(tiny_model_dir), "cpu", {"packing": True})
    try:
        assert w.checkpoint_names.prefix == "model." and w.checkpoint_names.extra == ()
        assert {name for name, _, _ in w.weight_meta()} == set(w.full_state_dict())
    finally:
        w.shutdown()
