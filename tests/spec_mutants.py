"""Hostile specs for the fuzz test and `scripts/fuzz_specs.py`: mutants of the examples and goldens, and one harness.

A mutant is a real spec with a few values replaced, deleted or added (extreme numbers, infinities, NUL bytes,
huge strings, odd structures), optionally with YAML-level attacks (recursive aliases, alias and merge-key
bombs, deep nesting) and `--set` overrides. `run_case` pushes one through what `rlc validate` and
`rlc compile` do in-process (load, rules, plan, render every file) and says how it ended.
"""

from __future__ import annotations

import copy
import json
import math
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

ROOT = Path(__file__).parent.parent
BASE_FILES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "tests" / "golden").glob("*/spec.yaml"))
BASES = [yaml.safe_load(p.read_text()) for p in BASE_FILES]
TARGETS = [None, "cpu", "a2", "a3", "h100"]

huge_ints = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**53 + 1, 2**63, 10**30, 10**100, -(2**63)]),
)
#: In-range but extreme: most get past validation, so the planner and the emitters see them.
plausible_ints = st.one_of(
    st.integers(min_value=1, max_value=64),
    st.sampled_from([128, 256, 1000, 1024, 4096, 8192, 32768, 65536, 1 << 20, 1 << 22, 1 << 24]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-320, 1e30, 1e308, -1e308, float("inf"), float("nan")]),
)
texts = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["a\x00b", "/models/\x00x", "x" * 5000, "~/runs/x", "$HOME/runs", "..", "/", "", "0", "-1"]),
    st.sampled_from(["qwen3-8b", "qwen3-235b-a22b", "a3", "cpu", "colocated", "auto", "all-linear", "ngram"]),
)
scalars = st.one_of(st.none(), st.booleans(), huge_ints, floats, texts)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)
#: `--set` values as typed on a command line.
override_values = st.one_of(
    st.sampled_from(
        ["1e30", "1.0e30", "1000000000000000000000000", ".inf", "-.inf", ".nan", "-1", "0", "[1, 2]", "{a: 1}"]
    ),
    st.sampled_from(["&a [*a]", "a\x00b", "null", "true", "~", "'quoted'", "x" * 300, "1" * 5000]),
    huge_ints.map(str),
    floats.map(repr),
)


#: A blow-up guard for hostile specs, not a speed test: each costs milliseconds when bounded and minutes (or all
#: memory) when not. A loaded CI machine once spent 1.3 CPU-s on a 20 ms case, so the guard leaves wide room;
#: the speed goal, 2 CPU-seconds a spec, is measured by `scripts/fuzz_specs.py`.
BLOWUP_CPU_S = 10.0


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_paths(value, (*prefix, index)))
    return found


def _numeric_paths(node: Any) -> list[tuple]:
    out = []
    for path in _paths(node):
        value = node
        for part in path:
            value = value[part]
        if isinstance(value, int | float) and not isinstance(value, bool):
            out.append(path)
    return out


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = root
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return root


def _delete(root: Any, path: tuple) -> Any:
    if not path:
        return root
    node = root
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return root


#: Numeric spec fields a mutant may add where the example leaves them to defaults.
NUMERIC_KEYS = [
    ("cluster", "nodes"),
    ("cluster", "devices_per_node"),
    ("algorithm", "group_size"),
    ("algorithm", "batch_prompts"),
    ("algorithm", "steps"),
    ("algorithm", "max_staleness"),
    ("algorithm", "seed"),
    ("rollout", "max_prompt_len"),
    ("rollout", "max_response_len"),
    ("train", "micro_batch_tokens"),
    ("train", "logprob_chunk_tokens"),
    ("placement", "train", "tp"),
    ("placement", "train", "devices"),
    ("placement", "rollout", "tp"),
    ("placement", "rollout", "max_num_seqs"),
    ("output", "checkpoint_every"),
]
ARCH = {
    "num_layers": 4,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1024,
    "vocab_size": 1000,
}


