#!/usr/bin/env bash
# The CPU quickstart: set up, compile examples/quickstart.yaml, and run it (a few minutes on two cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
rlc validate examples/quickstart.yaml
rlc compile examples/quickstart.yaml -o runs/quickstart/plan
rlc run runs/quickstart/plan "$@"
