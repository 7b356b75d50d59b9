#!/usr/bin/env bash
# The test suite: set up, then run every test (pass pytest options through, e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
python -m pytest -q "$@"
