#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine with no network (torch and triton preinstalled):
# install what is missing from wheels carried in .whl/ (scripts/gpu_wheels.sh fetches them), run every
# GPU test, the GPU benchmarks and the overlap probe, and write logs and tables to $OUT (results/ when $OUT
# is unset). The probe runs before bench_gpu_ssd: it saves its verdict (how to arrange the GPU between the
# target and the speculator, saguaro/ssd/lane_profile.py) and the SSD table's "auto" rows run with it. Each step
# has its own time limit, sized for a cold machine (Triton compiles every kernel specialization on first use;
# the cache in .triton_cache/ serves later runs on the same machine), so the whole check ends within 11 minutes:
# set-up ~20 s, GPU tests 170 s, bench_gpu 110 s, overlap probe 70 s, bench_gpu_ssd 240 s (limits; on an H200
# the GPU tests took 114 s, bench_gpu 30 s, the probe 10 s, bench_gpu_ssd's batch-1 table with both builds 52 s). A failing step does not stop the ones after it, and the exit status says whether any
# failed (an SSD row whose speculator failed fails its step). bench_gpu_ssd writes its measured table
# before its projections, so a step cut short by its limit still leaves that table.
#
#   GPU_CHECK_STEPS=gpu_tests,bench_gpu_ssd scripts/gpu_check.sh
#                                    only the steps named (gpu_tests, bench_gpu, overlap_probe, bench_gpu_ssd):
#                                    a rerun after a fix, inside a short lease
#   scripts/gpu_check.sh --dry-run   everything that needs no CUDA, on any machine: imports every benchmark
#                                    module and collects the GPU tests with only the GPU machine's packages
#                                    importable (scripts/gpu_env), failing if fewer tests are collected than
#                                    are marked gpu (tests/test_gpu_check.py runs it in CI)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

collect_gpu_tests() {  # collect_gpu_tests PATH...: the number of gpu-marked tests pytest collects there
    local listing
    listing=$(python3 -m pytest -o addopts= --collect-only -q -m gpu -p no:cacheprovider "$@" 2>&1)
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "$listing" | tail -40 >&2
        echo "collection failed (exit $rc)" >&2
        return 1
    fi
    echo "$listing" | grep -c "::"
}

dry_run() {  # SAGUARO_GPU_TESTS: the test folder (tests/; the negative control plants one elsewhere)
    local marked expected got tests_dir=${SAGUARO_GPU_TESTS:-tests}
    # every module the check or its benchmarks import, as the GPU machine would import it
    echo "== imports (GPU machine's packages only)"
    PYTHONPATH=$PWD/scripts/gpu_env:$PWD python3 -c "
import importlib, pathlib
for p in sorted(pathlib.Path('benchmarks').glob('*.py')):
    importlib.import_module('benchmarks.' + p.stem)
from benchmarks.gpu_overlap import configurations, parse_args
assert len(configurations(parse_args([]))) == 8
from benchmarks.bench_gpu_ssd import parse_args as ssd_args
assert ssd_args(['--ssd', '4:last3', '--builds', 'python,graph']).builds == ['python', 'graph']
assert ssd_args(['--priorities', 'auto,off,on']).priorities == ['auto', 'off', 'on']
print('imported', len(list(pathlib.Path('benchmarks').glob('*.py'))), 'benchmark modules')" || return 1
    marked=$(grep -l "mark\.gpu" "$tests_dir"/*.py)
    expected=$(PYTHONPATH=$PWD collect_gpu_tests $marked) || return 1
    echo "== collection: $expected tests marked gpu (with every package installed)"
    got=$(PYTHONPATH=$PWD/scripts/gpu_env:$PWD PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 collect_gpu_tests "$tests_dir") || return 1
    echo "== collection: $got gpu tests collected with the GPU machine's packages only"
    if [ "$got" -lt "$expected" ]; then
        echo "FAILED: $got of $expected gpu tests collected on the GPU machine's packages" >&2
        return 1
    fi
    echo "dry run passed"
}

if [ "${1:-}" = "--dry-run" ]; then
    dry_run
    exit $?
fi

OUT=${OUT:-results}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}  # git-ignored; kept on a machine between runs
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember a failure
    local name=$1 limit=$2; shift 2
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then
        echo "== $name: skipped (GPU_CHECK_STEPS=$GPU_CHECK_STEPS)"
        return
    fi
    echo "== $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$OUT/machine.txt" 2>&1
step gpu_tests 170 python3 -m pytest -o addopts= -o faulthandler_timeout=45 -q -m gpu -p no:cacheprovider -rs tests
step bench_gpu 110 python3 -m benchmarks.bench_gpu --shapes qwen2.5-1.5b --max-tokens 64 --sd-k 3,4 \
    --out "$OUT"
# a verification graph beside draft graphs on two streams of one process, under its own watchdog: stream
# priorities off and on, the draft on all SMs and in green contexts of 16, 32 and 66 SMs; its verdict is saved
# as the engine's arrangement on this card (the cache's profiles/lanes__<card>.json)
step overlap_probe 70 python3 -m benchmarks.gpu_overlap --reps 10 --watchdog-s 60 --out "$OUT"
# SSD against SD and AR on the synthetic Qwen2.5 1.5B pair (colocated speculator thread), 8 prompts x 256 tokens,
# with the speculator's Python build and its graph build, each in the probe's arrangement (auto) and with stream
# priorities off and on on all SMs (torch calls per build and device reads per round counted in a short run after
# each), Thm 2 against the measurement, every configuration again at batch 8, and projections from the real
# pair's profile (results/profile_qwen2.5-coder_code.json, tracked)
step bench_gpu_ssd 240 python3 -m benchmarks.bench_gpu_ssd --shape qwen2.5-1.5b --prompts 8 --max-tokens 256 \
    --sd-k 3,4 --ssd "4:last3" --builds python,graph --priorities auto,off,on --batches 1,8 --reps 10 \
    --project qwen2.5-1.5b:qwen2.5-0.5b --out "$OUT"
exit $status
