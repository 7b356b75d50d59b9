"""Layout search: pruned equals exhaustive on small cases, pins are honoured, topology respected, speed."""

from __future__ import annotations

import itertools
import textwrap
import time

import pytest

from rlc.compiler import search
from rlc.compiler.validate import check_text


def problem(body: str, target: str = "a2"):  # type: ignore[no-untyped-def]
    body = textwrap.dedent(body)
    data = "" if "data:" in body else "data: {train: arithmetic}\n"
    text = "name: t\n" + data + body
    checked = check_text(text, "spec.yaml", target=target)
    assert checked.problem is not None, [d.message for d in checked.report.diagnostics]
    return checked.problem


SMALL = [
    ("model: {name: qwen3-1.7b, path: /m}\nrollout: {max_prompt_len: 1024, max_response_len: 2048}\n", "a2"),
    ("model: {name: qwen3-8b, path: /m}\nmode: disaggregated\n", "a2"),
    ("model: {name: qwen3-30b-a3b, path: /m}\nrollout: {max_prompt_len: 1024, max_response_len: 2048}\n", "a3"),
    ("model: {name: qwen3-32b, path: /m}\ncluster: {nodes: 2}\nmode: colocated\n", "a2"),
    # auto mode: the best is a disaggregated FSDP2 trainer at CP 4, above the CP the context alone needs.
    ("model: {name: qwen3-32b, path: /m}\ncluster: {nodes: 2}\n", "a2"),
    ("model: {name: rlc-tiny}\nrollout: {max_prompt_len: 16, max_response_len: 16}\n", "cpu"),
    (
        "model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\nmode: disaggregated\n"
        "data: {train: arithmetic, domain_key: d}\n"
        "distill:\n  teachers:\n"
        "    - {name: math, model: {name: qwen3-32b, path: /t1}, domain: math}\n"
        "    - {name: code, model: {name: qwen3-14b, path: /t2}, domain: code}\n",
        "a3",
    ),
]


@pytest.mark.parametrize(("body", "target"), SMALL)
def test_pruned_equals_exhaustive(body: str, target: str) -> None:
    p = problem(body, target)
    pruned = search.search(p)
    full = search.search(p, exhaustive=True)
    assert pruned.best is not None and full.best is not None
    assert pruned.best.summary == full.best.summary
    assert abs(pruned.best.step.tokens_per_s - full.best.step.tokens_per_s) < 1e-6


def test_pins_are_honoured() -> None:
    p = problem("""
        model: {name: qwen3-32b, path: /m}
        cluster: {nodes: 2}
        mode: disaggregated
        placement:
          train: {devices: 8, backend: fsdp2, tp: 4, pp: 2, recompute: full}
          rollout: {devices: 8, tp: 2, memory_fraction: 0.8}
    """)
    best = search.search(p).best
    assert best is not None
    t, r = best.train.layout, best.rollout.layout
    assert (t.world_size, t.backend, t.tp, t.pp, t.recompute) == (8, "fsdp2", 4, 2, "full")
    assert (r.devices, r.tp, r.memory_fraction) == (8, 2, 0.8)


def test_topology_tp_inside_node_and_a3_pairs() -> None:
    p = problem("model: {name: qwen3-8b, path: /m}\nmode: disaggregated\n", "a3")
    result = search.search(p)
    for c in result.ranked:
        assert c.train.layout.world_size % 2 == 0 and c.rollout.layout.devices % 2 == 0
        assert c.rollout.layout.tp <= 16
    assert not search.groups_in_nodes(6, 4, 4, 8)
    assert search.groups_in_nodes(8, 8, 4, 8)


def test_moe_plans_an_fsdp2_layout_the_runtime_builds_and_ep_divides_experts() -> None:
    from rlc.compiler.planner import plan_gaps
    from rlc.schemas.layout import fsdp2_runs_ep

    p = problem("model: {name: qwen3-235b-a22b, path: /m}\ncluster: {nodes: 8}\n", "a3")
    best = search.search(p).best
    assert best is not None and best.train.layout.backend == "fsdp2"
    lay = best.train.layout
    assert 128 % lay.ep == 0 and 128 % best.rollout.layout.ep == 0
    assert fsdp2_runs_ep(lay.ep, lay.tp, lay.cp, lay.dp)
    assert not [g for g in plan_gaps(p, best) if "trainer" in g or "EP" in g or "expert" in g]


