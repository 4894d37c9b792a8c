#!/usr/bin/env bash
# The README's quickstart: set up (idempotent), then train the small local model on the
# calculator task with both clusters on this machine. The dashboard URL is printed at
# start; the run folder gets a report (plots + summary) at the end.
#   scripts/quickstart.sh [--set KEY=VALUE ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
run_dir="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
rc=0
areal-like run configs/quickstart.yaml --set run.dir="$run_dir" "$@" || rc=$?
# A run stopped with Ctrl-C (exit 130) wrote its checkpoint and summary: report it too.
if [ -f "$run_dir/metrics.jsonl" ]; then
  areal-like report "$run_dir"
fi
exit "$rc"
