"""`rlc run` before any actor starts: an earlier run is never deleted, and bad run dirs or model folders are clear.

Everything here stops in the pre-flight checks, so no Ray, vLLM or trainer starts (the CLI cases assert it
from the output). Model folders are written by hand (a JSON header and raw bytes), so torch is not needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from plan_fixtures import CPU_SPEC, cpu_plan, spec_from

from rlc.compiler.emit import emit_plan_dir
from rlc.runtime import preflight
from rlc.runtime.errors import RunError, RunUsageError
from rlc.runtime.launch import _preflight, actor_death, run_plan
from rlc.runtime.preflight import Weights, check_model_folder, checkpoint_bytes

RLC = [sys.executable, "-m", "rlc"]


def write_safetensors(path: Path, tensors: dict[str, list[int]], *, cut: int = 0) -> None:
    """A float32 safetensors file with the given shapes (zeros); `cut` drops that many bytes from the end."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 4
        for d in shape:
            size *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(offset)
    path.write_bytes(data[: len(data) - cut] if cut else data)


def model_folder(root: Path, *, tokenizer: bool = True, cut: int = 0) -> Path:
    folder = root / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    write_safetensors(folder / "model.safetensors", {"a": [4, 4], "b": [8]}, cut=cut)
    return folder


def plan_for(tmp_path: Path, model: Path | str, run_dir: Path):  # type: ignore[no-untyped-def]
    return cpu_plan(model_path=str(model), run_dir=str(run_dir), build_tiny=False)


def plan_dir_for(tmp_path: Path, model: Path | str, run_dir: Path) -> Path:
    out = tmp_path / "plan"
    emit_plan_dir(plan_for(tmp_path, model, run_dir), spec_from(CPU_SPEC), out, provenance={})
    return out


