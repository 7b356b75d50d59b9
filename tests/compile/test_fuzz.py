"""Property-based: hostile specs through validate and compile in-process end as diagnostics, quickly.

The mutants (`spec_mutants`) are the examples and goldens with extreme numbers, infinities, NUL bytes, odd
structures, YAML alias/merge bombs and recursive aliases, and `--set` overrides. Every one must end as a
plan or as diagnostics with a code: no exception, no invariant break (strict JSON, no NUL in any file), and
no blow-up (none over 10 CPU-seconds). About a minute in all; `scripts/fuzz_specs.py` runs many more.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_mutants import BLOWUP_CPU_S, mutated_specs, run_case

from rlc.compiler.validate import check_text


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_specs())
def test_mutated_specs_validate_and_compile_without_crashing(case: tuple[str, str | None, list[str]]) -> None:
    text, target, overrides = case
    outcome = run_case(text, target, overrides, limit_s=10)
    assert outcome.kind in ("ok", "findings"), outcome
    assert outcome.cpu_seconds < BLOWUP_CPU_S, outcome  # CPU time: a loaded CI machine does not make it fail
    assert all(code.startswith("RLC") for code in outcome.codes)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise(raw: bytes) -> None:
    check_text(raw, "bytes.yaml")


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_random_text_never_raises(text: str) -> None:
    check_text(text, "text.yaml")
