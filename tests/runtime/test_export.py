"""`rlc export`: the model lands in a new folder, and no folder of the user's is ever deleted or half-written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlc.runtime.checkpoint import ControllerState
from rlc.runtime.export import EXPORT_MARKER, ExportError, export_merged

RLC = [sys.executable, "-m", "rlc"]


def _weights(value: float = 0.5) -> bytes:
    """A small safetensors file: one float tensor (holding `value` once) and one integer buffer."""
    import torch
    from safetensors.torch import save

    weight = torch.zeros(3, 4, dtype=torch.bfloat16)
    weight[1, 2] = value
    return save({"model.embed_tokens.weight": weight, "model.steps": torch.arange(3)})


WEIGHTS = _weights()


def _run_with_checkpoint(root: Path, step: int = 2, weights: bytes = WEIGHTS) -> Path:
    """A run directory whose newest complete checkpoint is a full fine-tune (an hf/ folder)."""
    run = root / "run"
    ckpt = run / "checkpoints" / f"step-{step:06d}"
    (ckpt / "hf").mkdir(parents=True)
    (ckpt / "hf" / "config.json").write_text('{"model_type": "qwen3"}\n')
    (ckpt / "hf" / "model.safetensors").write_bytes(weights)
    (ckpt / "controller.json").write_text(ControllerState(step=step, version=step, data_cursor=0).to_json())
    (ckpt / "COMPLETE").write_text(f"{step}\n")
    return run


def test_export_writes_the_checkpoint_and_a_marker(tmp_path: Path) -> None:
    run = _run_with_checkpoint(tmp_path)
    out = export_merged(run)
    assert out == (run / "export" / "step-000002-merged").resolve()
    assert (out / "model.safetensors").read_bytes() == WEIGHTS
    assert json.loads((out / EXPORT_MARKER).read_text())["step"] == 2
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no staging folder left behind


def test_an_existing_folder_of_the_users_is_never_replaced(tmp_path: Path) -> None:
    run = _run_with_checkpoint(tmp_path)
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_merged(run, mine)
    with pytest.raises(ExportError, match="no export wrote"):
        export_merged(run, mine, force=True)
    assert (mine / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "run"]  # nothing staged beside it either


def test_the_current_directory_is_refused_not_emptied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_with_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    for force in (False, True):
        with pytest.raises(ExportError, match="holds the run's checkpoints"):
            export_merged(run, ".", force=force)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "mine.txt").write_text("x")
    with pytest.raises(ExportError, match="no export wrote"):
        export_merged(run, ".", force=True)
    assert (tmp_path / "elsewhere" / "mine.txt").is_file()
    assert (run / "checkpoints" / "step-000002" / "hf" / "model.safetensors").is_file()


def test_force_replaces_only_an_earlier_export(tmp_path: Path) -> None:
    run = _run_with_checkpoint(tmp_path)
    out = export_merged(run, tmp_path / "merged")
    (out / "model.safetensors").write_bytes(b"old")
    with pytest.raises(ExportError, match="--force"):
        export_merged(run, out)
    assert export_merged(run, out, force=True) == out
    assert (out / "model.safetensors").read_bytes() == WEIGHTS


def test_an_empty_folder_and_bad_outputs(tmp_path: Path) -> None:
    run = _run_with_checkpoint(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_merged(run, empty) / "model.safetensors").is_file()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_merged(run, a_file)
    with pytest.raises(ExportError, match="inside the run's checkpoints"):
        export_merged(run, run / "checkpoints" / "merged")


def test_a_lora_run_without_its_plan_or_with_a_broken_one(tmp_path: Path) -> None:
    run = _run_with_checkpoint(tmp_path)
    ckpt = run / "checkpoints" / "step-000002"
    (ckpt / "hf" / "config.json").rename(ckpt / "adapter_config.json")
    (ckpt / "hf").rename(ckpt / "adapter")
    with pytest.raises(ExportError, match=r"plan\.json is missing"):
        export_merged(run, tmp_path / "out")
    (run / "plan.json").write_text("{")
    with pytest.raises(ExportError, match="not a readable plan"):
        export_merged(run, tmp_path / "out")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_cli_refusal_is_a_message_and_exit_1(tmp_path: Path) -> None:
    run = _run_with_checkpoint(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a").write_text("x")
    result = subprocess.run(
        [*RLC, "export", str(run), "--merged", "-o", str(tmp_path / "mine")], capture_output=True, text=True
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "exists and is not empty" in result.stderr


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path: Path, value: float) -> None:
    """A checkpoint whose weights hold NaN or inf is not exported: the error names the tensor and the checkpoint,
    and the way to the earlier one; nothing is left in the output's place."""
    run = _run_with_checkpoint(tmp_path, step=2)
    _run_with_checkpoint(tmp_path, step=4, weights=_weights(value))
    kind = "1 NaN, 0 inf" if value != value else "0 NaN, 1 inf"
    with pytest.raises(ExportError) as refused:
        export_merged(run, tmp_path / "out")
    assert str(refused.value) == (
        f"step-000004 holds non-finite weights: model.embed_tokens.weight (model.safetensors: {kind}); nothing was "
        "exported (to export the earlier step-000002, move step-000004 out of the checkpoints folder)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no output, no staging folder beside it


def test_the_cli_exports_without_merged_and_accepts_it(tmp_path: Path) -> None:
    """`--merged` names the only export there is: optional, and still accepted."""
    run = _run_with_checkpoint(tmp_path)
    for args, out in (([], tmp_path / "plain"), (["--merged"], tmp_path / "merged")):
        result = subprocess.run([*RLC, "export", str(run), *args, "-o", str(out)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert (out / "model.safetensors").read_bytes() == WEIGHTS
    bad = tmp_path / "bad"
    _run_with_checkpoint(bad, weights=_weights(float("nan")))
    result = subprocess.run([*RLC, "export", str(bad / "run")], capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("rlc export: error: step-000002 holds non-finite weights: model.embed_tokens")
