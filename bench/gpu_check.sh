#!/usr/bin/env bash
# The CUDA path on a real GPU (issue 46), in one call of a lent GPU machine, which has no registry:
#
#   make gpu-wheels        here, once: pyml's dependencies that machine's image lacks, into .whl/
#   then, on the machine:  bash bench/gpu_check.sh [environment] [tests] [speed]   (carry .whl)
#
# Stages, all three by default, in this order:
#   environment  the GPU, driver and package versions            -> $OUT/environment.txt
#   tests        the CUDA case files (tests/cuda/*_cases.py) on the device, not the simulator
#                (PYML_CUDA_TARGET=device, tests/support/cuda_target.py), each file in a pytest
#                process of its own, all at once                  -> $OUT/cuda-tests.log
#   speed        bench/gpu_step.py: the training step and decoding against PyTorch eager on the
#                same GPU and pyml on the same CPU                 -> $OUT/gpu_step.{md,json,log}
# $OUT/summary.md gathers each stage's outcome and the speed table. Each stage runs under a time
# limit (TESTS_TIMEOUT, SPEED_TIMEOUT seconds), so one call returns what finished. The exit status
# is the number of stages that failed.
#
# On a machine without a GPU the same script checks itself under Numba's CUDA simulator:
#   PYML_CUDA_TARGET=simulator PYTHON=.venv/bin/python WHEELS= CUDA_CASES=conformance_cuda_cases.py \
#     GPU_STEP_ARGS="--spec llama_tiny --batches 1x2 --cpu-batches 1x2 --steps 1 --warmup 1 \
#     --torch-device cpu --decode-devices cpu --new-tokens 8" SPEED_TIMEOUT=600 bash bench/gpu_check.sh
# (the simulator runs every GPU thread in Python: about 4 minutes for this llama_tiny step)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/pyml-gpu-check}
PYTHON=${PYTHON:-python3}
STAGES=${*:-environment tests speed}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-330}
SPEED_TIMEOUT=${SPEED_TIMEOUT:-210}
CUDA_CASES=${CUDA_CASES:-fuzz_cuda_cases.py generated_cuda_sim_cases.py cuda_sim_cases.py conformance_cuda_cases.py quantized_decode_cuda_cases.py}
GPU_STEP_ARGS=${GPU_STEP_ARGS:-}
WHEELS=${WHEELS-.whl}  # empty: install nothing (a machine that has pyml's dependencies)
export PYML_CUDA_TARGET=${PYML_CUDA_TARGET:-device}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.md
echo "# bench/gpu_check.sh, $(date -u +%FT%TZ), target $PYML_CUDA_TARGET, stages: $STAGES" >"$SUMMARY"

# pyml runs from this checkout (no install); the carried wheels go to a folder of their own,
# ahead of the image's site-packages
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pyml-wheels "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1 \
    || { echo "could not install $WHEELS/ (pip's output: wheels.log)" | tee -a "$SUMMARY"; exit 9; }
  export PYTHONPATH=/tmp/pyml-wheels
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/pyml-gpu-numba-cache} PYML_CACHE=${PYML_CACHE:-/tmp/pyml-gpu-cache}

failed=0
stage_result() {  # stage name, exit status, seconds
  local outcome=passed
  if [ "$2" -eq 124 ]; then outcome="stopped at its time limit"; elif [ "$2" -ne 0 ]; then outcome="failed (exit $2)"; fi
  [ "$2" -eq 0 ] || failed=$((failed + 1))
  echo "- $1: $outcome, $3 s" | tee -a "$SUMMARY"
}

for stage in $STAGES; do
  started=$SECONDS
  case $stage in
  environment)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
      "$PYTHON" --version
      "$PYTHON" - <<'EOF'
import importlib.metadata as metadata
for name in ("numpy", "numba", "numba-cuda", "llvmlite", "cupy-cuda13x", "cupy-cuda12x", "torch",
             "transformers", "pydantic", "gguf", "hypothesis", "pytest", "ruff"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "absent")
import numba.cuda
print("numba.cuda implementation:", getattr(numba.cuda, "implementation", "?"), "available:", numba.cuda.is_available())
import pyml  # the checkout's, with the carried wheels
print("pyml imports from", pyml.__file__)
EOF
    } >"$OUT/environment.txt" 2>&1
    stage_result environment $? $((SECONDS - started))
    ;;
  tests)
    logs=$(mktemp -d)
    cases_files=($CUDA_CASES)
    pids=()
    for cases in "${cases_files[@]}"; do
      timeout "$TESTS_TIMEOUT" "$PYTHON" -m pytest -q -rfE --durations=5 -p no:cacheprovider "tests/cuda/$cases" \
        >"$logs/$cases.log" 2>&1 &
      pids+=($!)
    done
    status=0
    : >"$OUT/cuda-tests.log"  # one file: the device tool brings back at most 8
    for index in "${!pids[@]}"; do
      wait "${pids[$index]}"
      code=$?
      cases=${cases_files[$index]}
      { echo "===== $cases: exit $code"; cat "$logs/$cases.log"; } >>"$OUT/cuda-tests.log"
      echo "  - $cases: $(tail -n 1 "$logs/$cases.log") (exit $code)" >>"$SUMMARY"
      [ "$code" -eq 0 ] || status=$code
    done
    stage_result tests "$status" $((SECONDS - started))
    ;;
  speed)
    # shellcheck disable=SC2086  # GPU_STEP_ARGS is a list of arguments
    timeout "$SPEED_TIMEOUT" "$PYTHON" bench/gpu_step.py --out "$OUT" $GPU_STEP_ARGS >"$OUT/gpu_step.log" 2>&1
    code=$?
    [ -f "$OUT/gpu_step.md" ] && cat "$OUT/gpu_step.md" >>"$SUMMARY"
    stage_result speed "$code" $((SECONDS - started))
    ;;
  *)
    echo "unknown stage '$stage' (expected environment, tests or speed)" | tee -a "$SUMMARY"
    exit 9
    ;;
  esac
done
cat "$SUMMARY"
exit "$failed"
