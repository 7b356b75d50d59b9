#!/usr/bin/env bash
# The test suite: set up, then run every test (pass pytest options through, e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
# Two workers, one test file each at a time (a file's engines and clusters are shared by its tests): on two cores
# the slow tests leave a core idle while they wait on start-ups, so this runs the suite ~1.4x faster.
# RLC_TEST_WORKERS=0 runs everything in this process. The 25 slowest tests are listed at the end.
python -m pytest -q -n "${RLC_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
