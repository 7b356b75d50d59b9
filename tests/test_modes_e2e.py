"""`rlc run` in each mode on the CPU default: colocated, LoRA, MOPD and speculative decoding.

Every example in examples/cpu-*.yaml is validated, compiled and run for a few steps with a real local Ray,
vLLM engines and an FSDP2 trainer. Engine start-up dominates (tens of seconds each on two cores), so runs
are a few steps, except the MOPD comparison (40 steps with distillation against the same spec without).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
RLC = [sys.executable, "-m", "rlc"]
MOPD_STEPS = 40

pytestmark = pytest.mark.slow


def compile_example(name: str, tmp_path: Path, *overrides: str, text: str | None = None) -> Path:
    spec = ROOT / "examples" / f"{name}.yaml"
    if text is not None:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(text)
    subprocess.run([*RLC, "validate", str(spec)], check=True, capture_output=True, text=True)
    plan = tmp_path / "plan"
    args = [*RLC, "compile", str(spec), "-o", str(plan), "--set", f"output.dir={tmp_path / 'run'}"]
    for item in overrides:
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, text=True)
    return plan


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(plan_dir: Path, run_dir: Path, patch=None) -> list[dict]:  # type: ignore[no-untyped-def]
    from rlc.compiler.manifest import load_plan
    from rlc.runtime.launch import run_plan

    plan = load_plan(plan_dir)
    if patch is not None:
        patch(plan)
    steps = run_plan(plan, run_dir)
    rows = read_metrics(run_dir)
    assert steps == plan.schedule.steps == len(rows)
    return rows


def test_colocated_is_strictly_on_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = compile_example("cpu-colocated", tmp_path, "algorithm.steps=4", "output.checkpoint_every=100")
    rows = run(plan, tmp_path / "run")
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness/max"] == 0 for r in rows), "every sample must come from the current policy"
    # cpu: no sleep mode and trainer state already in host memory; recorded as 0, not pretended.
    assert all(r["time/offload_s"] == 0 and r["time/onload_s"] == 0 for r in rows)
    assert all(r["logprob_gap/max"] < 1e-3 for r in rows)  # engines hold exactly the trainer's weights
    assert "sleep mode is not supported" in capsys.readouterr().out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_lora_trains_adapters_only_and_engine_matches_trainer(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    plan = compile_example("cpu-lora", tmp_path, "algorithm.steps=4", "output.checkpoint_every=2")
    run_dir = tmp_path / "run"
    from rlc.runtime.tasks.tiny_model import build_tiny_model

    base = build_tiny_model(run_dir / "model", seed=0)
    before = _sha256(base / "model.safetensors")
    rows = run(plan, run_dir)
    assert _sha256(base / "model.safetensors") == before
    # vLLM serving the adapter vs the FSDP2 trainer with it, on the same sampled tokens (on-policy).
    assert all(r["logprob_gap/max"] < 1e-3 for r in rows), [r["logprob_gap/max"] for r in rows]
    assert all("kl_ref" in r for r in rows)  # reference = base model with adapters disabled
    assert rows[-1]["kl_ref"] > 0
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    adapter = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_" in k for k in adapter)
    assert not (ckpt / "hf").exists()

    out = tmp_path / "merged"
    result = subprocess.run(
        [*RLC, "export", str(run_dir), "--merged", "-o", str(out)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    merged = load_file(str(out / "model.safetensors"))
    original = load_file(str(base / "model.safetensors"))
    assert set(merged) == set(original)  # plain HF names, no LoRA keys
    moved = [k for k in original if not torch.equal(merged[k], original[k])]
    assert moved and all("proj" in k for k in moved)


def test_speculative_counters_in_metrics(tmp_path: Path) -> None:
    plan = compile_example("cpu-speculative", tmp_path, "algorithm.steps=4", "output.checkpoint_every=1000")
    from rlc.compiler.manifest import load_plan

    speculative = load_plan(plan).role("rollout").engine["speculative_config"]
    assert speculative["prompt_lookup_min"] == 1  # the example's ngram_min: its sequences are a few tokens long
    rows = run(plan, tmp_path / "run")
    for r in rows:
        assert 0.0 <= r["spec_decode/acceptance_rate"] <= 1.0
        assert r["spec_decode/mean_accepted_len"] >= 1.0
    assert sum(r["spec_decode/draft_tokens"] for r in rows) > 0
    print("spec decode:", [(r["spec_decode/acceptance_rate"], r["spec_decode/mean_accepted_len"]) for r in rows])


@pytest.fixture(scope="module")
def baseline_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """cpu-mopd without its distill block (and teacher pin): the same run with RL alone."""
    tmp = tmp_path_factory.mktemp("baseline")
    kept, skipping = [], False
    for line in (ROOT / "examples" / "cpu-mopd.yaml").read_text().splitlines():
        if line.startswith("distill:"):
            skipping = True
            continue
        if skipping and line.startswith(" "):
            continue
        skipping = False
        if not line.lstrip().startswith("teachers:"):
            kept.append(line)
    text = "\n".join(kept).replace("name: cpu-mopd", "name: cpu-mopd-baseline") + "\n"
    plan = compile_example("cpu-mopd", tmp, f"algorithm.steps={MOPD_STEPS}", "output.checkpoint_every=1000", text=text)
    return run(plan, tmp / "run")


def test_mopd_pulls_student_towards_teacher(tmp_path: Path, baseline_rows: list[dict]) -> None:
    from rlc.runtime.tasks.tiny_model import build_tiny_model

    # A teacher that answers correctly: the tiny model with a longer supervised warm-up (greedy ≈ 0.99).
    teacher = build_tiny_model(tmp_path / "teacher", seed=0, warmup_steps=120)
    text = (ROOT / "examples" / "cpu-mopd.yaml").read_text().replace("runs/teacher-model", str(teacher))
    plan = compile_example(
        "cpu-mopd", tmp_path, f"algorithm.steps={MOPD_STEPS}", "output.checkpoint_every=1000", text=text
    )
    rows = run(plan, tmp_path / "run")
    assert all(r["distill/adder/tokens"] > 0 for r in rows)  # every trajectory is routed (domain arithmetic)
    half = MOPD_STEPS // 2

    def mean(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    distill_reward = mean(rows[half:], "reward/mean")
    baseline_reward = mean(baseline_rows[half:], "reward/mean")
    kl_first, kl_last = mean(rows[:half], "distill/adder/reverse_kl"), mean(rows[half:], "distill/adder/reverse_kl")
    print(
        f"MOPD last-half reward {distill_reward:.3f} vs baseline {baseline_reward:.3f}; "
        f"reverse KL {kl_first:.3f} -> {kl_last:.3f}"
    )
    # Measured on two cores (last-half reward, distill vs RL alone, same data seed): coef 1.0 gives +0.10
    # (seed 0: 0.356 vs 0.260), -0.07 (seed 1: 0.129 vs 0.196) and -0.02 (seed 2: 0.300 vs 0.320); coef 0.3
    # gives +0.01 and +0.00 (seeds 1, 2); coef 3.0 +0.07 (seed 0). Reverse KL to the teacher falls in every
    # run, but no setting of coef (0.3-3) at 40 steps beats RL alone on every seed, so the test holds the
    # KL claim and only guards against harm (the worst measured gap is -0.07).
    assert kl_last < kl_first
    assert distill_reward > baseline_reward - 0.1