def test_dense_model_that_fits_uses_fsdp2() -> None:
    best = search.search(problem("model: {name: qwen3-8b, path: /m}\n")).best
    assert best is not None and best.train.layout.backend == "fsdp2"


def test_micro_batch_holds_the_longest_sequence() -> None:
    best = search.search(problem("model: {name: qwen3-8b, path: /m}\n")).best
    assert best is not None and best.train.layout.micro_batch_tokens >= 2048 + 8192


def test_large_moe_search_does_not_blow_up() -> None:
    """A blow-up guard, not a speed test (benchmarks/compile_speed.py measures speed): about 0.3 CPU-s here;
    a search that lost its pruning takes minutes. CPU time, so a loaded machine does not fail it."""
    p = problem("model: {name: deepseek-v3, path: /m}\ncluster: {nodes: 128}\n")
    start = time.process_time()
    result = search.search(p)
    elapsed = time.process_time() - start
    assert result.best is not None
    assert elapsed < 5.0


def test_more_pools_than_nodes_split_nodes_in_device_groups() -> None:
    """Trainer, rollout and two teachers on two A3 nodes: pools share nodes in die pairs, TP stays in a node."""
    p = problem(
        """
        model: {name: qwen3-8b, path: /m}
        cluster: {nodes: 2}
        mode: disaggregated
        data: {train: arithmetic, domain_key: d}
        distill:
          teachers:
            - {name: math, model: {name: qwen3-32b, path: /t1}, domain: math}
            - {name: code, model: {name: qwen3-32b, path: /t2}, domain: code}
        """,
        "a3",
    )
    ctx = search.make_context(p)
    assert search.pool_sizes(ctx, 32) == [2, 4, 6, 8, 10, 12, 14, 16, 32]
    result = search.search_context(ctx)
    assert result.best is not None and len(result.best.teachers) == 2
    best = result.best
    pools = [(0, best.train.layout.world_size), (best.rollout_start, best.rollout.layout.devices)]
    pools += [(s, t.layout.devices) for s, t in zip(best.teacher_starts, best.teachers, strict=True)]
    pools.sort()
    for (s1, n1), (s2, _n2) in itertools.pairwise(pools):
        assert s1 + n1 <= s2
    assert pools[-1][0] + pools[-1][1] <= 32
    for s, t in zip(best.teacher_starts, best.teachers, strict=True):
        assert search.groups_in_nodes(s, t.layout.devices, t.layout.tp, 16)
    assert search.groups_in_nodes(best.rollout_start, best.rollout.layout.devices, best.rollout.layout.tp, 16)


def test_teachers_that_cannot_fit_are_reported() -> None:
    """A teacher too big for what is left gets its own RLC301 reason instead of a bare 'no layout fits'."""
    p = problem(
        """
        model: {name: qwen3-1.7b, path: /m}
        mode: disaggregated
        data: {train: arithmetic, domain_key: d}
        distill:
          teachers:
            - {name: big, model: {name: qwen3-235b-a22b, path: /t}, domain: math}
        """,
    )
    result = search.search(p)
    assert result.best is None
    assert "teacher-big" in result.failures


def test_candidate_summaries_name_every_choice() -> None:
    result = search.search(problem("model: {name: qwen3-8b, path: /m}\ncluster: {nodes: 2}\n"))
    summaries = [c.summary for c in result.ranked]
    assert len(set(summaries)) == len(summaries) > 1
    assert all("recompute=" in s and "mbt=" in s and "mem=" in s for s in summaries)


def test_a_huge_cluster_for_a_small_batch_plans_what_the_batch_can_use() -> None:
    """1,024 nodes for 256 samples of a small model: neither role spreads past one sample per rank (more ranks
    would idle), and the search stops growing rollout pools there instead of pricing every node count."""
    p = problem(
        """
        model:
          arch: {num_layers: 4, hidden_size: 512, num_attention_heads: 8, num_kv_heads: 4,
                 intermediate_size: 1024, vocab_size: 1000}
          path: /m
        cluster: {nodes: 1024}
        algorithm: {group_size: 8, batch_prompts: 32, max_staleness: 6}
        rollout: {max_prompt_len: 1024, max_response_len: 4096}
        lora: {rank: 32, alpha: 64}
        """
    )
    best = search.search(p).best
    assert best is not None and best.mode == "disaggregated"
    assert best.train.layout.dp <= 256
    assert best.rollout.layout.devices // best.rollout.layout.tp <= 256
