"""`rlc report`: a self-contained HTML page and PNGs from metrics.jsonl, with the plan's predictions next to them."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import pytest
from plan_fixtures import cpu_plan
from typer.testing import CliRunner

from rlc.cli import app
from rlc.runtime.metrics import REQUIRED_KEYS

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")

runner = CliRunner()
CHART_FILES = {
    "reward.png",
    "response_len.png",
    "importance_weight.png",
    "staleness.png",
    "entropy.png",
    "time_split.png",
    "throughput.png",
}


def _run_dir(tmp_path: Path, steps: int = 30) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = []
    for step in range(1, steps + 1):
        row = {key: 0.5 for key in REQUIRED_KEYS}
        row.update(
            {
                "step": step,
                "version": step,
                "reward/mean": 0.3 + 0.4 * step / steps,
                "entropy": 1.0 / step,
                "time/step_s": 0.6 + 0.01 * math.sin(step),
                "throughput/train_tokens_per_s": 1800.0,
                "reward/failed": 1.0 if step == 3 else 0.0,
            }
        )
        rows.append(row)
    text = "\n".join(json.dumps(r) for r in rows) + "\n{truncated line"
    (run / "metrics.jsonl").write_text(text)
    (run / "plan.json").write_text(cpu_plan().model_dump_json())
    return run


def test_report_writes_a_self_contained_page_and_real_charts(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    out = run / "report"
    assert {p.name for p in out.glob("*.png")} == CHART_FILES
    for png in out.glob("*.png"):
        with Image.open(png) as image:
            assert image.size == (640, 320)
            colours = image.convert("RGB").getcolors(maxcolors=100_000)
            assert colours is not None and len(colours) > 50, f"{png.name} looks blank"
    page = (out / "index.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == len(CHART_FILES)
    assert all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    assert not re.search(r'(src|href)="(?!data:)', page), "the page must not load anything from elsewhere"
    # Predictions of cpu_plan(): step 0.5 s, 2000 trained tok/s; measured medians 0.6 s and 1800 tok/s.
    assert "<td>step time (s)</td><td>0.5</td>" in page and "1.2" in page
    assert "<td>trained tokens / s</td><td>2,000</td><td>1,800</td><td>0.90×</td>" in page
    assert "1 sample(s) scored 0 because the reward failed" in page
    assert "first 0.313, last 0.700" in page


def test_report_without_metrics_or_plot_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    missing = runner.invoke(app, ["report", str(tmp_path / "empty")])
    assert missing.exit_code == 2 and "has no metrics.jsonl" in missing.output
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    empty = runner.invoke(app, ["report", str(tmp_path / "empty")])
    assert empty.exit_code == 1 and "holds no steps yet" in empty.output
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = runner.invoke(app, ["report", str(_run_dir(tmp_path))])
    assert result.exit_code == 2 and "install `rlc[report]`" in result.output
