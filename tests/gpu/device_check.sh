#!/usr/bin/env bash
# One lent GPU machine, one call: the GPU tests plus two short quickstart runs on CUDA.
#
# Made for the workplace's `device` tool (a bare machine with a CUDA torch and no
# package index): the packages it lacks (pydantic, pyzmq, cachetools, megatron-core)
# travel as cp312 wheels in .whl/ (`pip download --no-deps --only-binary=:all:
# --python-version 3.12 ...`) and go to /tmp/site. Ray and vLLM are too large to travel,
# so their tests skip and the runs use the local launcher.
#   run: bash tests/gpu/device_check.sh   (carry: .whl)   results land in $OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
if PYTHONPATH=/tmp/site python3 -c 'import pydantic, zmq, cachetools, megatron.core' 2>/dev/null; then
  export PYTHONPATH=/tmp/site:$PWD  # installed already (a caller running other work beside this)
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

echo "== GPU tests"
timeout 300 python3 -m pytest -q -rs -m gpu tests/gpu -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 \
  | tee "$OUT/gpu_tests.log"

run() {  # name, then --set pairs: a short quickstart on CUDA under the local launcher
  local name=$1; shift
  echo "== run $name"
  local args=()
  for kv in "$@"; do args+=(--set "$kv"); done
  rm -rf "/tmp/runs/$name"
  timeout 110 python3 -m areal_like.orchestration.cli run configs/quickstart.yaml \
    --set cluster.launcher=local --set train.backend.device=cuda --set train.total_steps=10 \
    --set run.dir="/tmp/runs/$name" "${args[@]}" 2>&1 | tail -25 | tee "$OUT/run_$name.log"
  echo "rc=${PIPESTATUS[0]}"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null || true
}
# The trainer on the GPU, the embedded engine on CPU: weights from CUDA staged over gloo.
run two_pools cluster.train_pool.num_gpus=1
# Both on one GPU, taking turns (cluster.colocate): the trainer offloads between steps.
run colocate cluster.colocate=true cluster.train_pool.num_gpus=1 rollout.engine.device=cuda
# Megatron on the GPU (its DDP and distributed optimizer), the engine on CPU.
run megatron cluster.train_pool.num_gpus=1 train.backend.type=megatron
