"""Honest headroom: a stated allocator margin on trainers, engine memory outside vLLM's share, thin plans flagged,
and the published OOM report that the static budget used to accept is refused."""

from __future__ import annotations

import textwrap

import pytest

from rlc.compiler import memory, search
from rlc.compiler.memory import RolloutLayout
from rlc.compiler.planner import build_plan
from rlc.compiler.validate import check_text
from rlc.schemas.registry import load_arch, load_target


def _checked(body: str, target: str = "a2"):  # type: ignore[no-untyped-def]
    text = "name: t\ndata: {train: arithmetic}\n" + textwrap.dedent(body)
    checked = check_text(text, "spec.yaml", target=target)
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    return checked


def test_trainer_margin_is_the_allocator_overhead_of_what_it_allocates() -> None:
    best = search.search(_checked("model: {name: qwen3-8b, path: /m}\n").problem).best
    assert best is not None
    items = best.train.memory.items
    allocated = sum(v for k, v in items.items() if k not in ("margin", "reserve", "other_roles", "sync_group"))
    assert items["margin"] == pytest.approx(0.14 * allocated, rel=1e-9)
    assert best.train.memory.total_gib <= best.train.memory.capacity_gib


def test_margin_can_be_overridden() -> None:
    tight = _checked("model: {name: qwen3-8b, path: /m}\ncluster: {memory_margin: 0.0}\n").problem
    roomy = _checked("model: {name: qwen3-8b, path: /m}\ncluster: {memory_margin: 0.3}\n").problem
    assert tight.target.allocator_overhead == 0.0 and roomy.target.allocator_overhead == 0.3
    a, b = search.search(tight).best, search.search(roomy).best
    assert a is not None and b is not None
    assert "margin" not in a.train.memory.items
    assert b.train.memory.items["margin"] > 0


def test_auto_fraction_leaves_room_for_graphs_and_long_prefills() -> None:
    """The share the planner picks falls with the context: the longest prefill's K/V sits outside it."""
    from rlc.compiler.engine_search import auto_fraction

    short = search.make_context(_checked("model: {name: qwen3-8b, path: /m}\n").problem)
    body = "model: {name: qwen3-8b, path: /m}\nrollout: {max_prompt_len: 2048, max_response_len: 63488}\n"
    long = search.make_context(_checked(body).problem)
    assert auto_fraction(long, 1, 0.0) < auto_fraction(short, 1, 0.0) <= 0.9
    # TP 1 on A2: 147,456 bytes of KV per token x 65,536 tokens = 9 GiB beside the share, and the graph pool.
    assert auto_fraction(long, 1, 0.0) == 0.79
    best = search.search_context(long).best
    assert best is not None
    m = best.rollout.memory
    assert m.items["graph"] == memory.ENGINE_GRAPH_GIB and m.items["prefill"] > 0 and m.fits


def test_published_oom_qwen3_235b_tp16_at_095_is_refused() -> None:
    """vllm-ascend issue 3357 (deployments.yaml oom-vllm-ascend-qwen3-235b-tp16-98k): TP16 on one A3 node at
    gpu_memory_utilization 0.95 with max_model_len 98304 ran out of memory on a ~90K-token prompt."""
    sizes = memory.model_sizes(load_arch("qwen3-235b-a22b"))
    a3 = load_target("a3")
    layout = RolloutLayout(16, tp=16, memory_fraction=0.95, max_num_seqs=16, max_num_batched_tokens=8192)
    m, _ = memory.rollout_memory(sizes, layout, a3, max_model_len=98304)
    assert not m.fits and m.total_gib > m.capacity_gib
    checked = _checked(
        """
        model: {name: qwen3-235b-a22b, path: /m}
        cluster: {nodes: 8}
        mode: disaggregated
        rollout: {max_prompt_len: 90000, max_response_len: 8304}
        placement:
          rollout: {devices: 16, tp: 16, memory_fraction: 0.95, max_num_seqs: 16}
        """,
        "a3",
    )
    plan, diags = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is None
    assert any(d.code == "RLC301" and d.message.startswith("rollout") for d in diags)


@pytest.mark.parametrize(("budget", "thin"), [(35.0, True), (40.0, False)])
def test_thin_headroom_is_flagged(budget: float, thin: bool) -> None:
    """A pinned trainer (34.6 GiB per device) under a 35 GiB budget leaves 0.4 GiB spare: RLC304, also in
    the plan's warnings; under 40 GiB it is not flagged."""
    checked = _checked(
        f"""
        model: {{name: qwen3-8b, path: /m}}
        cluster: {{device_memory_gib: {budget}}}
        mode: disaggregated
        placement:
          train: {{devices: 4, backend: fsdp2, tp: 1, cp: 1, recompute: full, micro_batch_tokens: 10240,
                  offload: {{params: false, optimizer: true}}}}
        """
    )
    plan, diags = build_plan(checked.problem, checked.lines, "spec.yaml")
    assert plan is not None
    spare = plan.role("actor").memory.capacity_gib - plan.role("actor").memory.total_gib
    flagged = [d for d in diags if d.code == "RLC304"]
    assert (spare < 1.0) == thin == bool(flagged), spare
    assert any("headroom" in w for w in plan.warnings) == thin
