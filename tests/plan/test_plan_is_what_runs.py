"""Engines are built from their plan role's arguments, key for key, as the dry run prints them: the runtime adds
nothing a plan could have stated (the RL log-prob mode, the worker extension, the dtype are the plan's)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest
from paths import GOLDEN, REPO

from rlc.compiler.manifest import load_plan
from rlc.schemas.engine_args import RL_ENGINE_ARGS, SPEC_DECODE_EXTENSION_CLS
from rlc.schemas.plan import Plan

pytest.importorskip("vllm")

PLANS = sorted(p.parent for p in GOLDEN.glob("*/plan/plan.json"))


class _Built(Exception):
    """Raised where vLLM's engine would start: the arguments are recorded by then."""


def _engine_arguments_as_started(plan: Plan, model_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments each engine of `build_roles` (rollout and teachers) hands vLLM's `AsyncEngineArgs`:
    the real role builders, the real `RolloutEngine` constructor and start, with Ray's actor and placement calls
    and vLLM's engine itself left out."""
    import asyncio

    import vllm.engine.arg_utils as arg_utils

    from rlc.runtime import role_actors, run_end
    from rlc.runtime.rollout import engine as engine_module
    from rlc.runtime.train import group as group_module

    started: list[dict] = []

    def record(**kwargs: object) -> None:
        started.append(kwargs)
        raise _Built

    class Actor:
        def remote(self, *args: object, **kwargs: object) -> object:
            engine = engine_module.RolloutEngine(*args, **kwargs)
            with pytest.raises(_Built):
                asyncio.run(engine._start_engine())
            return object()

    async def no_hosts(self: object) -> None:
        pass

    monkeypatch.setattr(os, "environ", dict(os.environ))  # engines apply their env here
    monkeypatch.setattr(run_end, "leave_stop_to_driver", lambda: None)  # this process keeps its SIGTERM
    monkeypatch.setattr(arg_utils, "AsyncEngineArgs", record)
    monkeypatch.setattr(engine_module, "_engine_core_joins_this_cluster", lambda: None)
    monkeypatch.setattr(engine_module.RolloutEngine, "_start_core_hosts", no_hosts)
    monkeypatch.setattr(role_actors, "_placement_groups", lambda request, created: defaultdict(object))
    monkeypatch.setattr(role_actors, "_engine_actor_class", lambda *a: Actor())
    monkeypatch.setattr(role_actors, "_wait_started", lambda roles: None)
    monkeypatch.setattr(group_module, "TrainerGroup", lambda *a, **k: object())
    role_actors.build_roles(plan, model_path, 0, [])
    return started


@pytest.mark.parametrize("plan_dir", [*PLANS, "quickstart"], ids=lambda p: getattr(p, "parent", Path(p)).name)
def test_each_engine_runs_with_exactly_its_plan_role_arguments(
    plan_dir: Path | str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each engine gives vLLM is its plan role's `engine`, key for key (the model folder aside: the run's,
    which on resume is the checkpoint's), and the dry run prints exactly that."""
    from rlc.compiler.pipeline import compile_file
    from rlc.runtime.launch_request import launch_request, render_request

    plan = (
        load_plan(plan_dir) if isinstance(plan_dir, Path) else compile_file(REPO / "examples" / "quickstart.yaml").plan
    )
    assert plan is not None
    engine_roles = [r for r in plan.roles if r.kind in ("rollout", "teacher")]
    assert engine_roles
    model_path = tmp_path / "model"
    started = _engine_arguments_as_started(plan, model_path, monkeypatch)
    expected = [
        {**role.engine, "model": str(model_path)} if role.kind == "rollout" else dict(role.engine)
        for role in engine_roles
        for _ in range(role.replicas)
    ]
    assert started == expected
    printed = render_request(launch_request(plan)).splitlines()
    for role in engine_roles:
        assert RL_ENGINE_ARGS["logprobs_mode"] == role.engine["logprobs_mode"]
        shown = ", ".join(f"{k}={v}" for k, v in sorted(role.engine.items()) if k != "model")
        assert f"engine {role.name}: model {role.engine['model']}; {shown}" in printed


def test_a_cpu_plan_with_speculative_decoding_states_the_repairing_extension() -> None:
    from rlc.compiler.pipeline import compile_file

    examples = REPO / "examples"
    speculative = compile_file(examples / "cpu-speculative.yaml").plan
    plain = compile_file(examples / "quickstart.yaml").plan
    assert speculative is not None and plain is not None
    assert speculative.roles_of("rollout")[0].engine["worker_extension_cls"] == SPEC_DECODE_EXTENSION_CLS
    assert plain.roles_of("rollout")[0].engine["worker_extension_cls"] == RL_ENGINE_ARGS["worker_extension_cls"]


@pytest.mark.parametrize("plan_dir", PLANS, ids=lambda p: p.parent.name)
def test_the_trainer_runs_with_the_plan_settings_and_no_default(plan_dir: Path) -> None:
    """Every trainer setting comes from the plan: the trainer role's arguments key for key, the algorithm's
    optimizer settings, and no default of the trainer's own (bar the device index, which is the process's, and a
    router's settings on a model without one)."""
    from rlc.runtime.role_actors import train_config
    from rlc.runtime.train.trainer import DEFAULT_TRAIN_CFG

    plan = load_plan(plan_dir)
    (role,) = plan.roles_of("train")
    cfg = train_config(plan, role)
    assert {k: cfg[k] for k in role.engine if k != "etp"} == {k: v for k, v in role.engine.items() if k != "etp"}
    assert (cfg["lr"], cfg["weight_decay"], cfg["max_grad_norm"], cfg["seed"]) == (
        plan.algorithm.lr,
        plan.algorithm.weight_decay,
        plan.algorithm.grad_clip,
        plan.algorithm.seed,
    )
    unstated = {"local_rank", "micro_batch_size"} | (
        set() if plan.model.experts else {"router_aux_loss_coef", "routing_replay"}
    )
    assert set(DEFAULT_TRAIN_CFG) - set(cfg) - unstated == set()


@pytest.mark.parametrize(
    ("tp", "dp", "ep", "sharded_over"),
    [
        (1, 4, 2, 2),  # experts split over 2 of 4 data-parallel ranks: each expert's shard spans the other 2
        (2, 2, 4, 1),  # EP over the TP pair, then over both data-parallel ranks: each expert on one rank
        (2, 4, 2, 4),  # EP 2 over the TP pair alone: every data-parallel rank holds a copy, FSDP2 shards over 4
    ],
)
def test_the_dry_run_states_over_how_many_ranks_fsdp2_shards_each_expert(
    tp: int, dp: int, ep: int, sharded_over: int
) -> None:
    """The dry run's MoE line counts the ranks that hold one expert: dp·cp over EP's share of a TP column."""
    from rlc.runtime.launch_request import _experts_line
    from rlc.schemas.layout import TrainLayout
    from rlc.schemas.plan import ExpertLayers

    layout = TrainLayout(world_size=tp * dp, tp=tp, ep=ep)
    line = _experts_line(ExpertLayers(layers=2, num_experts=8, experts_per_token=2), layout)
    assert f"each rank holds {8 // ep} experts (FSDP2 shards them over {sharded_over} rank(s))" in line