def earlier_run(run_dir: Path) -> None:
    """What a run leaves behind: metrics, a complete checkpoint, TensorBoard events, its plan."""
    ckpt = run_dir / "checkpoints" / "step-000050"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("50\n")
    (ckpt / "controller.json").write_text('{"step": 50, "version": 50, "data_cursor": 800}')
    (ckpt / "hf").mkdir()
    (ckpt / "hf" / "model.safetensors").write_bytes(os.urandom(4096))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n' * 50)
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out").write_bytes(os.urandom(256))
    (run_dir / "plan.json").write_text("{}")
    (run_dir / "rollouts.jsonl").write_text('{"step": 1}\n')  # what a replay of this run reads
    (run_dir / "trace.json").write_text("[\n")


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def rlc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RLC, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def assert_clear(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "rlc run: error:" in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert "local Ray" not in result.stdout  # stopped before any actor


# ----------------------------------------------------------------------------------------- no data loss


def test_rerun_without_resume_refuses_and_deletes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    earlier_run(run_dir)
    before = tree(run_dir)
    plan = plan_dir_for(tmp_path, model_folder(tmp_path), run_dir)
    result = rlc("run", str(plan), cwd=tmp_path)
    assert_clear(result, 2, "holds an earlier run", "--resume", "--overwrite", "nothing is deleted")
    assert tree(run_dir) == before
    assert not list(tmp_path.glob("run.old-*"))


def test_overwrite_moves_the_earlier_run_aside(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    earlier_run(run_dir)
    (run_dir / "notes.txt").write_text("mine")  # not the run's: stays
    before = tree(run_dir)
    # A missing model stops the run right after the move, before anything starts.
    plan = plan_for(tmp_path, tmp_path / "no-model", run_dir)
    with pytest.raises(RunError, match="model folder not found"):
        run_plan(plan, run_dir, overwrite=True)
    aside = tmp_path / "run.old-1"
    assert {k: v for k, v in before.items() if k != "notes.txt"} == tree(aside)
    assert tree(run_dir) == {"notes.txt": before["notes.txt"]}
    earlier_run(run_dir)
    with pytest.raises(RunError, match="model folder not found"):
        run_plan(plan, run_dir, overwrite=True)
    assert (tmp_path / "run.old-2" / "checkpoints" / "step-000050" / "COMPLETE").is_file()
    assert tree(aside) == {k: v for k, v in before.items() if k != "notes.txt"}  # the first one untouched


def test_overwrite_keeps_a_model_folder_inside_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    earlier_run(run_dir)
    model = model_folder(run_dir / "checkpoints" / "base")  # odd, but the plan reads it: it must stay
    logs: list[str] = []
    _preflight(plan_for(tmp_path, model, run_dir), run_dir, False, True, logs.append)
    assert (model / "model.safetensors").is_file()
    assert (tmp_path / "run.old-1" / "metrics.jsonl").is_file()
    assert any("moved the earlier run" in line for line in logs)


def test_a_run_dir_with_only_inputs_is_not_an_earlier_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    model = model_folder(run_dir)  # the quickstart builds its model under the run dir
    _preflight(plan_for(tmp_path, model, run_dir), run_dir, False, False, lambda _: None)
    assert not list(tmp_path.glob("run.old-*"))


def test_resume_and_overwrite_together_are_a_usage_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    plan = plan_dir_for(tmp_path, model_folder(tmp_path), run_dir)
    result = rlc("run", str(plan), "--resume", "--overwrite", cwd=tmp_path)
    assert result.returncode == 2
    assert "pass one of them" in result.stderr
    with pytest.raises(RunUsageError):
        run_plan(plan_for(tmp_path, tmp_path / "model", run_dir), run_dir, resume=True, overwrite=True)


# ----------------------------------------------------------------------------------------- run directory


def test_run_dir_under_a_file_is_clear(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    run_dir = tmp_path / "afile" / "run"
    plan = plan_dir_for(tmp_path, model_folder(tmp_path), run_dir)
    result = rlc("run", str(plan), cwd=tmp_path)
    assert_clear(result, 1, f"the run directory {run_dir} lies under {tmp_path / 'afile'}, which is a file")
    with pytest.raises(RunError, match="exists and is a file"):
        run_plan(plan_for(tmp_path, tmp_path / "model", tmp_path / "afile"), tmp_path / "afile")


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """A directory no write into succeeds: chmod for ordinary users; for root a read-only tmpfs mount."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("running as root without permission to mount a read-only file system")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_read_only_run_dir_is_clear(tmp_path: Path) -> None:
    model = model_folder(tmp_path)
    with read_only_dir(tmp_path / "ro") as ro:
        for run_dir, needle in [(ro, "is not writable"), (ro / "run", "cannot create the run directory")]:
            plan = plan_dir_for(tmp_path, model, run_dir)
            result = rlc("run", str(plan), cwd=tmp_path)
            assert_clear(result, 1, needle, str(run_dir))
            assert "read-only file system" in result.stderr or "permission denied" in result.stderr
            (tmp_path / "plan").rename(tmp_path / f"plan-{run_dir.name}")


def test_too_little_disk_for_a_checkpoint_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_folder(tmp_path)
    plan = plan_for(tmp_path, model, tmp_path / "run")
    need = checkpoint_bytes(check_model_folder(model, "model.path"), lora=False, disk_sync=False)
    usage = type("Usage", (), {"free": need - 1, "total": 10**9, "used": 0})
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _: usage)
    with pytest.raises(RunError, match=r"has 0\.00 GiB free but one checkpoint needs about"):
        _preflight(plan, tmp_path / "run", False, False, lambda _: None)
    logs: list[str] = []
    usage.free = 2 * need  # one checkpoint fits, not the keep + 1 that exist while a new one is written
    _preflight(plan, tmp_path / "run", False, False, logs.append)
    assert any("fewer than the 3 checkpoints" in line for line in logs), logs


def test_checkpoint_size_estimate() -> None:
    weights = Weights(bytes=16 * 2**30, params=8 * 2**30)  # 8 Gi params in bf16
    assert checkpoint_bytes(weights, lora=False, disk_sync=False) == 16 * 2**30 + 64 * 2**30
    assert checkpoint_bytes(weights, lora=False, disk_sync=True) == 96 * 2**30
    assert checkpoint_bytes(weights, lora=True, disk_sync=False) < 2**30


# ----------------------------------------------------------------------------------------- model folders


def test_model_without_tokenizer_is_clear_before_any_actor(tmp_path: Path) -> None:
    model = model_folder(tmp_path, tokenizer=False)
    result = rlc("run", str(plan_dir_for(tmp_path, model, tmp_path / "run")), cwd=tmp_path)
    assert_clear(result, 1, f"{model} has no tokenizer", "tokenizer.json")


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncated", "ends at byte 96 of a 88-byte data section (truncated copy?)"),
        ("random", "its header claims"),
        ("tiny", "only 3 byte(s) long"),
        ("garbage-header", "its header is not JSON"),
        ("bad-entry", "has a malformed header entry"),
        ("wrong-size", "has 64 bytes for shape [4, 5]"),
    ],
)
def test_corrupt_safetensors_is_clear_before_any_actor(tmp_path: Path, damage: str, needle: str) -> None:
    model = model_folder(tmp_path, cut=8 if damage == "truncated" else 0)
    weights = model / "model.safetensors"
    if damage == "random":
        weights.write_bytes(b"\xff" * 64 + os.urandom(1024))
    elif damage == "tiny":
        weights.write_bytes(b"abc")
    elif damage == "garbage-header":
        weights.write_bytes(struct.pack("<Q", 10) + b"not json!!" + bytes(16))
    elif damage in ("bad-entry", "wrong-size"):
        entry = {"dtype": "F32", "shape": [4, 5], "data_offsets": [0, 64]}
        header = json.dumps({"w": entry if damage == "wrong-size" else {"dtype": "F32"}}).encode()
        weights.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    with pytest.raises(RunError, match="is not a valid safetensors file") as caught:
        check_model_folder(model, "model.path")
    assert needle in str(caught.value)
    if damage == "truncated":  # and through the CLI, as the user sees it
        result = rlc("run", str(plan_dir_for(tmp_path, model, tmp_path / "run")), cwd=tmp_path)
        assert_clear(result, 1, f"{weights} is not a valid safetensors file", "copy the weights again")


def test_sharded_model_missing_a_shard_is_clear(tmp_path: Path) -> None:
    model = model_folder(tmp_path)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RunError, match=r"missing weight shard.*model-00002-of-00002\.safetensors"):
        check_model_folder(model, "model.path")


def test_broken_config_is_clear(tmp_path: Path) -> None:
    model = model_folder(tmp_path)
    (model / "config.json").write_text("{not json")
    with pytest.raises(RunError, match=r"config\.json is not valid JSON"):
        check_model_folder(model, "model.path")


def test_real_checkpoints_pass_the_header_check(tiny_model_dir: Path) -> None:
    """No false alarm on what transformers writes (the quickstart model): params counted from the headers."""
    import math

    from safetensors import safe_open

    weights = check_model_folder(tiny_model_dir, "model.path")
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as handle:
        expected = sum(math.prod(handle.get_slice(k).get_shape()) for k in handle.keys())  # noqa: SIM118
    assert weights.params == expected > 0


def test_a_dead_actor_is_named_with_the_error_that_killed_it() -> None:
    """A role that dies while starting (or later) is reported as its class and the remote error's last line, not
    Ray's whole traceback."""
    creation = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::rlc-rollout-0:"
        "RolloutEngine.__init__()\x1b[39m (pid=1, ip=10.0.0.1, actor_id=ab, repr=<x>)\n"
        '  File "engine.py", line 5, in __init__\n    raise ValueError(\n'
        "ValueError: current platform cpu does not support ray."
    )
    assert actor_death(Exception(creation)) == "RolloutEngine: ValueError: current platform cpu does not support ray."
    killed = "The actor is dead because its worker process has died.\n\tclass_name: TrainerWorker\n\tpid: 7"
    assert actor_death(Exception(killed)) == "TrainerWorker: The actor is dead because its worker process has died."


@pytest.mark.parametrize(
    ("content", "why"),
    [("garbage", "Expecting value"), ('{"step": "x", "version": 1, "data_cursor": 0}', "step must be a whole number")],
)
def test_resume_from_an_unreadable_checkpoint_is_clear(tmp_path: Path, content: str, why: str) -> None:
    run_dir = tmp_path / "run"
    earlier_run(run_dir)
    (run_dir / "checkpoints" / "step-000050" / "controller.json").write_text(content)
    with pytest.raises(RunError, match=f"--resume: .*controller.json is unreadable: {why}"):
        run_plan(plan_for(tmp_path, tmp_path / "no-model", run_dir), run_dir, resume=True)


def test_resume_without_a_checkpoint_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "none"
    with pytest.raises(RunError, match="no complete checkpoint"):
        run_plan(plan_for(tmp_path, tmp_path / "no-model", run_dir), run_dir, resume=True)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("recorded_plan", [b"[1]", b'{"spec_hash": 5}', bytes(range(256))])
def test_replay_of_a_directory_that_is_no_run_is_clear(tmp_path: Path, recorded_plan: bytes) -> None:
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / "plan.json").write_bytes(recorded_plan)
    plan = plan_for(tmp_path, tmp_path / "no-model", tmp_path / "run")
    with pytest.raises(RunError, match="is not a run directory"):
        run_plan(plan, tmp_path / "replayed", replay=recorded)


def test_replay_of_a_binary_rollout_log_is_clear(tmp_path: Path) -> None:
    from rlc.runtime.rollout_log import ReplaySchedule

    (tmp_path / "rollouts.jsonl").write_bytes(bytes(range(256)))
    with pytest.raises(RunError, match="cannot be read"):
        ReplaySchedule.load(tmp_path, 16)
