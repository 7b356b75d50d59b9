"""Checks of a run's inputs that must pass before any actor starts: model folders and free disk.

A model folder without a tokenizer sent transformers to the Hub (a long hang offline), and a truncated or
corrupt `*.safetensors` file failed minutes later inside a trainer actor with a raw traceback. Both are
cheap to see up front: the tokenizer is a file listing, and a safetensors header is eight bytes of length
plus a JSON table of tensors whose offsets must fit the file. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from rlc.runtime.errors import RunError

#: Any one of these makes a folder's tokenizer loadable by transformers and vLLM.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
#: Bytes per element of the dtypes safetensors files hold.
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 0.5,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: A header larger than this is not a real checkpoint's (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: AdamW keeps two fp32 moments per trainable parameter.
OPTIMIZER_BYTES_PER_PARAM = 8
GIB = 2**30


@dataclass(frozen=True)
class Weights:
    """What the headers of a folder's safetensors files say: total bytes on disk and parameter count."""

    bytes: int
    params: int


def _header(path: Path) -> tuple[dict, int, int]:
    """One safetensors file's header table, its length and the file's size; RunError if it does not read."""
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise RunError(f"{bad}: only {size} byte(s) long (truncated copy?); copy the weights again")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise RunError(f"{bad}: its header claims {length} bytes but the file has {size} (corrupt or truncated)")
        try:
            header = json.loads(handle.read(length))
        except (ValueError, UnicodeDecodeError):
            raise RunError(f"{bad}: its header is not JSON (corrupt file?); copy the weights again") from None
    if not isinstance(header, dict):
        raise RunError(f"{bad}: its header is not a table of tensors")
    return header, length, size


def safetensors_keys(folder: Path) -> list[str]:
    """The tensor names of every ``*.safetensors`` file in `folder`, from their headers (nothing loaded)."""
    return sorted(k for path in sorted(folder.glob("*.safetensors")) for k in _header(path)[0] if k != "__metadata__")


def _safetensors_params(path: Path) -> int:
    """Parameter count of one safetensors file after checking its header against the file; RunError if corrupt."""
    header, length, size = _header(path)
    bad = f"{path} is not a valid safetensors file"
    data = size - 8 - length
    params = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in entry["data_offsets"])
            shape = [int(d) for d in entry["shape"]]
            width = DTYPE_BYTES.get(str(entry["dtype"]))  # a dtype newer than this table: sizes unchecked
        except (KeyError, TypeError, ValueError):
            raise RunError(f"{bad}: tensor {name!r} has a malformed header entry") from None
        count = math.prod(shape)
        if not 0 <= begin <= end <= data:
            raise RunError(
                f"{bad}: tensor {name!r} ends at byte {end} of a {data}-byte data section (truncated copy?); "
                "copy the weights again"
            )
        if width is not None and end - begin != math.ceil(count * width):
            raise RunError(f"{bad}: tensor {name!r} has {end - begin} bytes for shape {shape} of {entry['dtype']}")
        params += count
    return params


def check_weights(folder: Path) -> Weights:
    """Every `*.safetensors` in `folder` (and every shard its index names) exists and has a sound header."""
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            raise RunError(f"{index} is not a valid safetensors index (no weight_map)") from None
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise RunError(f"{folder} is missing weight shard(s) its index lists: {shown}; copy them too")
    if not files:
        raise RunError(f"{folder} has no *.safetensors weights")
    total = sum(p.stat().st_size for p in files)
    return Weights(bytes=total, params=sum(_safetensors_params(p) for p in files))


def check_model_folder(folder: Path, what: str) -> Weights:
    """A complete Hugging Face model folder: config.json, a tokenizer, sound safetensors weights.

    `what` names the folder in messages ("model.path", "teacher math: distill.teachers[].model.path").
    """
    if not folder.is_dir():
        raise RunError(f"model folder not found: {folder} ({what} in the spec; it must exist on every node)")
    if not (folder / "config.json").is_file():
        raise RunError(f"{folder} is not a Hugging Face model folder: config.json is missing ({what})")
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        raise RunError(f"{folder / 'config.json'} is not valid JSON ({what}); copy the model again") from None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise RunError(
            f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}; {what}): copy the tokenizer "
            "files of the model's release into it"
        )
    return check_weights(folder)


def checkpoint_bytes(weights: Weights, *, lora: bool, disk_sync: bool) -> int:
    """Disk one checkpoint (and the weight files a disk sync writes next to it) takes, roughly.

    Full fine-tuning: the weights once more plus AdamW's two fp32 moments per parameter. LoRA: the adapter
    and its optimizer state, a few percent of the base at most (2% of the base weights is assumed).
    """
    need = int(0.02 * weights.bytes) if lora else weights.bytes + OPTIMIZER_BYTES_PER_PARAM * weights.params
    if disk_sync:
        need += weights.bytes
    return need


def check_free_disk(run_dir: Path, need: int, keep: int, log) -> None:  # type: ignore[no-untyped-def]
    """Refuse a run whose disk cannot hold one checkpoint; warn when it cannot hold the `keep` it keeps."""
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise RunError(
            f"the disk under {run_dir} has {free / GIB:.2f} GiB free but one checkpoint needs about "
            f"{need / GIB:.2f} GiB: free space there or choose another --run-dir"
        )
    if free < need * (keep + 1):
        log(
            f"warning: {free / GIB:.2f} GiB free under {run_dir} holds fewer than the {keep + 1} checkpoints of "
            f"~{need / GIB:.2f} GiB that exist while a new one is written (output.keep_checkpoints={keep})"
        )