@st.composite
def mutated_data(draw: st.DrawFn) -> Any:
    """A base spec (as data) with one to four mutations."""
    spec = copy.deepcopy(draw(st.sampled_from(BASES)))
    if draw(st.integers(0, 4)) == 0:  # an inline architecture with hostile dimensions
        arch = dict(ARCH)
        for key in draw(st.lists(st.sampled_from(sorted(ARCH)), max_size=3)):
            arch[key] = draw(st.one_of(huge_ints, plausible_ints))
        spec["model"] = {"arch": arch, "path": "/models/x"}
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["replace", "delete", "add", "number", "number", "known", "plausible"]))
        if action == "plausible":
            numeric = _numeric_paths(spec)
            if numeric:
                spec = _set(spec, draw(st.sampled_from(numeric)), draw(plausible_ints))
            continue
        if action == "known":
            path = draw(st.sampled_from(NUMERIC_KEYS))
            if not isinstance(spec, dict):
                continue
            node = spec
            for part in path[:-1]:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[path[-1]] = draw(st.one_of(huge_ints, floats, plausible_ints))
            continue
        if action == "number":
            numeric = _numeric_paths(spec)
            if numeric:
                spec = _set(spec, draw(st.sampled_from(numeric)), draw(st.one_of(huge_ints, floats)))
            continue
        path = draw(st.sampled_from(_paths(spec)))
        if action == "replace":
            spec = _set(spec, path, draw(values))
        elif action == "delete" and path:
            spec = _delete(spec, path)
        elif action == "add":
            node = spec
            for part in path:
                node = node[part]
            if isinstance(node, dict):
                node[draw(st.text(min_size=1, max_size=10))] = draw(values)
    return spec


