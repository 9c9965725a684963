#!/usr/bin/env bash
# Same-run A/B of two source trees on one GPU box: a tree before a change against this one.
#
#   mkdir -p .ab_before && git archive <before> | tar -x -C .ab_before    # once, where git is
#   (or: git archive -o ab_before.tar <before>, and pass ab_before.tar)
#   bash profiling/bench/ab_trees.sh [.ab_before | ab_before.tar]           # on the GPU box, repo root
#   bash profiling/bench/ab_trees.sh --dry-run .ab_before                   # CPU: argument parsing, imports
#
# .ab_before/ is git-ignored: carry it to the device with the working tree (run's `carry`).
# Builds both trees in place at once (KVO_CUDA_ARCHS=90 python setup.py build_ext --inplace,
# timed), then runs each measurement interleaved, before then after, for AB_ROUNDS rounds:
#   transfer   bench_transfer --quick (sections but $AB_TRANSFER_SKIP)   -> transfer.json
#   connector  profiling/bench/ab_trees.py connector: the 1000-block submit rows in four GPU states
#              and the worker's bidirectional rate, the same measuring code for both trees
#   ttft       bench_ttft --lengths 32768,102400 --methods auto (the small engine, 8B shape)
# into $OUT/ab_trees/<before|after>/r<round>/ (odd rounds run before first, even rounds after first),
# then profiling/bench/ab_trees.py summary: medians over rounds, after/before per row and metric,
# target within 3% -> $OUT/ab_trees/summary.json. AB_STEPS picks measurements (default all three):
# the transfer pair alone takes ~190 s, so two calls (AB_STEPS="connector ttft", AB_STEPS=transfer)
# give more rounds; their folders merge, and `ab_trees.py summary --out` over the merge.
# AB_BEFORE_SHA / AB_AFTER_SHA: the trees' git shas, recorded in summary.json (pass literals: the
# device copy's git metadata can be stale).
# Budget: AB_BUDGET_S (default 340 s, the whole script): a step of round 2+ whose pair would not
# fit in what is left (its round-1 time x2) is skipped and logged, so the summary still comes.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
SRC="${1:-.ab_before}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUTD="${OUT:-/tmp/ab_out}/ab_trees"
BUDGET="${AB_BUDGET_S:-340}"
ROUNDS="${AB_ROUNDS:-2}"
TSKIP="${AB_TRANSFER_SKIP:-ctas,interference}"
STEPS="${AB_STEPS:-connector transfer ttft}"   # a subset per call: two calls' ab_trees/ folders merge (distinct files)
PY="${PYTHON:-python3}"
mkdir -p "$OUTD"
LOG="$OUTD/ab.log"
log() { echo "=== $* (t=${SECONDS}s)" | tee -a "$LOG"; }

# ---- the tree before: a folder, or a tarball unpacked next to this repo's root
if [ -f "$SRC" ]; then
  BEFORE="$ROOT/.ab_before_tree"; rm -rf "$BEFORE"; mkdir -p "$BEFORE"; tar -xf "$SRC" -C "$BEFORE"
else
  BEFORE="$(cd "$SRC" 2>/dev/null && pwd)" || { echo "no tree before at $SRC (see the header)"; exit 2; }
fi
[ -f "$BEFORE/setup.py" ] && [ -d "$BEFORE/connector" ] || { echo "$BEFORE is not a kvoffload tree"; exit 2; }
AFTER="$ROOT"
log "before: $BEFORE; after: $AFTER; out: $OUTD; budget ${BUDGET}s, $ROUNDS rounds of '$STEPS', transfer skips '$TSKIP'"

# the benches' module per tree: profiling/bench/bench_X.py (after) or profiling/bench_X.py (before)
bench() {  # bench <tree> <name> -> the command's first words
  if [ -f "$1/profiling/bench/$2.py" ]; then echo "-m profiling.bench.$2"; else echo "profiling/$2.py"; fi
}

