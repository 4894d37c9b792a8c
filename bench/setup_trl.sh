#!/usr/bin/env bash
# Idempotent: .venv-trl with the CPU build of torch 2.13.0, TRL and this project (editable),
# for bench/vs_trl.py. torch is pinned in every install command so pip never swaps in
# a CUDA build while resolving TRL's dependencies.
#   bash bench/setup_trl.sh          (TRL_SPEC=trl==X.Y.Z to choose another TRL)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
TRL_SPEC="${TRL_SPEC:-trl==1.16.0}"
VENV=.venv-trl
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
want="$(cat pyproject.toml bench/setup_trl.sh | sha256sum | cut -c1-16)-${TRL_SPEC}"
stamp="$VENV/.setup_trl"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "[setup_trl] $VENV is up to date"
  exit 0
fi
cons="$(mktemp)"
trap 'rm -f "$cons"' EXIT
echo "$TORCH_PIN" > "$cons"
pip_() { "$VENV/bin/python" -m pip install -q -c "$cons" "$@"; }
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
echo "[setup_trl] installing $TORCH_PIN"
pip_ "$TORCH_PIN"
echo "[setup_trl] installing $TRL_SPEC"
pip_ "$TORCH_PIN" "$TRL_SPEC" psutil
echo "[setup_trl] installing areal_like (editable)"
pip_ "$TORCH_PIN" -e .
"$VENV/bin/python" -c "import torch, trl, transformers, areal_like; print('[setup_trl] torch', torch.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$stamp"
