"""The plan directory writer: determinism, golden files, atomic replacement, the resolved spec and provenance.

Golden plans live in tests/golden/<name>/ (spec.yaml is the input, plan/ the expected directory). After an
intended change to the planner or the emitter, regenerate them with `RLC_UPDATE_GOLDEN=1 pytest
tests/golden/test_emit.py` and review the diff.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from paths import GOLDEN
from plan_fixtures import A2_SPEC, A3_SPEC, CPU_SPEC, a2_plan, a3_plan, cpu_plan, spec_from

from rlc.compiler import emit as emit_module
from rlc.compiler.emit import PlanDirError, PlanEmitError, emit_plan_dir, stable
from rlc.compiler.manifest import load_plan, verify_plan_dir
from rlc.compiler.provenance import compute_provenance
from rlc.schemas.spec import Spec

#: name → (--target, --set overrides) the golden spec is compiled with.
GOLDEN_CASES = {
    "a2-disaggregated": ("a2", ["algorithm.lr=2.0e-6"]),
    "a3-colocated-mopd-lora-mtp": (None, []),
}


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _compile(name: str, out: Path) -> None:
    from rlc.compiler.planner import build_plan
    from rlc.compiler.validate import check_file

    target, overrides = GOLDEN_CASES[name]
    spec_file = GOLDEN / name / "spec.yaml"
    checked = check_file(spec_file, target=target, overrides=overrides)
    assert checked.problem is not None, checked.report.sorted()
    plan, found = build_plan(checked.problem, checked.lines, spec_file.name)
    assert plan is not None, found
    spec = checked.problem.spec
    emit_plan_dir(plan, spec, out, provenance=compute_provenance(spec, overrides, target_given=target is not None))


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_plan_dirs(name: str, tmp_path: Path) -> None:
    pytest.importorskip("rlc.compiler.planner")
    expected_dir = GOLDEN / name / "plan"
    _compile(name, tmp_path / "plan")
    actual = _tree(tmp_path / "plan")
    if os.environ.get("RLC_UPDATE_GOLDEN") == "1":
        shutil.rmtree(expected_dir, ignore_errors=True)
        shutil.copytree(tmp_path / "plan", expected_dir)
        return
    assert expected_dir.is_dir(), f"no golden for {name}: run RLC_UPDATE_GOLDEN=1 pytest {__file__}"
    expected = _tree(expected_dir)
    problems: list[str] = []
    for file in sorted(expected.keys() | actual.keys()):
        if file not in actual:
            problems.append(f"{file}: expected but not emitted")
        elif file not in expected:
            problems.append(f"{file}: emitted but not in the golden")
        elif actual[file] != expected[file]:
            diff = difflib.unified_diff(
                expected[file].decode().splitlines(),
                actual[file].decode().splitlines(),
                f"golden/{name}/plan/{file}",
                f"emitted/{file}",
                lineterm="",
                n=2,
            )
            problems.append("\n".join(list(diff)[:60]))
    assert not problems, "plan differs from the golden (RLC_UPDATE_GOLDEN=1 regenerates):\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("make", "text"), [(a2_plan, A2_SPEC), (a3_plan, A3_SPEC), (cpu_plan, CPU_SPEC)], ids=["a2", "a3", "cpu"]
)
def test_emitting_twice_is_byte_identical(tmp_path: Path, make, text: str) -> None:
    spec = spec_from(text)
    provenance = compute_provenance(spec)
    first = emit_plan_dir(make(), spec, tmp_path / "one", provenance=provenance)
    emit_plan_dir(make(), spec, tmp_path / "two", provenance=provenance)
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")
    before = _tree(tmp_path / "one")
    emit_plan_dir(make(), spec, tmp_path / "one", provenance=provenance)  # replacing an older plan
    assert _tree(tmp_path / "one") == before
    assert first[-1].name == "manifest.json"
    assert sorted(p.relative_to(tmp_path / "one").as_posix() for p in first) == sorted(before)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "temporary directory left behind"


def test_plan_dir_contents(tmp_path: Path) -> None:
    plan = a3_plan()
    emit_plan_dir(plan, spec_from(A3_SPEC), tmp_path / "plan", provenance={})
    files = set(_tree(tmp_path / "plan"))
    assert files == {
        "plan.json",
        "spec.resolved.yaml",
        "roles/actor.json",
        "roles/rollout.json",
        "roles/teacher-math.json",
        "roles/teacher-code.json",
        "launch.sh",
        "rayjob.yaml",
        "SUMMARY.md",
        "manifest.json",
    }
    text = (tmp_path / "plan" / "plan.json").read_text()
    assert text.endswith("}\n") and json.loads(text) == json.loads(json.dumps(json.loads(text), sort_keys=True))
    assert load_plan(tmp_path / "plan") == plan
    assert verify_plan_dir(tmp_path / "plan") == []
    rollout = json.loads((tmp_path / "plan" / "roles" / "rollout.json").read_text())
    assert rollout == plan.role("rollout").engine
    summary = (tmp_path / "plan" / "SUMMARY.md").read_text()
    for needle in ("| teacher-math | teacher | vllm-ascend | 8 | n1:0-7 |", "| kv_cache | 18.00 |", "phase switch"):
        assert needle in summary


def test_floats_are_stable() -> None:
    assert stable({"a": [0.1 + 0.2, 1e-6, 3.0]}) == {"a": [0.3, 1e-6, 3.0]}


def test_refuses_to_overwrite_a_directory_that_is_not_a_plan(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(PlanDirError, match="not an rlc plan directory"):
        emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), out, provenance={})
    assert (out / "notes.txt").read_text() == "mine"
    file_target = tmp_path / "file"
    file_target.write_text("x")
    with pytest.raises(PlanDirError, match="not a directory"):
        emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), file_target, provenance={})


def test_refuses_an_older_plan_holding_foreign_files(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), out, provenance={})
    (out / "my-notes.md").write_text("keep me")
    with pytest.raises(PlanDirError, match=r"my-notes\.md"):
        emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), out, provenance={})
    assert (out / "my-notes.md").exists()


def test_empty_directory_is_fine(tmp_path: Path) -> None:
    (tmp_path / "plan").mkdir()
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    assert verify_plan_dir(tmp_path / "plan") == []


def test_failure_midway_leaves_the_old_plan_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "plan"
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), out, provenance={})
    before = _tree(out)

    def broken_rename(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(emit_module.os, "rename", broken_rename)
    plan = cpu_plan()
    plan.schedule.steps = 999
    with pytest.raises(OSError, match="disk full"):
        emit_plan_dir(plan, spec_from(CPU_SPEC), out, provenance={})
    monkeypatch.undo()
    assert _tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan"], "staging directory left behind"


def test_unsafe_role_or_env_names_are_refused(tmp_path: Path) -> None:
    plan = cpu_plan()
    plan.roles[0].name = "../escape"
    with pytest.raises(PlanEmitError, match="file name"):
        emit_plan_dir(plan, spec_from(CPU_SPEC), tmp_path / "a", provenance={})
    plan = cpu_plan()
    plan.env = {"BAD NAME;rm": "x"}
    with pytest.raises(PlanEmitError, match="shell identifiers"):
        emit_plan_dir(plan, spec_from(CPU_SPEC), tmp_path / "b", provenance={})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ------------------------------------------------------------------------------ resolved spec and provenance


def test_provenance_sources() -> None:
    text = A2_SPEC.replace("target: a2\n", "")
    overrides = ["algorithm.lr=3e-6", "lora={rank: 8}"]
    from rlc.compiler.load import load_spec_text

    spec = load_spec_text(text, target="a2", overrides=overrides).spec
    assert spec is not None
    sources = compute_provenance(spec, overrides, target_given=True)
    assert sources["target"] == "--target"
    assert sources["algorithm.lr"] == "--set"
    assert sources["lora.rank"] == "--set"
    assert sources["lora.alpha"] == "default"
    assert sources["algorithm.steps"] == "spec"
    assert sources["algorithm.clip"] == "default"
    assert sources["distill"] == "default"
    assert sources["output.loggers"] == "default"
    assert sources["placement.teachers"] == "default"
    mopd = compute_provenance(spec_from(A3_SPEC))
    assert mopd["distill.teachers.1.model.path"] == "spec"
    assert mopd["distill.teachers.1.weight"] == "default"
    assert mopd["distill.routing"] == "default"


def test_resolved_spec_reads_back_and_names_sources(tmp_path: Path) -> None:
    spec = spec_from(A3_SPEC)
    emit_plan_dir(a3_plan(), spec, tmp_path / "plan", provenance=compute_provenance(spec))
    text = (tmp_path / "plan" / "spec.resolved.yaml").read_text()
    again = Spec.model_validate(yaml.safe_load(text))
    expected = spec.model_dump()
    expected["cluster"]["devices_per_node"] = 16
    expected["output"]["dir"] = "runs/qwen3-8b-mopd-lora"
    expected["train"].update(backend="fsdp2", recompute="none", micro_batch_tokens=8192)
    expected["lora"]["rollout"] = "adapter"
    assert again.model_dump() == expected
    lines = text.splitlines()
    assert "  backend: fsdp2  # planner (was auto)" in lines
    assert "  nodes: 2  # spec" in lines
    assert "  clip: 0.2  # default" in lines
    assert "    - name: math  # spec" in lines
    assert "  lr: 1.0e-06  # default" in lines


def test_resolved_spec_survives_hostile_strings(tmp_path: Path) -> None:
    hostile = "/m/a b$(touch X)\n# not a comment: `x` 'q' \"d\" \u2028 ☃ {a: [1]}"
    spec = spec_from(CPU_SPEC).model_copy(deep=True)
    spec.model.path = hostile
    spec.output.dir = hostile
    spec.placement.teachers = {}
    emit_plan_dir(cpu_plan(model_path=hostile, run_dir=hostile), spec, tmp_path / "plan", provenance={})
    data = yaml.safe_load((tmp_path / "plan" / "spec.resolved.yaml").read_text())
    assert data["model"]["path"] == hostile and data["output"]["dir"] == hostile
    assert Spec.model_validate(data).model.path == hostile


def test_compile_path_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "import rlc.compiler.emit, rlc.compiler.manifest, rlc.compiler.diff, rlc.compiler.provenance\n"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_output_that_is_no_plan_is_refused_without_walking_it(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`-o /` or a home folder: the refusal comes from the missing manifest, before any walk of the tree."""
    from rlc.compiler import emit

    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(emit, "list_files", lambda _: pytest.fail("walked a folder that is no plan"))
    with pytest.raises(emit.PlanDirError, match=r"no manifest\.json"):
        emit._check_replaceable(tmp_path)


def test_the_plan_says_how_many_optimizer_steps_a_training_step_takes() -> None:
    """The trainer role's notes (explain, its JSON) and SUMMARY state minibatches and the proximal pass."""
    from rlc.compiler.emit import render_summary
    from rlc.compiler.planner import build_plan
    from rlc.compiler.validate import check_text

    text = "name: t\ntarget: a3\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: arithmetic}\n"
    checked = check_text(text + "algorithm: {batch_prompts: 64, group_size: 8, minibatches: 4}\n", "spec.yaml")
    plan, _ = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is not None and plan.algorithm.minibatches == 4
    notes = plan.role("actor").notes
    assert "4 optimizer steps per training step (algorithm.minibatches), after a forward pass" in " ".join(notes)
    assert "4 optimizer steps (`algorithm.minibatches`), one per minibatch of about 128 samples" in render_summary(
        plan, plan_hash="0"
    )
