"""The spec's JSON Schema as text, and the committed copy that editors point at."""

from __future__ import annotations

import json
from importlib import resources

from rlc.schemas.spec import spec_json_schema

SCHEMA_FILE = "spec.schema.json"


def schema_text() -> str:
    """Deterministic JSON text of the schema (sorted keys, trailing newline)."""
    return json.dumps(spec_json_schema(), indent=2, sort_keys=True) + "\n"


def committed_schema_text() -> str:
    return resources.files("rlc.schemas").joinpath(SCHEMA_FILE).read_text()