def _bomb(levels: int, width: int, merge: bool) -> str:
    """A billion-laughs document: each level aliases the previous one `width` times."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x]" if not merge else "l0: &l0 {a: 1, b: 2, c: 3}"]
    for i in range(1, levels):
        if merge:
            refs = ", ".join(f"*l{i - 1}" for _ in range(width))
            lines.append(f"l{i}: &l{i} {{<<: [{refs}], k{i}: [{refs}]}}")
        else:
            lines.append(f"l{i}: &l{i} [{', '.join(f'*l{i - 1}' for _ in range(width))}]")
    return "\n".join(lines)


YAML_ATTACKS = [
    "recursive: &r [*r]",
    "recursive: &r {self: *r}",
    "model: &m {name: qwen3-8b, path: /m, arch: *m}",
    _bomb(9, 9, merge=False),
    _bomb(7, 6, merge=True),
    "deep: " + "[" * 200 + "]" * 200,
    "deep: " + "{a: " * 200 + "1" + "}" * 200,
    "cluster: {<<: &c {nodes: 2}, devices_per_node: 8}",
    "name: !!python/object/apply:os.system [echo hi]",
    'name: "a\\0b"',
    'model: {name: qwen3-8b, path: "/models/a\\0b"}',
    'output: {dir: "runs/\\0x"}',
]


@st.composite
def mutated_specs(draw: st.DrawFn) -> tuple[str, str | None, list[str]]:
    """(YAML text, --target, --set overrides) for one hostile spec."""
    data = draw(mutated_data())
    try:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    except yaml.YAMLError:
        text = json.dumps(data, default=str)
    if draw(st.integers(0, 5)) == 0:
        attack = draw(st.sampled_from(YAML_ATTACKS))
        key = attack.split(":", 1)[0]
        kept = [line for line in text.splitlines() if not line.startswith(f"{key}:")]
        text = "\n".join([*kept, attack]) + "\n"
    overrides: list[str] = []
    if draw(st.integers(0, 3)) == 0:
        for _ in range(draw(st.integers(1, 2))):
            path = draw(st.sampled_from([".".join(p) for p in NUMERIC_KEYS] + ["model.path", "output.dir", "name"]))
            overrides.append(f"{path}={draw(override_values)}")
    return text, draw(st.sampled_from(TARGETS)), overrides


# ---------------------------------------------------------------------------------------------- harness


class Hang(BaseException):
    """Raised by the alarm when a case runs past its time limit (a BaseException: no `except Exception` eats it)."""


@dataclass
class Outcome:
    """How one case ended: `kind` is ok | findings | emit-refused | exception | hang | invariant."""

    kind: str
    seconds: float  # wall clock
    detail: str = ""
    codes: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0  # this process's CPU time: what the case cost, whatever else loads the machine


_armed = [False]


def _on_alarm(signum: int, frame: Any) -> None:
    if _armed[0]:
        raise Hang()


def _strict_json(text: str) -> None:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    json.loads(text, parse_constant=refuse)


def _compile(text: str, target: str | None, overrides: list[str]) -> Outcome:
    from rlc.compiler.emit import render_plan_files
    from rlc.compiler.load import load_spec_text
    from rlc.compiler.node_setup import PlanEmitError
    from rlc.compiler.planner import build_plan
    from rlc.compiler.provenance import compute_provenance
    from rlc.compiler.validate import check_loaded

    checked = check_loaded(load_spec_text(text, "fuzz.yaml", target=target, overrides=overrides))
    report = checked.report
    plan = None
    if checked.problem is not None:
        plan, found = build_plan(checked.problem, checked.lines, "fuzz.yaml")
        report.extend(found)
    codes = sorted({d.code for d in report.diagnostics})
    bad = [d for d in report.diagnostics if not (d.code.startswith("RLC") and d.code[3:].isdigit() and d.message)]
    if bad:
        return Outcome("invariant", 0.0, f"diagnostic without a code or message: {bad[0]}", codes)
    if plan is None or not report.ok:
        if checked.problem is not None and plan is None and report.ok:
            return Outcome("invariant", 0.0, "no plan and no error", codes)
        return Outcome("findings", 0.0, "", codes)
    assert checked.problem is not None
    provenance = compute_provenance(checked.problem.spec, overrides, target_given=target is not None)
    try:
        files = render_plan_files(plan, checked.problem.spec, provenance=provenance)
    except PlanEmitError as exc:
        return Outcome("emit-refused", 0.0, str(exc), codes)
    for name, content in files.items():
        if name.endswith(".json"):
            try:
                _strict_json(content.decode())
            except ValueError as exc:
                return Outcome("invariant", 0.0, f"{name}: {exc}", codes)
        if b"\x00" in content:
            return Outcome("invariant", 0.0, f"{name} holds a NUL byte", codes)
    return Outcome("ok", 0.0, "", codes)


def _site(exc: BaseException) -> str:
    """The innermost rlc frame of a traceback (file:line function), where the fuzz reports a failure."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/site-packages/" not in f.filename and not f.filename.endswith("spec_mutants.py")
    ]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"


def run_case(text: str, target: str | None, overrides: list[str], *, limit_s: float = 10.0) -> Outcome:
    """Validate and compile one spec in-process, stopping it after `limit_s` CPU-seconds (main thread only).

    The alarm counts this process's CPU time (ITIMER_PROF), as the tests' bounds do: a loaded machine slows the
    wall clock, not the work, so only a real blow-up trips it."""
    previous = signal.signal(signal.SIGPROF, _on_alarm)
    # Re-fired every 0.2 s: an alarm that lands in a callback that swallows exceptions (gc hooks) is not lost.
    signal.setitimer(signal.ITIMER_PROF, limit_s, 0.2)
    start, cpu_start = time.perf_counter(), time.process_time()
    _armed[0] = True
    try:
        outcome = _compile(text, target, overrides)
    except Hang as exc:
        outcome = Outcome("hang", 0.0, f"over {limit_s:g} CPU-s at {_site(exc)}")
    except Exception as exc:  # what the fuzz looks for
        outcome = Outcome("exception", 0.0, f"{type(exc).__name__} at {_site(exc)}: {str(exc)[:200]}")
    finally:
        _armed[0] = False  # an alarm from here on is ignored, so it cannot escape the harness
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
    outcome.seconds = time.perf_counter() - start
    outcome.cpu_seconds = time.process_time() - cpu_start
    if not math.isfinite(outcome.seconds):
        outcome.seconds = limit_s
    return outcome
