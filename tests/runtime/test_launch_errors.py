"""`rlc run`'s start and stop paths turn what goes wrong into one clear message, never a traceback or a hang."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from plan_fixtures import cpu_plan

from rlc.runtime import launch, ray_start
from rlc.runtime.errors import RunError, RunUsageError


def test_a_wait_past_its_bound_is_not_reported_as_a_failed_write(tmp_path: Path) -> None:
    from ray.exceptions import GetTimeoutError

    def stalled() -> int:
        raise GetTimeoutError("Get timed out: some object(s) not ready.")

    with pytest.raises(RunError, match="stopped answering") as caught:
        launch.run_controller(stalled, tmp_path)
    assert "writing the run's files" not in str(caught.value)
    assert "no checkpoint was completed" in str(caught.value)


def test_a_failed_write_is_still_named_as_one(tmp_path: Path) -> None:
    def full() -> int:
        raise OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl"))

    with pytest.raises(RunError, match="writing the run's files failed: No space left on device"):
        launch.run_controller(full, tmp_path)


def test_a_ray_address_nobody_listens_on_is_named_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        why = ray_start.ray_address_unreachable(f"127.0.0.1:{port}")
    assert why.startswith(f"nothing answers on 127.0.0.1:{port}")
    assert ray_start.ray_address_unreachable("auto") == ""  # Ray resolves these itself, and fails fast when it cannot
    assert ray_start.ray_address_unreachable("ray://") == ""


def test_a_ray_address_that_listens_passes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ray_start.ray_address_unreachable(f"127.0.0.1:{s.getsockname()[1]}") == ""


def test_a_plan_edited_to_lose_its_rollout_role_is_a_usage_error(tmp_path: Path) -> None:
    plan = cpu_plan(model_path=str(tmp_path / "m"), run_dir=str(tmp_path / "run"), build_tiny=False)
    plan.roles = [r for r in plan.roles if r.kind != "rollout"]
    with pytest.raises(RunUsageError, match="exactly one rollout role; this one has none"):
        launch.refuse_gaps(plan)


def test_a_multi_node_plan_without_a_cluster_is_refused_not_run_on_one_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_JOB_ID", raising=False)
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `rlc run` process
    plan = cpu_plan(model_path=str(tmp_path / "m"), run_dir=str(tmp_path / "run"), build_tiny=False)
    plan.cluster.nodes = 2
    plan.platform = "npu"  # accelerators are real devices; on cpu, nodes are logical and run locally
    with pytest.raises(RunUsageError, match=r"spans 2 nodes.*launch\.sh head"):
        ray_start.start_ray(plan, print)
