"""Character-level tokenizer for the quickstart, saved as a real Hugging Face tokenizer folder.

The embedded default must run with nothing downloaded, so the tokenizer is built here: one token per
character of the arithmetic alphabet plus pad/bos/eos/unk. It is a ``tokenizers`` WordLevel model
behind ``PreTrainedTokenizerFast`` so both transformers' ``AutoTokenizer`` and vLLM load the folder
like any other checkpoint's. ``<bos>`` is prepended on encode (with special tokens), so the trainer
and vLLM tokenise prompts identically.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = (*"0123456789", "+", "-", "*", "=", " ")
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}  # the quickstart's
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (VOCAB[t] for t in SPECIAL_TOKENS)
MODEL_MAX_LENGTH = 512


def char_vocab(characters: tuple[str, ...] = CHARACTERS) -> dict[str, int]:
    """Special tokens first (so their ids never move), then one id per character."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + characters)}


def build_char_tokenizer(
    model_max_length: int = MODEL_MAX_LENGTH,
    characters: tuple[str, ...] = CHARACTERS,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """The quickstart tokenizer in memory (19 tokens; unknown characters map to ``<unk>``).

    Other tasks pass their own ``characters`` (the agent task adds tool brackets) and a ``chat_template`` for
    vLLM's chat endpoint; the special tokens keep their ids either way.
    """
    tok = Tokenizer(models.WordLevel(vocab=char_vocab(characters), unk_token=UNK))
    # Every character is its own pre-token, spaces included.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without inserted spaces
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
        padding_side="left",  # generation batches pad on the left
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def save_char_tokenizer(
    out_dir: str | Path,
    model_max_length: int = MODEL_MAX_LENGTH,
    characters: tuple[str, ...] = CHARACTERS,
    chat_template: str | None = None,
) -> Path:
    """Write the tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` …) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(model_max_length, characters, chat_template).save_pretrained(str(out))
    # transformers 5 writes its own class name; the 4.x name loads in both (NPU hosts may run 4.x).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
