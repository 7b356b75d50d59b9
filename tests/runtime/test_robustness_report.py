"""`rlc report` never writes through a symbolic link: a planted `RUN/report` link or a link in place of
`index.html` is refused with a clear message, and the file it points to is left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_fixtures import cpu_plan
from typer.testing import CliRunner

from rlc.cli import app
from rlc.runtime.errors import RunError
from rlc.runtime.metrics import REQUIRED_KEYS
from rlc.runtime.report import write_report

pytest.importorskip("matplotlib")
runner = CliRunner()
FOREIGN = "<h1>someone else's site</h1>"


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{**{key: 0.5 for key in REQUIRED_KEYS}, "step": step, "version": step} for step in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "plan.json").write_text(cpu_plan().model_dump_json())
    return run


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text(FOREIGN)
    return site


def test_a_report_link_out_of_the_run_is_refused(tmp_path: Path) -> None:
    run, site = _run_dir(tmp_path), _site(tmp_path)
    (run / "report").symlink_to(site)
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 1, result.output
    assert f"rlc report: error: {run / 'report'} is a symbolic link (to {site})" in result.output
    assert "Traceback" not in result.output
    assert (site / "index.html").read_text() == FOREIGN and sorted(p.name for p in site.iterdir()) == ["index.html"]


def test_a_linked_index_html_is_refused_and_left_alone(tmp_path: Path) -> None:
    run, site = _run_dir(tmp_path), _site(tmp_path)
    (run / "report").mkdir()
    (run / "report" / "index.html").symlink_to(site / "index.html")
    with pytest.raises(RunError, match=r"index.html is a symbolic link .*remove the link"):
        write_report(run)
    assert (site / "index.html").read_text() == FOREIGN
    assert not list((run / "report").glob("*.png"))  # refused before anything was drawn


def test_an_output_inside_the_run_that_leads_out_is_refused(tmp_path: Path) -> None:
    run, site = _run_dir(tmp_path), _site(tmp_path)
    (run / "charts").symlink_to(site)
    result = runner.invoke(app, ["report", str(run), "-o", str(run / "charts" / "latest"), "--force"])
    assert result.exit_code == 1 and "leads out of the run directory" in result.output, result.output
    assert not (site / "latest").exists()


def test_the_report_replaces_its_own_files(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    first = write_report(run)
    again = write_report(run)
    assert again.html == first.html == run / "report" / "index.html"
    assert "<title>rlc run run</title>" in again.html.read_text()
    assert not list((run / "report").glob(".*.tmp"))  # no temporary file left behind
    assert (run / "report" / "index.html").stat().st_mode & 0o777 == 0o644


def test_rlc_run_s_report_warns_instead_of_failing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlc.runtime.run_outputs import write_run_report

    run, site = _run_dir(tmp_path), _site(tmp_path)
    (run / "report").symlink_to(site)
    write_run_report(run, print)
    assert "warning: the report could not be written" in capsys.readouterr().out
    assert (site / "index.html").read_text() == FOREIGN
