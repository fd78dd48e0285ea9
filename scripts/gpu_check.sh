#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine with no network (torch and triton preinstalled):
# install what is missing from wheels carried in .whl/ (scripts/gpu_wheels.sh fetches them), run every
# GPU test, then the GPU benchmarks, and write logs and tables to $OUT (results/ when $OUT is unset).
# Each step has its own time limit so the whole check ends within 8 minutes (set-up ~20 s, GPU tests
# 140 s, bench_gpu 160 s, bench_gpu_ssd 150 s); a failing step does not stop the ones after it, and the exit
# status says whether any failed. bench_gpu_ssd writes its measured table before its projections, so a step
# cut short by its limit still leaves that table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember a failure
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$OUT/machine.txt" 2>&1
step gpu_tests 140 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests
step bench_gpu 160 python3 -m benchmarks.bench_gpu --shapes qwen2.5-1.5b,llama-3.1-8b --max-tokens 64 \
    --out "$OUT"
# SSD against SD and AR on the synthetic Qwen2.5 1.5B pair (colocated speculator thread), Thm 2 against the
# measurement, and projections from the real pair's profile (results/profile_qwen2.5-coder_code.json, tracked)
step bench_gpu_ssd 150 python3 -m benchmarks.bench_gpu_ssd --shape qwen2.5-1.5b --prompts 2 --max-tokens 96 \
    --sd-k 2,3,4,5 --ssd "3:last3;4:last3;4:last3@2" --reps 10 --out "$OUT"
exit $status
