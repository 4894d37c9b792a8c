#!/usr/bin/env bash
# Idempotent environment setup: .venv with the CPU build of torch (unless a GPU is
# present) and this project installed editable with the extras asked for.
#   scripts/setup.sh            -> runtime deps
#   EXTRAS=dev scripts/setup.sh -> + pytest, ruff, hypothesis, megatron-core
# A stamp records what was installed; a second run with nothing changed does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
# bubblewrap: the sandbox for model-written code (docs/sandbox.md). Installed when
# missing and we are root with apt-get; otherwise say how.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap"
    apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
  else
    echo "[setup] bubblewrap (bwrap) is missing: install it (e.g. 'sudo apt-get install bubblewrap')" >&2
  fi
fi
EXTRAS="${EXTRAS:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "[setup] .venv has $(python -V 2>&1): areal_like needs Python 3.11 or newer" \
       "(remove .venv, then run again with PYTHON=python3.11)" >&2
  exit 1
}
hash="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
want="${hash}-${EXTRAS}"
stamp=.venv/.areal_like_setup
have="$(cat "$stamp" 2>/dev/null || true)"
# Done when this pyproject was installed with these extras or more (the quickstart after
# the tests must not reinstall: `dev` includes the runtime).
if [ "$have" = "$want" ] || { [ -z "$EXTRAS" ] && [ "${have%%-*}" = "$hash" ]; }; then
  exit 0
fi
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="${TORCH_SPEC:-torch}"
  else
    # The CPU build; a plain `pip install torch` would pull a multi-GB CUDA build.
    TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
  fi
  echo "[setup] installing $TORCH_SPEC"
  python -m pip install -q "$TORCH_SPEC"
fi
spec="."
[ -n "$EXTRAS" ] && spec=".[${EXTRAS}]"
echo "[setup] installing areal_like ${spec}"
python -m pip install -q -e "$spec"
echo "$want" > "$stamp"
