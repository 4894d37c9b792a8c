#!/usr/bin/env bash
# One lent GPU machine, one call: the GPU tests, short quickstart runs on CUDA, and the
# real recipe's step budget at 135M.
#
# Made for the workplace's `device` tool (a bare machine with a CUDA torch and no
# package index): the packages it lacks (pydantic, pyzmq, cachetools, megatron-core)
# travel as cp312 wheels in .whl/ (`pip download --no-deps --only-binary=:all:
# --python-version 3.12 ...`) and go to /tmp/site. Ray and vLLM are too large to travel,
# so their tests skip and the runs use the local launcher. SmolLM2's weights are too
# large to travel too (538 MB): `real` builds a random init of the same shapes from
# .gpu_model/ (its config, tokenizer and shapes.json, made here by
# `python tests/gpu/random_model.py --out .gpu_model`) and runs configs/smollm2.yaml with it.
#   run: bash tests/gpu/device_check.sh [tests] [quickstarts] [real]   (carry: .whl .gpu_model)
#   (no argument: all three; the real recipe runs first). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
parts=${*:-tests quickstarts real}
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

run() {  # config, name, time limit (s), then --set pairs: a run on CUDA under the local launcher
  local config=$1 name=$2 limit=$3; shift 3
  echo "== run $name"
  local args=()
  for kv in "$@"; do args+=(--set "$kv"); done
  rm -rf "/tmp/runs/$name"
  timeout "$limit" python3 -m areal_like.orchestration.cli run "$config" \
    --set cluster.launcher=local --set train.backend.device=cuda --set cluster.train_pool.num_gpus=1 \
    --set run.dir="/tmp/runs/$name" "${args[@]}" 2>&1 | tail -25 | tee "$OUT/run_$name.log"
  echo "rc=${PIPESTATUS[0]}"
}

if [[ $parts == *real* ]]; then
  # The real recipe's work (4 prompts x 4 answers of 16 tokens, 135M) on one GPU: taking
  # turns with the engine on the GPU (fp32 as shipped, and bf16), and as two pools with the
  # engine on 8 of the host's cores (two pools on the GPU would need a GPU each). A random
  # init answers nothing right, so uniform groups are kept (else no group would ever reach
  # the trainer); the work per step is the same.
  python3 tests/gpu/random_model.py --from .gpu_model --out /tmp/smollm2-rand || exit 1
  real=(model.path=/tmp/smollm2-rand staleness.filter_uniform_groups=false train.total_steps=30)
  run configs/smollm2.yaml real_colocate 120 "${real[@]}" cluster.colocate=true rollout.engine.device=cuda \
    model.dtype=float32
  run configs/smollm2.yaml real_colocate_bf16 120 "${real[@]}" cluster.colocate=true rollout.engine.device=cuda \
    model.dtype=bfloat16
  run configs/smollm2.yaml real_two_pools 180 "${real[@]}" cluster.rollout_pool.num_cpus=8 rollout.engine.threads=8
  names=(real_colocate real_colocate_bf16 real_two_pools)
  for n in "${names[@]}"; do
    python3 -m areal_like.orchestration.cli report "/tmp/runs/$n" --budget-steps 5:30 > "/tmp/runs/$n/report_stdout.txt" 2>&1
  done
  tar czf "$OUT/real_runs.tgz" -C /tmp/runs --exclude='checkpoints' --exclude='final' --exclude='*.safetensors' \
    "${names[@]}"
fi

if [[ $parts == *tests* ]]; then
  echo "== GPU tests"
  timeout 240 python3 -m pytest -q -rs -m gpu tests/gpu -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 \
    | tee "$OUT/gpu_tests.log"
fi

if [[ $parts == *quickstarts* ]]; then
  # The trainer on the GPU, the embedded engine on CPU: weights from CUDA staged over gloo.
  run configs/quickstart.yaml two_pools 110 train.total_steps=10
  # Both on one GPU, taking turns (cluster.colocate): the trainer offloads between steps.
  run configs/quickstart.yaml colocate 110 train.total_steps=10 cluster.colocate=true rollout.engine.device=cuda
  # Megatron on the GPU (its DDP and distributed optimizer), the engine on CPU.
  run configs/quickstart.yaml megatron 110 train.total_steps=10 train.backend.type=megatron
  for n in two_pools colocate megatron; do cp "/tmp/runs/$n/metrics.jsonl" "$OUT/metrics_$n.jsonl" 2>/dev/null; done
fi
