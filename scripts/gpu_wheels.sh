#!/usr/bin/env bash
# Fetch, on a machine with a package index, the pure-Python wheels that scripts/gpu_check.sh installs on a
# GPU machine without one (it has torch, triton, numpy, transformers, tokenizers, safetensors, jinja2, tqdm,
# rich, prometheus-client and hypothesis already). Keep .whl/ out of git: `echo /.whl/ >> .git/info/exclude`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    gguf==0.19.0
ls .whl
