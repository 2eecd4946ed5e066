#!/usr/bin/env bash
# The GPU checks in one run, for a GPU machine with no network that has torch, Triton and
# transformers: the wheels it lacks (pyzmq, llguidance, jsonschema-rs, pytest-asyncio for
# Python 3.12, from `pip download --no-deps --only-binary=:all:`) are installed from .whl/:
# every GPU test, then bench/engine_gpu.py on the shapes named in $GPU_SHAPES, each step cut
# off so the whole run ends inside $GPU_BUDGET seconds. Logs go to $OUT (or ./gpu-out).
#
#   bash scripts/gpu-check.sh                    # tests, then the 1B, Qwen3-30B-A3B, 8B shapes
#   GPU_SHAPES=qwen3-8b GPU_TESTS=0 bash scripts/gpu-check.sh
#   GPU_TEST_ARGS=tests/gpu/test_models_gpu.py GPU_SHAPES= bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
BUDGET=${GPU_BUDGET:-540}
SHAPES=${GPU_SHAPES-1b qwen3-30b-a3b 8b}
START=$SECONDS
mkdir -p "$OUT"

left() { echo $((BUDGET - (SECONDS - START))); }

site=/tmp/dpserve-site
mkdir -p "$site"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
fi
ln -sfn "$PWD/dpserve" "$site/dpserve"
# The engine processes a bench starts import dpserve from here; PYTHONSAFEPATH keeps the
# repository root (whose operator/ shadows the standard library's module) off their path.
export PYTHONPATH=$site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DPSERVE_CPU_KERNELS=0  # nothing here runs the CPU path: no C++ build

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__)'
  git log -1 --format='commit %h %s' 2>/dev/null || true
} | tee "$OUT/machine.txt"

if [ "${GPU_TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086  # GPU_TEST_ARGS is a list of pytest arguments
  timeout $(($(left) - 60)) python3 -m pytest -q -p no:cacheprovider -o timeout=240 -rfEs \
    ${GPU_TEST_ARGS:-tests/gpu tests/unit/test_gpu_engine.py tests/unit/test_llama_warm_up.py \
    tests/unit/test_overlap.py tests/unit/test_paged_batch.py} 2>&1 | tee "$OUT/tests.log"
  echo "tests: exit ${PIPESTATUS[0]}, $((SECONDS - START)) s in"
fi

for shape in $SHAPES; do
  budget=$(left)
  if [ "$budget" -lt 60 ]; then
    echo "skipped the $shape shape: ${budget} s left" | tee -a "$OUT/bench.log"
    continue
  fi
  skip="--skip static"
  case $shape in 8b | qwen3-8b) skip="$skip --skip stack" ;; esac
  timeout $((budget - 10)) python3 bench/engine_gpu.py --shape "$shape" $skip 2>&1 |
    grep -v Warning | tee -a "$OUT/bench.log"
  echo "$shape: exit ${PIPESTATUS[0]}, $((SECONDS - START)) s in" | tee -a "$OUT/bench.log"
done
