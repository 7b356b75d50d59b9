"""The command line as users and CI meet it: exit codes, formats, and a light, fast start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from paths import REPO
from typer.testing import CliRunner

from rlc.cli import app
from rlc.schemas.schema_file import committed_schema_text, schema_text

runner = CliRunner()

BAD = "name: bad\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: /d.jsonl}\nalgoritm: {}\n"


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_validate_examples_exit_zero() -> None:
    result = runner.invoke(app, ["validate", *map(str, sorted((REPO / "examples").glob("*.yaml")))])
    assert result.exit_code == 0, result.output
    assert "ok (0 error(s)" in result.output


def test_validate_findings_exit_one_text(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(write(tmp_path, BAD))])
    assert result.exit_code == 1
    assert "spec.yaml:5: error[RLC101] algoritm: unknown key `algoritm`" in result.output
    assert "did you mean `algorithm`?" in result.output
    assert "Traceback" not in result.output


def test_validate_json_contract(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", "--format", "json", str(write(tmp_path, BAD))])
    assert result.exit_code == 1
    payload = json.loads(result.output)
    assert payload["version"] == 1 and payload["ok"] is False
    diagnostic = payload["files"][0]["diagnostics"][0]
    assert set(diagnostic) == {"code", "severity", "path", "line", "message", "hint", "file"}
    assert diagnostic["code"] == "RLC101" and diagnostic["line"] == 5


def test_validate_github_annotations(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", "--format", "github", str(write(tmp_path, BAD))])
    assert result.exit_code == 1
    assert result.output.startswith("::error file=")
    assert ",line=5," in result.output


def test_validate_many_files_one_bad(tmp_path: Path) -> None:
    good = REPO / "examples" / "quickstart.yaml"
    result = runner.invoke(app, ["validate", str(good), str(write(tmp_path, BAD))])
    assert result.exit_code == 1
    assert "quickstart.yaml: ok" in result.output


def test_validate_usage_errors(tmp_path: Path) -> None:
    assert runner.invoke(app, ["validate"]).exit_code == 2
    result = runner.invoke(app, ["validate", "--target", "a33", str(write(tmp_path, BAD))])
    assert result.exit_code == 2
    assert "did you mean a3" in result.output


def test_validate_set_override(tmp_path: Path) -> None:
    good = REPO / "examples" / "a2-qwen3-8b-grpo.yaml"
    result = runner.invoke(app, ["validate", str(good), "--set", "algorithm.clip=3"])
    assert result.exit_code == 1
    assert "algorithm.clip" in result.output


def test_validate_missing_file_is_a_finding(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 1
    assert "cannot read spec" in result.output


def test_schema_matches_committed_copy() -> None:
    assert schema_text() == committed_schema_text(), "run `rlc schema -o schemas/spec.schema.json`"


def test_schema_command_prints_json() -> None:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert "algorithm" in schema["properties"]


def test_init_writes_valid_starters(tmp_path: Path) -> None:
    for target in ("cpu", "a2", "a3"):
        out = tmp_path / f"{target}.yaml"
        result = runner.invoke(app, ["init", f"run-{target}", "--target", target, "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert out.read_text().startswith("# yaml-language-server: $schema=./rlc.schema.json")
        assert (tmp_path / "rlc.schema.json").exists()
        check = runner.invoke(app, ["validate", str(out)])
        assert check.exit_code == 0, check.output
    again = runner.invoke(app, ["init", "run-cpu", "-o", str(tmp_path / "cpu.yaml")])
    assert again.exit_code == 2
    assert runner.invoke(app, ["init", "Bad Name"]).exit_code == 2


def test_models_and_targets_list() -> None:
    models = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert models.exit_code == 0 and "qwen3-235b-a22b" in models.output
    targets = runner.invoke(app, ["targets"], env={"COLUMNS": "200"})
    assert targets.exit_code == 0 and "a3" in targets.output


def test_targets_show_which_profile_compile_would_use(tmp_path: Path) -> None:
    """A calibrated profile shadows the shipped one; `rlc targets` says which is in force, and refuses a
    profile directory that does not exist."""
    from rlc.schemas.profiles import write_profile
    from rlc.schemas.registry import load_target

    cpu = load_target("cpu").model_copy(update={"calibration": {"runs": "r1"}})
    write_profile(cpu, tmp_path / "cal")
    listed = runner.invoke(app, ["targets", "--targets", str(tmp_path / "cal")], env={"COLUMNS": "300"})
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[0]: line.split()[-1] for line in listed.output.splitlines()[1:] if line.strip()}
    assert rows["cpu"] == str(tmp_path / "cal") and rows["a3"] == "shipped"
    missing = runner.invoke(app, ["targets"], env={"RLC_TARGETS": str(tmp_path / "nope")})
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_examples_parse_as_yaml() -> None:
    for path in (REPO / "examples").glob("*.yaml"):
        assert isinstance(yaml.safe_load(path.read_text()), dict)


def test_compile_path_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from rlc.cli import app\n"
        "from rlc.compiler.validate import check_file\n"
        f"check_file({str(REPO / 'examples' / 'quickstart.yaml')!r})\n"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_help_runs_as_a_subprocess() -> None:
    out = subprocess.run([sys.executable, "-m", "rlc", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "validate" in out.stdout


def test_compile_writes_plan_dir_and_is_deterministic(tmp_path: Path) -> None:
    spec = str(REPO / "examples" / "a2-qwen3-8b-grpo.yaml")
    first = runner.invoke(app, ["compile", spec, "-o", str(tmp_path / "p1")])
    second = runner.invoke(app, ["compile", spec, "-o", str(tmp_path / "p2")])
    assert first.exit_code == 0 and second.exit_code == 0, first.output
    names = sorted(p.relative_to(tmp_path / "p1") for p in (tmp_path / "p1").rglob("*") if p.is_file())
    assert {"plan.json", "manifest.json", "launch.sh", "rayjob.yaml", "SUMMARY.md", "spec.resolved.yaml"} <= {
        str(n) for n in names
    }
    for name in names:
        assert (tmp_path / "p1" / name).read_bytes() == (tmp_path / "p2" / name).read_bytes(), name


def test_compile_infeasible_exits_one_with_memory_breakdown(tmp_path: Path) -> None:
    spec = write(
        tmp_path,
        "name: huge\ntarget: a2\ncluster: {nodes: 1}\nmodel: {name: qwen3-235b-a22b, path: /m}\n"
        "data: {train: /d.jsonl}\n",
    )
    result = runner.invoke(app, ["compile", str(spec), "-o", str(tmp_path / "plan")])
    assert result.exit_code == 1
    assert "RLC301" in result.output and "GiB" in result.output
    assert not (tmp_path / "plan").exists()


def test_compile_refuses_to_overwrite_a_non_plan_dir(tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = runner.invoke(app, ["compile", str(REPO / "examples" / "quickstart.yaml"), "-o", str(out)])
    assert result.exit_code == 2
    assert (out / "notes.txt").read_text() == "keep me"


def test_explain_spec_and_plan_dir(tmp_path: Path) -> None:
    spec = str(REPO / "examples" / "a2-qwen3-8b-grpo.yaml")
    text = runner.invoke(app, ["explain", spec], env={"COLUMNS": "200"})
    assert text.exit_code == 0 and "actor" in text.output and "runners-up" in text.output
    runner.invoke(app, ["compile", spec, "-o", str(tmp_path / "p")])
    as_json = runner.invoke(app, ["explain", str(tmp_path / "p"), "--format", "json"])
    assert as_json.exit_code == 0
    assert json.loads(as_json.output)["roles"]


def test_diff_exit_codes(tmp_path: Path) -> None:
    spec = REPO / "examples" / "a2-qwen3-8b-grpo.yaml"
    same = runner.invoke(app, ["diff", str(spec), str(spec)])
    assert same.exit_code == 0 and "no differences" in same.output
    bigger = write(tmp_path, spec.read_text().replace("nodes: 2", "nodes: 4"), "bigger.yaml")
    changed = runner.invoke(app, ["diff", str(spec), str(bigger)])
    assert changed.exit_code == 1
    assert "cluster.nodes: 2 → 4" in changed.output
    assert "roles.actor.devices" in changed.output
    missing = runner.invoke(app, ["diff", str(spec), str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2


def test_run_usage_errors(tmp_path: Path) -> None:
    assert runner.invoke(app, ["run", str(tmp_path / "nothing")]).exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["run", str(empty)])
    assert result.exit_code == 1


def test_the_plan_directory_is_never_also_the_run_directory(tmp_path: Path) -> None:
    """A run there would mix its files into the plan, and `--overwrite` would move plan.json aside."""
    spec = REPO / "examples" / "quickstart.yaml"
    qs = tmp_path / "qs"
    same = runner.invoke(app, ["compile", str(spec), "-o", str(qs), "--set", f"output.dir={qs}"])
    assert same.exit_code == 2 and "is the plan directory" in same.output
    assert not qs.exists()
    plan = tmp_path / "plan"
    assert runner.invoke(app, ["compile", str(spec), "-o", str(plan)]).exit_code == 0
    ran = runner.invoke(app, ["run", str(plan), "--run-dir", str(plan)])
    assert ran.exit_code == 2 and "is the plan directory" in ran.output
    assert (plan / "plan.json").is_file() and not list(tmp_path.glob("plan.old-*"))


def test_schema_output_refreshes_a_schema_but_never_replaces_another_file(tmp_path: Path) -> None:
    out = tmp_path / "spec.schema.json"
    assert runner.invoke(app, ["schema", "-o", str(out)]).exit_code == 0
    assert runner.invoke(app, ["schema", "-o", str(out)]).exit_code == 0  # regenerating is the usual case
    mine = tmp_path / "myspec.yaml"
    mine.write_text("name: mine\n")
    refused = runner.invoke(app, ["schema", "-o", str(mine)])
    assert refused.exit_code == 2 and "is not a spec schema" in refused.output
    assert mine.read_text() == "name: mine\n"
    assert runner.invoke(app, ["schema", "-o", str(mine), "--force"]).exit_code == 0


def test_explain_says_what_it_was_given_wrongly(tmp_path: Path) -> None:
    spec = REPO / "examples" / "quickstart.yaml"
    plan = tmp_path / "plan"
    assert runner.invoke(app, ["compile", str(spec), "-o", str(plan)]).exit_code == 0
    as_file = runner.invoke(app, ["explain", str(plan / "plan.json")])
    assert as_file.exit_code == 2 and f"pass its folder ({plan})" in as_file.output
    pinned = runner.invoke(app, ["explain", str(plan), "-t", "a3"])
    assert pinned.exit_code == 2 and "is already compiled" in pinned.output
    other = REPO / "examples" / "a3-qwen3-32b-colocated.yaml"
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text((plan / "plan.json").read_text())
    unrelated = runner.invoke(app, ["explain", str(other), "--measured", str(run)])
    assert unrelated.exit_code == 2 and "its times say nothing about this plan" in unrelated.output
    (plan / "plan.json").write_text("{garbage")
    broken = runner.invoke(app, ["explain", str(plan)])
    assert broken.exit_code == 2 and "errors.pydantic.dev" not in broken.output


def test_run_format_json_without_dry_run_is_refused(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    assert runner.invoke(app, ["compile", str(REPO / "examples" / "quickstart.yaml"), "-o", str(plan)]).exit_code == 0
    result = runner.invoke(app, ["run", str(plan), "--format", "json"])
    assert result.exit_code == 2 and "pass --dry-run with it" in result.output


def test_diff_of_two_plans_refuses_a_target_it_could_not_apply(tmp_path: Path) -> None:
    plan = tmp_path / "plan"
    assert runner.invoke(app, ["compile", str(REPO / "examples" / "quickstart.yaml"), "-o", str(plan)]).exit_code == 0
    result = runner.invoke(app, ["diff", str(plan), str(plan), "-t", "a3"])
    assert result.exit_code == 2 and "both sides are compiled plans" in result.output
    (plan / "plan.json").write_text('{"name": 5}')
    broken = runner.invoke(app, ["diff", str(plan), str(plan)])
    assert broken.exit_code == 2 and "plan.json cannot be read" in broken.output
    assert "validation error" not in broken.output  # the field and what is wrong, not pydantic's header
