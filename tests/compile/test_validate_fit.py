"""`rlc validate` runs the fit check: a spec `compile` would refuse as out of memory fails validation, with the
numbers, at the spec's own line, in text, JSON and GitHub formats; `--no-plan` skips the planner."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from rlc.cli import app

runner = CliRunner()

#: Qwen2.5-72B full fine-tuning on two A2 nodes with offload pinned off: about 90 GiB per device.
OOM = """name: oom
target: a2
cluster: {nodes: 2}
model: {name: qwen2.5-72b, path: /m}
data: {train: arithmetic}
placement:
  train:
    offload: {params: false, optimizer: false}
"""
OOM_LINE = 8  # the `offload:` pin is what rules it out


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_out_of_memory_spec_fails_validation(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(_write(tmp_path, OOM))])
    assert result.exit_code == 1, result.output
    line = next(x for x in result.output.splitlines() if "RLC301" in x and "train needs" in x)
    assert line.startswith(f"{tmp_path / 'spec.yaml'}:{OOM_LINE}: error[RLC301] placement.train.offload:")
    assert "GiB per device" in line and "optimizer" in line and "61.0 GiB usable" in line
    assert "the pinned train offload" in result.output and "cluster.nodes >= " in result.output


def test_out_of_memory_json_and_github(tmp_path: Path) -> None:
    path = _write(tmp_path, OOM)
    result = runner.invoke(app, ["validate", str(path), "--format", "json"])
    assert result.exit_code == 1
    payload = json.loads(result.output)
    (d,) = [d for d in payload["files"][0]["diagnostics"] if d["code"] == "RLC301"]
    assert d["line"] == OOM_LINE and d["path"] == "placement.train.offload" and "GiB" in d["message"]
    assert not payload["ok"]
    result = runner.invoke(app, ["validate", str(path), "--format", "github"])
    assert result.exit_code == 1
    assert f"::error file={path},line={OOM_LINE},title=RLC301 placement.train.offload::" in result.output.replace(
        "%3A", ":"
    ).replace("%2C", ",")


def test_no_plan_skips_the_fit_check(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(_write(tmp_path, OOM)), "--no-plan"])
    assert result.exit_code == 0, result.output


def test_cannot_place_is_reported(tmp_path: Path) -> None:
    """A teacher too big for what is left: RLC301 names the role, not a bare 'no layout fits'."""
    text = """name: t
target: a2
model: {name: qwen3-1.7b, path: /m}
mode: disaggregated
data: {train: arithmetic, domain_key: d}
distill:
  teachers:
    - {name: big, model: {name: qwen3-235b-a22b, path: /t}, domain: math}
"""
    result = runner.invoke(app, ["validate", str(_write(tmp_path, text))])
    assert result.exit_code == 1
    assert "error[RLC301] placement.teachers.big: teacher-big" in result.output


def test_a_minibatch_smaller_than_the_data_parallelism_is_flagged(tmp_path: Path) -> None:
    """RLC306: 8 samples in 4 minibatches over a pinned data parallelism of 8 leave 6 ranks idle in every optimizer
    step; 32 samples in 4 (8 each) do not."""
    spec = """name: t
target: a2
model: {name: qwen3-8b, path: /m}
data: {train: arithmetic}
algorithm: {batch_prompts: 2, group_size: 4, minibatches: 4}
cluster: {nodes: 2}
placement: {train: {devices: 8, tp: 1, cp: 1}}
"""
    result = runner.invoke(app, ["validate", str(_write(tmp_path, spec))])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "RLC306" in x)
    assert ":5: warning[RLC306] algorithm.minibatches:" in line and "6 of them train nothing" in line
    result = runner.invoke(
        app, ["validate", str(_write(tmp_path, spec.replace("batch_prompts: 2", "batch_prompts: 8")))]
    )
    assert result.exit_code == 0 and "RLC306" not in result.output, result.output
