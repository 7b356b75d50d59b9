"""`rlc validate`: structural and semantic diagnostics, each with a code, a path, a line and a hint."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from paths import REPO

from rlc.compiler.validate import RULES, check_file, check_text

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

GOOD = """\
name: ok-run
target: a2
cluster: {nodes: 2}
model: {name: qwen3-8b, path: /models/Qwen3-8B}
data: {train: /data/math.jsonl}
"""


def check(text: str, target: str | None = None):
    return check_text(textwrap.dedent(text), "spec.yaml", target=target).report


def codes(report) -> list[str]:
    return [d.code for d in report.sorted()]


def only(report, code: str):
    found = [d for d in report.diagnostics if d.code == code]
    assert found, f"expected {code}, got {[(d.code, d.message) for d in report.diagnostics]}"
    return found[0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_clean(path: Path) -> None:
    report = check_file(path).report
    assert report.ok, [(d.code, d.path, d.message) for d in report.errors]


def test_good_spec_has_no_errors() -> None:
    assert check(GOOD).ok


def test_unknown_key_gets_did_you_mean_and_line() -> None:
    report = check(GOOD + "algoritm: {lr: 1.0e-6}\n")
    d = only(report, "RLC101")
    assert d.path == "algoritm"
    assert d.line == 6
    assert "`algorithm`" in d.hint


def test_nested_unknown_key_did_you_mean() -> None:
    report = check(GOOD + "algorithm:\n  group_sise: 8\n")
    d = only(report, "RLC101")
    assert d.path == "algorithm.group_sise"
    assert d.line == 7
    assert "group_size" in d.hint


def test_wrong_type_shows_value() -> None:
    report = check(GOOD + "algorithm: {group_size: many}\n")
    d = only(report, "RLC102")
    assert d.path == "algorithm.group_size"
    assert "'many'" in d.message


def test_out_of_range_value() -> None:
    report = check(GOOD + "algorithm: {clip: 1.5}\n")
    d = only(report, "RLC104")
    assert d.path == "algorithm.clip"
    assert "1.5" in d.message


def test_bad_literal_suggests() -> None:
    report = check(GOOD + "mode: colocate\n")
    d = only(report, "RLC104")
    assert d.path == "mode"
    assert "colocated" in d.hint


def test_missing_required_keys() -> None:
    report = check("name: x\ntarget: a2\n")
    missing = {d.path for d in report.diagnostics if d.code == "RLC103"}
    assert missing == {"model", "data"}


def test_many_errors_reported_at_once() -> None:
    text = """\
    name: Bad Name
    target: a2
    model: {name: qwen3-8b, path: /m}
    data: {train: /d.jsonl}
    algoritm: {}
    rollout: {temperature: -1, max_prompt_len: zero}
    train: {backend: deepspeed}
    """
    report = check(text)
    paths = {d.path for d in report.errors}
    assert {"name", "algoritm", "rollout.temperature", "rollout.max_prompt_len", "train.backend"} <= paths
    assert len(report.errors) >= 5


def test_unknown_model_did_you_mean() -> None:
    report = check(GOOD.replace("qwen3-8b", "qwen3-8"))
    d = only(report, "RLC105")
    assert d.path == "model.name"
    assert d.line == 4
    assert "qwen3-8b" in d.hint


def test_model_suffix_and_case_resolve() -> None:
    assert check(GOOD.replace("qwen3-8b", "Qwen3-8B-Instruct")).ok


def test_target_missing_is_reported() -> None:
    report = check(GOOD.replace("target: a2\n", ""))
    only(report, "RLC107")


def test_cli_target_overrides_spec() -> None:
    report = check(GOOD, target="cpu")
    only(report, "RLC210")  # an 8B model on the cpu target


def test_malformed_yaml() -> None:
    report = check("name: x\nmodel: {name: qwen3-8b\n")
    d = only(report, "RLC001")
    assert d.line is not None


def test_empty_file() -> None:
    only(check(""), "RLC002")
    only(check("# only a comment\n"), "RLC002")


def test_not_a_mapping() -> None:
    only(check("- a\n- b\n"), "RLC003")
    only(check("just a string"), "RLC003")


def test_binary_garbage() -> None:
    report = check_text(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "img.png").report
    only(report, "RLC004")
    report = check_text(b"name: \xff\xfe\xfd", "latin.yaml").report
    only(report, "RLC004")


def test_duplicate_key() -> None:
    d = only(check(GOOD + "name: again\n"), "RLC005")
    assert d.line == 6


def test_missing_file(tmp_path: Path) -> None:
    report = check_file(tmp_path / "nope.yaml").report
    only(report, "RLC000")


# ----------------------------------------------------------------- semantic rules, one test each


@pytest.mark.parametrize(
    ("line", "path"),
    [
        ("output: {dir: ~/runs/x}", "output.dir"),
        ("output: {dir: $HOME/runs/x}", "output.dir"),
        ('output: {dir: "runs/${USER}/x"}', "output.dir"),
        ("data: {train: ~/data/math.jsonl}", "data.train"),
    ],
)
def test_rule_paths_are_not_expanded(line: str, path: str) -> None:
    key = line.split(":", 1)[0]
    text = "\n".join(x for x in GOOD.splitlines() if not x.startswith(f"{key}:")) + f"\n{line}\n"
    d = only(check(text), "RLC218")
    assert d.path == path and "would be used literally" in d.message and "absolute path" in d.hint
    assert check(GOOD + "output: {dir: /data/runs/x$}\n").ok  # a lone $ is just a character


def test_rule_cluster_within_the_search() -> None:
    d = only(check(GOOD.replace("nodes: 2", "nodes: 1024, devices_per_node: 64")), "RLC217")
    assert d.path == "cluster.nodes"
    assert "65,536 devices" in d.message and "8,192" in d.message
    assert "128 nodes" in d.hint


def test_errors_on_overridden_values_point_at_the_set() -> None:
    loaded = check_text(GOOD, "spec.yaml")  # baseline: the rule's line is the file's
    assert loaded.report.ok
    from rlc.compiler.load import load_spec_text
    from rlc.compiler.validate import check_loaded

    report = check_loaded(load_spec_text(GOOD, "spec.yaml", overrides=["placement.train.tp=3"])).report
    d = only(report, "RLC207")
    assert d.line is None and "(from `--set placement.train.tp=3`)" in d.message
    report = check_loaded(load_spec_text(GOOD, "spec.yaml", overrides=["cluster.nodes=0"])).report
    d = only(report, "RLC104")
    assert d.line is None and "from `--set cluster.nodes=0`" in d.message
    assert d.hint == "allowed: 1 ≤ value ≤ 1024"


def test_rule_mtp_needs_mtp_layers() -> None:
    d = only(check(GOOD + "rollout: {mtp: {num_speculative_tokens: 2}}\n"), "RLC201")
    assert "no MTP layers" in d.message
    assert d.path == "rollout.mtp"


def test_rule_mtp_ngram_allowed_everywhere() -> None:
    assert check(GOOD + "rollout: {mtp: {num_speculative_tokens: 2, method: ngram}}\n").ok


def test_rule_mtp_ok_on_mtp_model() -> None:
    spec = GOOD.replace("a2", "a3").replace("qwen3-8b", "qwen3.6-27b")
    assert check(spec + "rollout: {mtp: {num_speculative_tokens: 2}}\n").ok


def test_rule_teacher_vocab_mismatch() -> None:
    text = GOOD + textwrap.dedent(
        """\
        distill:
          teachers: [{name: old, model: {name: qwen2.5-32b, path: /t}}]
        """
    )
    d = only(check(text), "RLC202")
    assert "151936" in d.message or "152064" in d.message


def test_rule_routing_needs_domains() -> None:
    text = GOOD + textwrap.dedent(
        """\
        distill:
          routing: domain
          teachers:
            - {name: math, model: {name: qwen3-32b, path: /t}, domain: math}
            - {name: code, model: {name: qwen3-32b, path: /t}}
        """
    )
    report = check(text)
    paths = {d.path for d in report.diagnostics if d.code == "RLC203"}
    assert "data.domain_key" in paths
    assert "distill.teachers.1.domain" in paths


def test_rule_pinned_teacher_must_exist() -> None:
    d = only(check(GOOD + "placement: {teachers: {ghost: {devices: 2}}}\n"), "RLC203")
    assert "ghost" in d.message


def test_rule_colocated_teachers_need_room() -> None:
    text = GOOD.replace("nodes: 2", "nodes: 1") + textwrap.dedent(
        """\
        mode: colocated
        distill:
          routing: mixture
          teachers: [{name: big, model: {name: qwen3-235b-a22b, path: /t}}]
        """
    )
    d = only(check(text), "RLC204")
    assert "GiB" in d.message


def test_rule_lora_rank() -> None:
    d = only(check(GOOD + "lora: {rank: 8192}\n"), "RLC205")
    assert "4096" in d.message


def test_rule_context_beyond_positions() -> None:
    d = only(check(GOOD + "rollout: {max_prompt_len: 4096, max_response_len: 500000}\n"), "RLC206")
    assert d.severity == "error"
    assert "504096" in d.message


def test_rule_context_needs_rope_scaling_warning() -> None:
    report = check(GOOD + "rollout: {max_prompt_len: 4096, max_response_len: 61440}\n")
    d = only(report, "RLC206")
    assert d.severity == "warning"
    assert report.ok


def test_rule_pinned_tp_must_divide_heads() -> None:
    d = only(check(GOOD + "placement: {train: {tp: 3}}\n"), "RLC207")
    assert "TP(3)" in d.message and "32" in d.message


def test_rule_pinned_degrees_divide_devices() -> None:
    d = only(check(GOOD + "placement: {train: {devices: 6, tp: 4}}\n"), "RLC207")
    assert "does not divide 6 training devices" in d.message


def test_rule_pinned_ep_on_dense() -> None:
    d = only(check(GOOD + "placement: {train: {ep: 2}}\n"), "RLC207")
    assert "dense" in d.message


def test_rule_pinned_ep_divides_experts() -> None:
    spec = GOOD.replace("qwen3-8b", "qwen3-30b-a3b")
    d = only(check(spec + "placement: {train: {ep: 3}}\n"), "RLC207")
    assert "128 experts" in d.message


def test_rule_ulysses_cp_needs_heads_ring_does_not() -> None:
    """Qwen3-8B has 32 heads: TP 8 · CP 8 Ulysses cannot split them; ring CP has no head constraint."""
    pins = "placement: {train: {devices: 64, tp: 8, cp: 8, cp_kind: ulysses}}\n"
    d = only(check(GOOD.replace("nodes: 2", "nodes: 16") + pins), "RLC207")
    assert "TP(8)·CP(8)=64 does not divide" in d.message and d.path == "placement.train.cp_kind"
    assert "ring" in d.hint
    ring = check(GOOD.replace("nodes: 2", "nodes: 16") + pins.replace("ulysses", "ring"))
    assert "RLC207" not in codes(ring)


def test_rule_device_memory_budget() -> None:
    d = only(check(GOOD.replace("nodes: 2}", "nodes: 2, device_memory_gib: 80}")), "RLC214")
    assert "exceeds the 60.96 GiB" in d.message
    assert "RLC214" not in codes(check(GOOD.replace("nodes: 2}", "nodes: 2, device_memory_gib: 50}")))
    d = only(check(GOOD.replace("nodes: 2}", "nodes: 2, device_memory_gib: 0.5}")), "RLC214")
    assert "reserve" in d.message


def test_rule_fsdp2_has_no_selective_recompute_and_runs_pipelines() -> None:
    report = check(GOOD + "train: {backend: fsdp2, recompute: selective}\nplacement: {train: {pp: 2}}\n")
    found = [d for d in report.diagnostics if d.code == "RLC215"]
    assert [d.path for d in found] == ["train.recompute"]  # pipeline stages are built on fsdp2
    assert "whole decoder layers" in found[0].message
    d = only(check(GOOD + "train: {packing: false}\nplacement: {train: {cp: 2}}\n"), "RLC215")
    assert "packed micro-batches" in d.message


def test_rule_tp_inside_node() -> None:
    d = only(check(GOOD + "placement: {train: {tp: 16}}\n"), "RLC207")
    assert "inside a node" in d.message and d.severity == "error"
    # rollout engines may span whole nodes when pinned (vLLM over Ray); a warning says what it costs
    d = only(check(GOOD + "placement: {rollout: {tp: 16}}\n"), "RLC207")
    assert d.severity == "warning" and "scale-out link" in d.message


def test_rule_pinned_devices_fit_cluster() -> None:
    d = only(check(GOOD + "placement: {train: {devices: 32}}\n"), "RLC208")
    assert "16" in d.message


def test_rule_disaggregated_pools_fit() -> None:
    text = GOOD + "mode: disaggregated\nplacement: {train: {devices: 10}, rollout: {devices: 8}}\n"
    d = only(check(text), "RLC208")
    assert "= 18 devices" in d.message


def test_rule_a3_die_pairs() -> None:
    d = only(check(GOOD.replace("a2", "a3") + "placement: {train: {devices: 5}}\n"), "RLC208")
    assert "pairs" in d.message


def test_rule_kl_reference_info_and_useless_estimator() -> None:
    info = only(check(GOOD + "algorithm: {kl_coef: 0.01}\n"), "RLC209")
    assert info.severity == "info"
    warn = only(check(GOOD + "algorithm: {kl_estimator: k1}\n"), "RLC209")
    assert warn.severity == "warning"
    # The default spelled out (spec.resolved.yaml writes every field) is no mistake.
    assert "RLC209" not in codes(check(GOOD + "algorithm: {kl_estimator: k3}\n"))


def test_rule_cpu_only_small_models() -> None:
    d = only(check(GOOD.replace("target: a2", "target: cpu")), "RLC210")
    assert "8." in d.message or "B parameters" in d.message


def test_rule_model_path_required_on_hardware() -> None:
    d = only(check(GOOD.replace(", path: /models/Qwen3-8B", "")), "RLC211")
    assert d.path == "model.path"


def test_rule_unknown_task_and_reward() -> None:
    report = check(GOOD.replace("/data/math.jsonl", "arithmetc") + "reward: {fn: math_exakt}\n")
    found = {d.path: d for d in report.diagnostics if d.code == "RLC212"}
    assert "arithmetic" in found["data.train"].hint
    assert "math_exact" in found["reward.fn"].hint


def test_rule_micro_batch_shorter_than_sequence() -> None:
    d = only(check(GOOD + "train: {micro_batch_tokens: 1000}\n"), "RLC213")
    assert "10240" in d.message


def test_rule_megatron_refused_naming_the_fsdp2_layout() -> None:
    """More in test_trainer_refusals.py."""
    d = only(check(GOOD + "placement: {train: {devices: 8, backend: megatron, tp: 2, pp: 2}}\n"), "RLC223")
    assert d.severity == "error" and d.hint.endswith("{backend: fsdp2, devices: 8, tp: 2, pp: 2} (DP 2)")


def test_rule_lora_on_a_moe_model_router_refused() -> None:
    moe = GOOD.replace("qwen3-8b", "qwen3-30b-a3b")
    assert not [d for d in check(moe + "lora: {rank: 8}\n").diagnostics if d.code == "RLC224"]
    d = only(check(moe + "lora: {rank: 8, target_modules: [q_proj, gate]}\n"), "RLC224")
    assert d.severity == "error" and d.path == "lora.target_modules"


def test_rule_rollout_routing_replay_needs_engines_that_record_experts() -> None:
    """More in test_routing_replay.py."""
    hybrid = GOOD.replace("target: a2", "target: a3").replace("qwen3-8b", "qwen3.5-35b-a3b")
    d = only(check(hybrid + "train: {routing_replay: rollout}\n"), "RLC225")
    assert d.severity == "error" and d.path == "train.routing_replay" and "a3 target" in d.message
    assert only(check(GOOD + "train: {routing_replay: rollout}\n"), "RLC225").severity == "warning"  # dense


def test_every_rule_is_exercised() -> None:
    source = Path(__file__).read_text()
    for registered in RULES:
        assert f'"{registered.code}"' in source, f"no test for {registered.code}"


def test_inline_arch() -> None:
    text = GOOD.replace(
        "model: {name: qwen3-8b, path: /models/Qwen3-8B}",
        "model:\n  name: my-model\n  path: /m\n  arch: {num_layers: 4, hidden_size: 256, num_attention_heads: 4,"
        " num_kv_heads: 2, intermediate_size: 512, vocab_size: 1000}",
    )
    assert check(text).ok


def test_structural_and_semantic_errors_reported_together() -> None:
    report = check(GOOD + "algoritm: {lr: 1.0e-6}\nplacement:\n  train: {tp: 3}\nmode: colocate\n")
    found = {(d.code, d.path) for d in report.errors}
    assert ("RLC101", "algoritm") in found
    assert ("RLC104", "mode") in found
    assert ("RLC207", "placement.train.tp") in found


def test_group_size_one_needs_a_teacher() -> None:
    """RLC216: one sample per prompt gives zero GRPO advantages; allowed (as on-policy distillation) with teachers."""
    base = "name: t\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: arithmetic}\n"
    base += "algorithm: {group_size: 1}\n"
    alone = check(base)
    (d,) = [d for d in alone.diagnostics if d.code == "RLC216"]
    assert d.severity == "error" and d.path == "algorithm.group_size" and d.line == 5
    teacher = "distill:\n  teachers:\n    - {name: t, model: {name: qwen3-32b, path: /t}}\n"
    with_teacher = check(base + teacher)
    assert [d.severity for d in with_teacher.diagnostics if d.code == "RLC216"] == ["info"] and with_teacher.ok


def test_minibatches_must_leave_every_optimizer_step_samples() -> None:
    """RLC221: more minibatches than samples is an error at its line; an uneven split is a warning."""
    base = "name: t\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: arithmetic}\n"
    too_many = check(base + "algorithm: {batch_prompts: 2, group_size: 4, minibatches: 9}\n")
    (d,) = [d for d in too_many.diagnostics if d.code == "RLC221"]
    assert d.severity == "error" and d.path == "algorithm.minibatches" and d.line == 5
    assert "9 > the 8 samples" in d.message and "minibatches <= 8" in d.hint
    uneven = check(base + "algorithm: {batch_prompts: 2, group_size: 4, minibatches: 3}\n")
    assert [d.severity for d in uneven.diagnostics if d.code == "RLC221"] == ["warning"] and uneven.ok
    assert "RLC221" not in codes(check(base + "algorithm: {batch_prompts: 2, group_size: 4, minibatches: 4}\n"))


def test_rule_agent_settings() -> None:
    """RLC220 (more in test_agent_spec.py): an agent cannot run colocated, nor take more per turn than the budget."""
    agent = "rollout: {max_response_len: 64, agent: {run: 'a.b:run', max_tokens_per_turn: 128}}\nmode: colocated\n"
    found = {d.path for d in check(GOOD + agent).errors if d.code == "RLC220"}
    assert found == {"mode", "rollout.agent.max_tokens_per_turn"}


def test_deterministic_true_says_what_it_cannot_repeat() -> None:
    """RLC219: deterministic kernels cannot make an asynchronous run repeat; the warning points at replay."""
    base = "name: t\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: arithmetic}\n"
    report = check(base + "algorithm: {deterministic: true, max_staleness: 2}\n")
    (d,) = [d for d in report.diagnostics if d.code == "RLC219"]
    assert d.severity == "warning" and d.path == "algorithm.deterministic" and report.ok
    assert "max_staleness 2" in d.message and "--replay" in d.message and "max_staleness: 0" in d.hint
    for quiet in ("{deterministic: true, max_staleness: 0}", "{max_staleness: 2}", "{deterministic: false}"):
        assert "RLC219" not in codes(check(base + f"algorithm: {quiet}\n")), quiet
    colocated = check(base + "mode: colocated\nalgorithm: {deterministic: true}\n")
    assert "RLC219" not in codes(colocated)


def test_deterministic_takes_true_false_or_auto() -> None:
    report = check(GOOD + "algorithm: {deterministic: sometimes}\n")
    d = only(report, "RLC104")
    assert d.path == "algorithm.deterministic" and "true, false or auto" in d.message and d.line == 6
    assert len([x for x in report.diagnostics if x.path.startswith("algorithm.deterministic")]) == 1


def test_algorithm_settings_that_contradict_each_other() -> None:
    """RLC222 (more in test_algorithm_spec.py): GSPO's sequence ratio refuses the token clip keys, at their line."""
    base = "name: t\ntarget: a2\nmodel: {name: qwen3-8b, path: /m}\ndata: {train: arithmetic}\n"
    report = check(base + "algorithm: {importance_ratio: sequence, clip_high: 0.28}\n")
    (d,) = [d for d in report.diagnostics if d.code == "RLC222"]
    assert d.severity == "error" and d.path == "algorithm.clip_high" and d.line == 5
    assert "sequence_clip_high" in d.hint and not report.ok
    assert "RLC222" not in codes(check(base + "algorithm: {importance_ratio: sequence}\n"))
