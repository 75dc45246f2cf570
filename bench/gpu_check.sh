#!/usr/bin/env bash
# The GPU check: one call of under 8 minutes on one CUDA GPU (its steps' limits add up to 470 s), in the order that
# pays most if the call is cut short.
#   1. What has never run on a GPU, each under its own limit: our Triton kernels natively (tests/unit/test_kernels.py:
#      the AttnRes mix, RMSNorm / the L2 norms, the short convolution, SiTU-GLU, permute), fla's chunk KDA through
#      our custom ops in fp32 and bf16 (tests/gpu/test_fla_kda.py), the FlexAttention backward
#      (tests/gpu/test_flex_attention_gpu.py), the paired 1F1B step on the autograd device thread
#      (tests/gpu/test_paired_passes_gpu.py).
#   2. The calibration (bench/calibrate.py): GEMM and grouped-GEMM shapes the 8K step runs, HBM bandwidth, launch
#      times, written as a table of this card ($LOGS/calibration.yaml, for launch.dryrun --calibration).
#   3. One warmed step of the probe config profiled by component beside the dry run's estimate (from the table just
#      measured) and bound (bench/step_profile.py).
#   4. Trainings and the rest: the other GPU tests, a 20-step FP8 smoke training, the probe's step time
#      (bench/step_time.py), the expert fast paths (bench/fast_paths.py).
# fla's autotuned kernels read pinned configs where gpu_kernels/kda/fla_configs/ holds them (FLA_CACHE_MODE=default,
# FLA_CONFIG_DIR), so that nothing autotunes; Triton's cache goes under the output folder ($LOGS/triton-cache).
# Logs: $LOGS (default runs/gpu_check/, or $OUT where the device tool sets it). It prints one table last.
#
# Packages the GPU machine lacks (fla-core, megatron-core; pip cannot reach an index there) travel as wheels:
# on a machine with PyPI run `bench/gpu_check.sh --fetch-wheels` (writes .whl/, git-ignored), carry .whl.
# `bench/gpu_check.sh --dry` runs every step's code path this machine can on its CPU (the Triton kernels under the
# interpreter, the calibration and the profile at small sizes, a 2-step smoke training): the script's plumbing,
# no GPU figure.
# Usage: bench/gpu_check.sh [--fetch-wheels | --dry]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && PY=.venv/bin/python
WHEELS=(fla-core==0.6.0 megatron-core==0.16.1)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    exit $?
fi
DRY=0
[[ "${1:-}" == "--dry" ]] && DRY=1

LOGS=${LOGS:-${OUT:-runs/gpu_check}}
mkdir -p "$LOGS"
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu-check-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$PWD/$LOGS/triton-cache"
if [[ -d gpu_kernels/kda/fla_configs ]]; then
    export FLA_CACHE_MODE=default FLA_CONFIG_DIR="$PWD/gpu_kernels/kda/fla_configs"
    FLA_NOTE="fla: pinned configs ($FLA_CONFIG_DIR), no autotuning"
else
    FLA_NOTE="fla: no pinned configs in gpu_kernels/kda/fla_configs: fla autotunes at its first step"
fi
if (( DRY )); then
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
    "$PY" -c "import torch; print('dry run on the CPU: torch', torch.__version__)" || exit 1
    PROFILE_ARGS=(--dry) CALIBRATE_ARGS=(--dry --out "$LOGS")
else
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name())" \
        || exit 1
    "$PY" -c "import transformer_engine as te; print('transformer_engine', te.__version__)" 2>/dev/null \
        || echo "transformer_engine: not importable (its rows and tests skip)"
    PROFILE_ARGS=(--calibration "$LOGS/calibration.yaml") CALIBRATE_ARGS=(--out "$LOGS")
fi
echo "$FLA_NOTE"

results=()
step() {  # step NAME SECONDS_LIMIT COMMAND...: run with a time limit, log to $LOGS/NAME.log, record the outcome
    local name=$1 limit=$(( DRY ? 4 * $2 : $2 )) start rc  # a CPU runs the dry plumbing slower than a GPU its step
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    results+=("$(printf '%-26s %-10s %4ss' "$name" "$([[ $rc == 0 ]] && echo pass || echo "FAIL($rc)")" $(( $(date +%s) - start )))")
}
PYTEST=("$PY" -m pytest -v -p no:cacheprovider --timeout 120)

# 1. What never ran on a GPU.
step kernels-native 60 "${PYTEST[@]}" tests/unit/test_kernels.py
step fla-custom-ops 50 "${PYTEST[@]}" tests/gpu/test_fla_kda.py
step flex-backward 40 "${PYTEST[@]}" tests/gpu/test_flex_attention_gpu.py
step paired-1f1b 40 "${PYTEST[@]}" tests/gpu/test_paired_passes_gpu.py
# 2. The calibration of this card.
step calibrate 50 "$PY" bench/calibrate.py "${CALIBRATE_ARGS[@]}"
# 3. One step by component: measured, estimate, bound.
step step-profile 80 "$PY" bench/step_profile.py "${PROFILE_ARGS[@]}"
# 4. Trainings last.
rm -rf runs/gpu_check/smoke  # a fresh run each time, not a resume of the last check
if (( DRY )); then
    step smoke-bf16 60 "$PY" -m launch.train --config configs/smoke.yaml train.steps=2 train.dtype=bfloat16 \
        logging.progress=false train.run_dir=runs/gpu_check/smoke
else
    step gpu-tests 45 "${PYTEST[@]}" tests/gpu --deselect tests/gpu/test_fla_kda.py \
        --deselect tests/gpu/test_flex_attention_gpu.py --deselect tests/gpu/test_paired_passes_gpu.py
    step smoke-fp8-tensorwise 40 "$PY" -m launch.train --config configs/smoke.yaml train.steps=20 \
        train.dtype=bfloat16 precision.fp8=tensorwise logging.progress=false train.run_dir=runs/gpu_check/smoke \
        --require-loss-drop 1.0
    cp runs/gpu_check/smoke/metrics.jsonl "$LOGS/smoke-metrics.jsonl" 2>/dev/null
    step step-time 40 "$PY" bench/step_time.py --steps 5 --warmup 2 --measure-only
    step fast-path-bench 25 "$PY" bench/fast_paths.py
fi

echo
echo "== GPU check$( (( DRY )) && echo ' (--dry: the plumbing on this CPU, no GPU figure)'): $FLA_NOTE =="
printf '%s\n' "${results[@]}"
sed -n '/^one step of/,$p' "$LOGS/step-profile.log"
grep -h "^copy:" "$LOGS/calibrate.log"
(( DRY )) && exit 0
grep -h "fast paths:" "$LOGS/smoke-fp8-tensorwise.log" | head -1 | sed 's/^.*fast paths:/fast paths:/'
grep -h "^measured\|^predicted\|^  fast paths" "$LOGS/step-time.log"
sed -n '/^expert fast paths on/,$p' "$LOGS/fast-path-bench.log"
