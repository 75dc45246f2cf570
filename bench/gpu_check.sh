#!/usr/bin/env bash
# The GPU check of the fast paths (issue 13), one call of at most 10 minutes on one CUDA GPU:
#   1. the Triton kernel tests natively on the GPU (tests/unit/test_kernels.py) and tests/gpu/: fla chunk_kda
#      against the CPU reference in fp32, grouped GEMM (bf16) against the loop, cuBLAS FP8 against the CPU's
#      FP8 GEMM, the recipe rules, each FP8 engine (torch._scaled_grouped_mm; Transformer Engine's grouped
#      GEMM for every recipe TE runs here) against the CPU emulation, forward and both gradients, a 20-step
#      training per FP8 engine and recipe against bf16, and bf16 against float32;
#   2. tests/distributed/test_fp8.py (each recipe's relative error against fp32, on the CPU numerics);
#   3. a 20-step smoke training (launch.train, configs/smoke.yaml, bf16) with precision.fp8=tensorwise;
#   4. bench/step_time.py: the probe config's (configs/probe_step_time.yaml: full-width layers at one GPU's
#      size) measured step time beside the dry run's prediction for the GPU;
#   5. bench/fast_paths.py: fused SiTU-GLU vs eager, permute kernels vs eager, grouped GEMM vs the loop,
#      FP8 (each recipe x engine) vs bf16 expert GEMM at 7 local experts of 3072 x 3584, TFLOP/s vs a plain
#      bf16 matmul, each recipe's error vs bf16.
# Transformer Engine comes from the image (NGC PyTorch); without it the TE rows and tests say so and skip.
# It prints one table last: each step's result and seconds, then the benches' rows. Logs: $LOGS (default
# runs/gpu_check/, or $OUT where the device tool sets it); the smoke run's directory: runs/gpu_check/.
#
# Packages the GPU machine lacks (fla-core, megatron-core; pip cannot reach an index there) travel as wheels:
# on a machine with PyPI run `bench/gpu_check.sh --fetch-wheels` (writes .whl/, git-ignored), carry .whl.
# Usage: bench/gpu_check.sh [--fetch-wheels]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(fla-core==0.6.0 megatron-core==0.16.1)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    exit $?
fi

LOGS=${LOGS:-${OUT:-runs/gpu_check}}
mkdir -p "$LOGS"
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu-check-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name())" \
    || exit 1
"$PY" -c "import transformer_engine as te; print('transformer_engine', te.__version__)" 2>/dev/null \
    || echo "transformer_engine: not importable (its rows and tests skip)"

results=()
step() {  # step NAME SECONDS_LIMIT COMMAND...: run with a time limit, log to $LOGS/NAME.log, record the outcome
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    results+=("$(printf '%-28s %-10s %4ss' "$name" "$([[ $rc == 0 ]] && echo pass || echo "FAIL($rc)")" $(( $(date +%s) - start )))")
}

step gpu-tests 170 "$PY" -m pytest -v --timeout 90 -p no:cacheprovider tests/unit/test_kernels.py tests/gpu
rm -rf runs/gpu_check/smoke-fp8  # a fresh run each time, not a resume of the last check
step smoke-fp8-tensorwise 90 "$PY" -m launch.train --config configs/smoke.yaml train.steps=20 train.dtype=bfloat16 \
    precision.fp8=tensorwise logging.progress=false train.run_dir=runs/gpu_check/smoke-fp8 --require-loss-drop 1.0
cp runs/gpu_check/smoke-fp8/metrics.jsonl "$LOGS/smoke-fp8-metrics.jsonl" 2>/dev/null
step step-time 110 "$PY" bench/step_time.py --steps 6 --warmup 2 --measure-only
step fast-path-bench 60 "$PY" bench/fast_paths.py
step fp8-recipe-errors 30 "$PY" -m pytest -q -p no:cacheprovider tests/distributed/test_fp8.py -k "recipe or tensorwise or outlier"

echo
echo "== GPU check: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(), "torch", torch.__version__)') =="
printf '%s\n' "${results[@]}"
grep -h "fast paths:" "$LOGS/smoke-fp8-tensorwise.log" | head -1 | sed 's/^.*fast paths:/fast paths:/'
grep -h "first loss" "$LOGS/smoke-fp8-tensorwise.log" | tail -1 | sed 's/^.*first loss/smoke: first loss/'
grep -h "^measured\|^predicted\|^  fast paths" "$LOGS/step-time.log"
sed -n '/^expert fast paths on/,$p' "$LOGS/fast-path-bench.log"
