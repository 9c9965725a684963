#!/usr/bin/env bash
# `.ci/run` N times in a row (default 20) on fresh clones of one commit: the determinism check
# of issue 36. One line per run in $KVO_LOOP_OUT (default /tmp/ci_loop.txt); stops at the first
# failure. Run it in the background: one run takes 12-16 minutes on a 2-core box.
#   bash .ci/loop.sh [N]
set -u
src=$(cd "$(dirname "$0")/.." && pwd)
sha=$(git -C "$src" rev-parse HEAD)
out=${KVO_LOOP_OUT:-/tmp/ci_loop.txt}
for i in $(seq 1 "${1:-20}"); do
  rm -rf /tmp/ci_loop_clone && git clone -q "$src" /tmp/ci_loop_clone && git -C /tmp/ci_loop_clone checkout -q "$sha"
  s=$(date +%s)
  (cd /tmp/ci_loop_clone && KVO_CI_VENV=/tmp/kvoffload-ci-loop-venv bash .ci/run > "/tmp/ci_loop_$i.log" 2>&1)
  rc=$?
  echo "run $i sha $sha rc $rc secs $(( $(date +%s) - s )) $(grep -E '^[0-9]+ passed' "/tmp/ci_loop_$i.log" | tail -1)" >> "$out"
  [ "$rc" -eq 0 ] || exit "$rc"
done