run_in() {  # run_in <tree> <label> <timeout s> <args...>: python in that tree, its own extension
  local tree=$1 label=$2 lim=$3; shift 3
  ( cd "$tree" && PYTHONPATH="$tree" KVO_RESULTS="$OUTD/_stray" KVO_GIT_SHA="$label" \
      timeout "$lim" $PY "$@" ) >> "$LOG" 2>&1
}

if [ $DRY = 1 ]; then
  for t in before after; do
    tree=$BEFORE; [ $t = after ] && tree=$AFTER
    for b in bench_transfer bench_ttft; do
      run_in "$tree" $t 120 $(bench "$tree" $b) --help > /dev/null && log "$t $b --help ok" || log "$t $b --help FAILED"
    done
    run_in "$tree" $t 120 "$AFTER/profiling/bench/ab_trees.py" check && log "$t check ok" || log "$t check FAILED"
    run_in "$tree" $t 60 "$AFTER/profiling/bench/ab_trees.py" connector --help > /dev/null && log "$t connector args ok"
  done
  run_in "$AFTER" after 60 "$AFTER/profiling/bench/ab_trees.py" summary --out "$OUTD"
  grep -E "kernels /|FAILED|ok$|summary" "$LOG"
  exit 0
fi

# ---- builds, both at once, timed
build() {
  local t0=$SECONDS
  ( cd "$1" && KVO_CUDA_ARCHS=90 $PY setup.py build_ext --inplace ) > "$OUTD/build_$2.log" 2>&1
  local rc=$?
  echo "$2 $rc $((SECONDS - t0))" > "$OUTD/build_$2.rc"
}
log "build both trees"
build "$BEFORE" before & build "$AFTER" after & wait
for t in before after; do
  read -r _ rc secs < "$OUTD/build_$t.rc"
  log "build $t: status $rc in ${secs}s"
  [ "$rc" = 0 ] || { tail -30 "$OUTD/build_$t.log"; exit 3; }
done
for t in before after; do
  tree=$BEFORE; [ $t = after ] && tree=$AFTER
  run_in "$tree" $t 120 "$AFTER/profiling/bench/ab_trees.py" check || { log "$t does not import"; tail -20 "$LOG"; exit 4; }
done

declare -A DUR
step() {  # step <name> <round>: the pair (before, after) of one measurement
  local name=$1 r=$2 t tree d0 left lim order="before after"
  [ $((r % 2)) = 0 ] && order="after before"   # even rounds run the tree after first: no fixed order
  left=$((BUDGET - SECONDS - 15))
  if [ "$r" -gt 1 ] && [ $((2 * ${DUR[$name]:-0})) -gt $left ]; then   # a whole pair or none
    log "skip $name round $r: ${left}s left, a pair took $((2 * ${DUR[$name]:-0}))s"; return
  fi
  for t in $order; do
    tree=$BEFORE; [ $t = after ] && tree=$AFTER
    left=$((BUDGET - SECONDS - 15))
    [ $left -lt 10 ] && { log "skip $name round $r ($t): out of budget"; return; }
    lim=$left; [ $lim -gt 240 ] && lim=240
    local o="$OUTD/$t/r$r"; mkdir -p "$o"; d0=$SECONDS
    log "$name $t round $r"
    case $name in
      transfer) run_in "$tree" $t $lim $(bench "$tree" bench_transfer) --quick --skip "$TSKIP" --out "$o" ;;
      connector) run_in "$tree" $t $lim "$AFTER/profiling/bench/ab_trees.py" connector --out "$o" ;;
      ttft) run_in "$tree" $t $lim $(bench "$tree" bench_ttft) --lengths 32768,102400 --methods auto --out "$o" ;;
    esac
    log "$name $t round $r: status $? in $((SECONDS - d0))s"
    [ "$r" = 1 ] && [ $t = before ] && DUR[$name]=$((SECONDS - d0))
  done
}
for r in $(seq 1 "$ROUNDS"); do
  for name in $STEPS; do step $name "$r"; done
done
run_in "$AFTER" after 60 "$AFTER/profiling/bench/ab_trees.py" summary --out "$OUTD"
tail -3 "$LOG"
log "done"
